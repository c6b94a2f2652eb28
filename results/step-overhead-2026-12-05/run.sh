#!/bin/bash
# A decode step's time split into the target's forward, drafting and the rest (Python, small tensor
# operations), plain decoding against prompt lookup with k = auto (benchmarks/bench_step_overhead.py).
# usage: results/step-overhead-2026-12-05/run.sh after|before [tag]
#   before: the same benchmark on main before this work (c338216), in a worktree beside this checkout
#   (../sd-c338216, so that ../shared is found), with this checkout's venv and benchmark script.
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
ROOT=$(pwd)
BASE=c338216
WT="$ROOT/../sd-$BASE"
where=${1:-}
tag=${2:-}
case "$where" in
  after) c=$(git rev-parse --short HEAD); dir=. ;;
  before) c=$BASE; dir=$WT
    [ -d "$WT" ] || git worktree add --detach -q "$WT" "$BASE"
    cp benchmarks/bench_step_overhead.py "$WT/benchmarks/" ;;
  *) echo "usage: $0 after|before [tag]" >&2; exit 2 ;;
esac
while read -r name args; do
  log="$OUT/$name-$c$tag.txt"
  (cd "$dir" && step "$log" "$ROOT/.venv/bin/python" benchmarks/bench_step_overhead.py $args --threads 2 \
    --json "$OUT/$name-$c$tag.json") </dev/null
done <<END
b1 --batch 1 --limit 1 --rounds 2
b1-attack --batch 1 --limit 1 --rounds 2 --attack
b8 --batch 8 --limit 2 --rounds 2
END
