#!/bin/bash
# First-token outcomes a feature draft reads back at its catch-up pairs (hindsight, 9f84c7a): the feature
# draft F with k = auto (hindsight), auto-blind (without), auto-before (without, and the safe arm judging
# probes too: the policy before) and k = 1, quantized target,
# batch 1, one process (bench_policy.py); and collapse detection for F on recorded requests
# (bench_detection.py --hindsight: outcomes recorded at k = 1 per position, replayed with catch-ups).
# usage: results/hindsight-2026-12-05/run.sh policy|detection|detection-calibration|collapse|collapse-b8|lookup-b1|lookup-b8 [tag]
#   lookup-b1, lookup-b8: prompt lookup (no read-backs: the change is the safe arm's) at batch 1 and 8
#   collapse: F's throughput with every draft spoiled (bench_collapse.py, batch 1, 25 rounds); collapse-b8:
#     4 of 8 rows spoiled, 3 rounds (run from a worktree of an earlier commit for the before)
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
F=designed:smollm2-135m-feature-4k-second
c=$(git rev-parse --short HEAD)${2:-}
case "${1:-}" in
  policy) step "$OUT/policy-$c.txt" .venv/bin/python benchmarks/bench_policy.py --draft $F --policies \
    ${POLICIES:-auto,auto-blind,auto-before,1} --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/policy-$c.json" </dev/null ;;
  detection) step "$OUT/detection-$c.txt" .venv/bin/python benchmarks/bench_detection.py --drafts $F --k 1 \
    --hindsight --limit 52 --gsm8k 20 --max-new-tokens 128 --threads 2 --out "$OUT/detection-hits.json" </dev/null ;;
  detection-calibration) step "$OUT/detection-calibration-$c.txt" .venv/bin/python benchmarks/bench_detection.py \
    --drafts $F --k 1 --hindsight --calibration 200 --gsm8k 20 --max-new-tokens 128 --threads 2 \
    --out "$OUT/detection-calibration-hits.json" </dev/null ;;  # the 200 training prompts thresholds were chosen on
  lookup-b1|lookup-b8) B=${1#lookup-b}  # prompt lookup: the policy now and before (probes counted), k = 1
    step "$OUT/$1-$c.txt" .venv/bin/python benchmarks/bench_policy.py --draft lookup --batch $B --policies \
      auto,auto-before,1 --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/$1-$c.json" </dev/null ;;
  collapse) step "$OUT/collapse_feature_b1_r25-$c.txt" .venv/bin/python benchmarks/bench_collapse.py --draft $F \
    --batch 1 --attacked 1 --max-new-tokens 128 --threads 2 --rounds 25 </dev/null ;;  # F under attack
  collapse-b8) step "$OUT/collapse_feature_b8-$c.txt" .venv/bin/python benchmarks/bench_collapse.py --draft $F \
    --batch 8 --attacked 4 --max-new-tokens 128 --threads 2 --rounds 3 </dev/null ;;  # 4 of 8 rows attacked
  *) echo "usage: $0 policy|detection|detection-calibration|collapse|collapse-b8|lookup-b1|lookup-b8 [tag]" >&2; exit 2 ;;
esac
