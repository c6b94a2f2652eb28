#!/bin/bash
# How far decoys in the prompt could lower prompt lookup's acceptance on the 20 held-in prompts of
# results/attack-2026-12-04 (benchmarks/bench_lookup_reach.py: the target's greedy answers, lookup replayed at
# the attack's fixed k = 5, 64 new tokens).
# usage: results/lookup-reach-2026-12-05/run.sh [tag]
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
c=$(git rev-parse --short HEAD)${1:-}
step "$OUT/reach-$c.txt" .venv/bin/python benchmarks/bench_lookup_reach.py --prompts results/attack-2026-12-04/prompts20.jsonl \
  --limit 20 --max-new-tokens 64 --k 5 --threads 2 --json "$OUT/reach-$c.json" </dev/null
