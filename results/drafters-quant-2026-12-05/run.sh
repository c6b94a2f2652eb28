#!/bin/bash
# Every model-free and feature drafter on the quantized SmolLM2 target, batch 1, in one run
# (benchmarks/bench_drafters.py: 26 Spec-Bench first turns, 128 new tokens, greedy, methods interleaved per prompt).
# usage: results/drafters-quant-2026-12-05/run.sh [tag]
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
F=designed:smollm2-135m-feature-4k-second
step "$OUT/bench-$(git rev-parse --short HEAD)${1:-}.txt" .venv/bin/python benchmarks/bench_drafters.py --limit 2 \
  --max-new-tokens 128 --threads 2 --json "$OUT/bench-$(git rev-parse --short HEAD)${1:-}.json" \
  --drafts "lookup@auto;suffix@auto;lookup-tree@auto;ouroboros:lookup@auto;$F@1;$F@auto;ouroboros:draft=smollm2-135m-feature-4k-second@auto;tree:dyn,$F@auto" </dev/null
