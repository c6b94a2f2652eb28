#!/bin/bash
# What the feature draft F costs per proposal beside the quantized target, before and after e37cb4f (greedy
# tokens over its 8k-row head's own rows, fewer small tensor operations per proposal, the kernels' views of
# weight matrices and KV caches made once), and F's speed over plain decoding with k = auto and k = 1.
# usage: results/feature-draft-cost-2026-12-05/run.sh steps after|before [tag]
#          benchmarks/bench_step_overhead.py: decode ms per step split into the target's forward, drafting
#          and the rest; plain decoding, F at k = 1 and k = auto; 13 Spec-Bench first turns x 2 rounds, batch 1
#        results/feature-draft-cost-2026-12-05/run.sh policy [tag]
#          benchmarks/bench_policy.py: F with k = auto and k = 1, 26 Spec-Bench first turns, batch 1
#          (LIMIT=4 in the environment: 52)
#        results/feature-draft-cost-2026-12-05/run.sh policy-ab after|before B [tag]
#          the same with k = auto only (k = 1 too at batch 1), batch B, at this checkout or at a4fd01e
#   before: main before this work (a4fd01e), in a worktree beside this checkout (../sd-a4fd01e, so that
#   ../shared is found), with this checkout's venv.
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
ROOT=$(pwd)
BASE=a4fd01e
F=designed:smollm2-135m-feature-4k-second
usage="usage: $0 steps after|before [tag] | policy [tag] | policy-ab after|before B [tag]"
case "${1:-}:${2:-}" in  # where a before/after mode runs: this checkout, or a worktree of BASE
  steps:after|policy-ab:after) dir=. ;;
  steps:before|policy-ab:before) dir=$(checkout_at $BASE) ;;
  steps:*|policy-ab:*) echo "$usage" >&2; exit 2 ;;
esac
case "${1:-}" in
  steps)
    c=$(cd "$dir" && git rev-parse --short HEAD)
    (cd "$dir" && step "$OUT/steps-$c${3:-}.txt" "$ROOT/.venv/bin/python" benchmarks/bench_step_overhead.py \
      --draft $F --policies 1,auto --limit 1 --rounds 2 --max-new-tokens 128 --threads 2) </dev/null ;;
  policy)  # LIMIT=4: 4 prompts per category (52), files policy-l4-*
    L=${LIMIT:-2}; [ "$L" = 2 ] && name=policy || name=policy-l$L
    step "$OUT/$name-$(git rev-parse --short HEAD)${2:-}.txt" .venv/bin/python benchmarks/bench_policy.py --draft $F \
      --policies auto,1 --limit "$L" --max-new-tokens 128 --threads 2 \
      --json "$OUT/$name-$(git rev-parse --short HEAD)${2:-}.json" </dev/null ;;
  policy-ab)
    B=${3:?batch size}
    [ "$B" = 1 ] && pol=auto,1 || pol=auto
    c=$(cd "$dir" && git rev-parse --short HEAD)
    (cd "$dir" && step "$OUT/policy-b$B-$c${4:-}.txt" "$ROOT/.venv/bin/python" benchmarks/bench_policy.py --draft $F \
      --batch "$B" --policies $pol --limit 2 --max-new-tokens 128 --threads 2) </dev/null ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
