#!/bin/bash
# The quantized runtime's fp16 key/value cache against an fp32 one in one run (benchmarks/bench_kv_cache.py):
# one-token step times at 128-2048 tokens of context, Spec-Bench first turns (plain decoding and prompt lookup
# at k = auto, greedy, batch 1, 128 new tokens), greedy agreement and perplexity. SmolLM2-135M, 2 threads.
# usage: results/kv16-2026-12-07/run.sh [tag]
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
step "$OUT/bench-$(git rev-parse --short HEAD)${1:-}.txt" .venv/bin/python benchmarks/bench_kv_cache.py \
  --threads 2 --limit 2 --max-new-tokens 128 --json "$OUT/bench-$(git rev-parse --short HEAD)${1:-}.json" </dev/null
