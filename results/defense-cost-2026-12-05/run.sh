#!/bin/bash
# What issue 17's defense costs on clean traffic: the cost-aware policy as the engine runs it (`auto`: per-row
# watch, probes, hindsight read-backs, the safe arm) against the same policy without them (`auto-undefended`:
# one acceptance record for the batch, the model's choice unchecked by the clock), over plain decoding in the
# same process (benchmarks/bench_policy.py, Spec-Bench first turns, 128 new tokens, greedy).
# usage: results/defense-cost-2026-12-05/run.sh lookup|feature B [tag]
#   LIMIT=N in the environment: N prompts per Spec-Bench category (default 4: 52 prompts)
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
case "${1:-}" in
  lookup) spec=lookup ;;
  feature) spec=designed:smollm2-135m-feature-4k-second ;;
  *) echo "usage: $0 lookup|feature B [tag]" >&2; exit 2 ;;
esac
B=${2:?batch size}
name="$1-b$B-$(git rev-parse --short HEAD)${3:-}"
step "$OUT/$name.txt" .venv/bin/python benchmarks/bench_policy.py --draft $spec --batch "$B" \
  --policies auto,auto-undefended --limit "${LIMIT:-4}" --max-new-tokens 128 --threads 2 --json "$OUT/$name.json" </dev/null
