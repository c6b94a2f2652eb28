#!/bin/bash
# The fp16 attention kernel (rope_attend16) with the 8-lane softmax max against 040fd3e's scalar max, in one
# run (benchmarks/bench_attention.py): SmolLM2-135M's shape, 30 layers, T = 1 and 4 new tokens, contexts
# 128-4000, 2 threads, bit-for-bit comparison of outputs and caches.
# usage: results/attention-2026-12-07/run.sh [tag]
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
step "$OUT/bench-$(git rev-parse --short HEAD)${1:-}.txt" .venv/bin/python benchmarks/bench_attention.py \
  --base 040fd3e --threads 2 --rounds 21 </dev/null
