#!/bin/bash
# The cost-aware policy pricing a speculative step's rest (CostAwareK.extra: verification, commit and
# bookkeeping beyond a plain step's), against the policy before it (c78adb0): k = auto over plain decoding
# (benchmarks/bench_policy.py, 26 Spec-Bench first turns, 128 new tokens), prompt lookup and the feature
# draft F at batch 1 and 8.
# usage: results/step-rest-2026-12-05/run.sh after|before lookup|feature B [tag]
#   before: c78adb0, after: fb0c593 (the pricing, reverted since: 2a05647), each in a worktree beside this
#   checkout (../sd-<commit>, so that ../shared is found), with this checkout's venv.
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
ROOT=$(pwd)
case "${1:-}" in
  after) at=fb0c593 ;;
  before) at=c78adb0 ;;
  *) echo "usage: $0 after|before lookup|feature B [tag]" >&2; exit 2 ;;
esac
dir=$(checkout_at $at)
case "${2:-}" in
  lookup) spec=lookup ;;
  feature) spec=designed:smollm2-135m-feature-4k-second ;;
  *) echo "usage: $0 after|before lookup|feature B [tag]" >&2; exit 2 ;;
esac
B=${3:?batch size}
c=$(cd "$dir" && git rev-parse --short HEAD)
(cd "$dir" && step "$OUT/$2-b$B-$c${4:-}.txt" "$ROOT/.venv/bin/python" benchmarks/bench_policy.py --draft $spec \
  --batch "$B" --policies auto --limit 2 --max-new-tokens 128 --threads 2) </dev/null
