#!/bin/bash
# The feature-drafter family on Spec-Bench after the draft-latency change (relative cache slots, so a
# causal draft step runs on the native kernels; fc on the packed bf16 kernel), and the same bench at the
# commit before it (BEFORE=DIR: a checkout of that commit, e.g. `git worktree add DIR 30a662a`).
# usage: [BEFORE=DIR] [LIMIT=2] results/feature-latency-2026-12-04/run.sh
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$OUT/../.." && pwd)
. "$ROOT/results/step.sh"  # step LOG cmd...
F=designed:smollm2-135m-feature
DRAFTS="$F@1;$F@2;$F@auto;designed:smollm2-135m-dream@2;designed:smollm2-135m-ctc@4"
bench() {  # bench CODE_DIR NAME
  (cd "$1" && step "$OUT/$2.txt" "$ROOT/.venv/bin/python" benchmarks/bench_drafters.py --dtype bf16 \
    --limit "${LIMIT:-2}" --max-new-tokens 64 --threads 2 --drafts "$DRAFTS" --json "$OUT/$2.json")
}
bench "$ROOT" after
[ -n "${BEFORE:-}" ] && bench "$BEFORE" before
exit 0
