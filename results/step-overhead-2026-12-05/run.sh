#!/bin/bash
# A decode step's time split into the target's forward, drafting and the rest (Python, small tensor
# operations), plain decoding against prompt lookup with k = auto (benchmarks/bench_step_overhead.py).
# usage: results/step-overhead-2026-12-05/run.sh after|before [tag [name]]
#        results/step-overhead-2026-12-05/run.sh collapse after|before [tag [lookup|feature]]  (bench_collapse.py,
#          batch 1, 25 rounds)
#        results/step-overhead-2026-12-05/run.sh cold  (small tensor operations right after a forward, and warm)
#        results/step-overhead-2026-12-05/run.sh feature-k  (bench_policy.py: F with k = auto and k = 1, batch 1)
#        results/step-overhead-2026-12-05/run.sh collapse-b8  (bench_collapse.py: batch 8, 4 rows attacked)
#   before: the same benchmark on main before this work (c338216), in a worktree beside this checkout
#   (../sd-c338216, so that ../shared is found), with this checkout's venv and benchmark script.
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
ROOT=$(pwd)
BASE=c338216
WT="$ROOT/../sd-$BASE"
mode=steps
if [ "${1:-}" = feature-k ]; then  # the feature draft F beside the quantized target: k = auto and k = 1
  step "$OUT/policy_feature_b1-$(git rev-parse --short HEAD).txt" .venv/bin/python benchmarks/bench_policy.py \
    --draft designed:smollm2-135m-feature-4k-second --dtype auto --batch 1 --policies auto,1 --limit 1 \
    --max-new-tokens 128 --threads 2 </dev/null
  exit
fi
if [ "${1:-}" = collapse-b8 ]; then  # batch 8, 4 rows attacked, 3 rounds (prompt lookup)
  step "$OUT/collapse_lookup_b8-$(git rev-parse --short HEAD).txt" .venv/bin/python benchmarks/bench_collapse.py \
    --draft lookup --batch 8 --attacked 4 --max-new-tokens 128 --threads 2 --rounds 3 </dev/null
  exit
fi
if [ "${1:-}" = cold ]; then
  step "$OUT/cold-$(git rev-parse --short HEAD).txt" .venv/bin/python benchmarks/bench_step_overhead.py --cold --threads 2
  exit
fi
if [ "${1:-}" = collapse ]; then mode=collapse; shift; fi
where=${1:-}
tag=${2:-}
case "$where" in
  after) c=$(git rev-parse --short HEAD); dir=. ;;
  before) c=$BASE; dir=$WT
    [ -d "$WT" ] || git worktree add --detach -q "$WT" "$BASE"
    cp benchmarks/bench_step_overhead.py "$WT/benchmarks/" ;;
  *) echo "usage: $0 after|before [tag]" >&2; exit 2 ;;
esac
if [ $mode = collapse ]; then
  draft=${3:-lookup}  # run.sh collapse after|before TAG DRAFT: another drafter (the feature draft F: feature)
  [ "$draft" = feature ] && spec=designed:smollm2-135m-feature-4k-second || spec=$draft
  (cd "$dir" && step "$OUT/collapse_${draft}_b1_r25-$c$tag.txt" "$ROOT/.venv/bin/python" benchmarks/bench_collapse.py \
    --draft "$spec" --batch 1 --attacked 1 --max-new-tokens 128 --threads 2 --rounds 25) </dev/null
  exit
fi
only=${3:-}  # run.sh after|before TAG NAME: only that line below
while read -r name args; do
  [ -n "$only" ] && [ "$name" != "$only" ] && continue
  log="$OUT/$name-$c$tag.txt"
  (cd "$dir" && step "$log" "$ROOT/.venv/bin/python" benchmarks/bench_step_overhead.py $args --threads 2 \
    --json "$OUT/$name-$c$tag.json") </dev/null
done <<END
b1 --batch 1 --limit 1 --rounds 2
b1-attack --batch 1 --limit 1 --rounds 2 --attack
b8 --batch 8 --limit 2 --rounds 2
b1-feature --batch 1 --limit 1 --rounds 2 --draft designed:smollm2-135m-feature-4k-second
END
