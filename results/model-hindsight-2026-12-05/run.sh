#!/bin/bash
# First-token outcomes a model draft reads back at its catch-up after steps without drafts (dc155ee): collapse
# detection for the designed draft l2 and the pruned draft on recorded requests (bench_detection.py --hindsight:
# outcomes recorded at k = 1, one per position, replayed with and without the read-backs), on the evaluation set
# and on the 200 training prompts the thresholds were chosen on; l2 with k = auto (read-backs) against auto-blind
# (none) and k = 1 in one process (bench_policy.py); readback N: the recorded evaluation and training requests
# replayed as a drafter reading back N outcomes per catch-up would have been (no model run); collapse COMMIT: the
# feature draft F with its one row's drafts spoiled (bench_collapse.py, batch 1, 25 rounds) at COMMIT (a worktree),
# a263704 (WrongRows: a spoiled row's read-backs are misses) against dc155ee (passed through as the inner draft's).
# usage: results/model-hindsight-2026-12-05/run.sh detection|calibration|policy|readback N|collapse COMMIT [tag]
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
D="designed:smollm2-135m-l2;prune:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14"
L2=designed:smollm2-135m-l2
c=$(git rev-parse --short HEAD)${2:-}
case "${1:-}" in
  detection) step "$OUT/detection-$c.txt" .venv/bin/python benchmarks/bench_detection.py --drafts "$D" --k 1 \
    --hindsight --limit 52 --gsm8k 20 --max-new-tokens 128 --threads 2 --out "$OUT/detection-hits.json" </dev/null ;;
  calibration) step "$OUT/calibration-$c.txt" .venv/bin/python benchmarks/bench_detection.py --drafts "$D" --k 1 \
    --hindsight --calibration 200 --gsm8k 20 --max-new-tokens 128 --threads 2 \
    --out "$OUT/calibration-hits.json" </dev/null ;;
  policy) step "$OUT/policy-$c.txt" .venv/bin/python benchmarks/bench_policy.py --draft $L2 --policies \
    auto,auto-blind,1 --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/policy-$c.json" </dev/null ;;
  readback) for set in detection calibration; do
      step "$OUT/$set-readback$2-$(git rev-parse --short HEAD).txt" .venv/bin/python benchmarks/bench_detection.py \
        --hits "$OUT/$set-hits.json" --read-back "$2" </dev/null
    done ;;
  collapse) dir=$(checkout_at "$2"); ROOT=$(pwd)
    (cd "$dir" && step "$OUT/collapse-F-b1-$2${3:-}.txt" "$ROOT/.venv/bin/python" benchmarks/bench_collapse.py \
      --draft designed:smollm2-135m-feature-4k-second --batch 1 --attacked 1 --max-new-tokens 128 --threads 2 \
      --rounds 25) </dev/null ;;
  *) echo "usage: $0 detection|calibration|policy|readback N|collapse COMMIT [tag]" >&2; exit 2 ;;
esac
