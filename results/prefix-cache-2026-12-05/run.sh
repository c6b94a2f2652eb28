#!/bin/bash
# A chat's second turn with and without the prompt prefix cache: Spec-Bench's two-turn questions
# (benchmarks/bench_prefix_cache.py), SmolLM2-135M quantized target, prompt lookup at k = auto, greedy.
# usage: results/prefix-cache-2026-12-05/run.sh [tag]
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
step "$OUT/bench-$(git rev-parse --short HEAD)${1:-}.txt" .venv/bin/python benchmarks/bench_prefix_cache.py \
  --limit 2 --max-new-tokens 128 --threads 2 </dev/null
