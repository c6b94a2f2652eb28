#!/bin/bash
# The feature draft F beside the quantized target on Q8_0 blocks (--draft-dtype q, now what auto picks)
# against bf16, plain decoding beside both, k = auto, batches interleaved by method
# (benchmarks/bench_step_overhead.py --draft-dtypes q,bf16).
# usage: results/feature-q8-2026-12-05/run.sh [b1|b1-k1|b1-attack|b8|lookup-k|latency] [tag]
#   lookup-k: prompt lookup with k = auto, 1 and 2; latency: the target's T(n) at batch 1
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
name=${1:-b1}
if [ "$name" = latency ]; then  # the quantized target's T(n) at batch 1, n = 1..5 tokens fed (specdraft profile)
  step "$OUT/latency-$(git rev-parse --short HEAD).txt" .venv/bin/python -m specdraft.cli profile --draft none \
    --batch 1 --new-tokens 1,2,3,4,5 --context 200 --repeats 30 --threads 2 --no-breakdown </dev/null
  exit
fi
draft=designed:smollm2-135m-feature-4k-second
case "$name" in
  lookup-k) draft=lookup; args="--batch 1 --limit 1 --rounds 2 --policies auto,1,2" ;;  # prompt lookup
  b1) args="--batch 1 --limit 1 --rounds 2" ;;
  b1-k1) args="--batch 1 --limit 1 --rounds 2 --policies auto,1" ;;  # k = auto and k = 1
  b1-attack) args="--batch 1 --limit 1 --rounds 2 --attack" ;;
  b8) args="--batch 8 --limit 2 --rounds 1" ;;
  *) echo "usage: $0 [b1|b1-k1|b1-attack|b8|lookup-k|latency] [tag]" >&2; exit 2 ;;
esac
log="$OUT/$name-$(git rev-parse --short HEAD)${2:-}"
dtypes=q,bf16
[ "$draft" = lookup ] && dtypes=auto  # no model: its precision changes nothing
step "$log.txt" .venv/bin/python benchmarks/bench_step_overhead.py --draft $draft --draft-dtypes $dtypes $args \
  --threads 2 --json "$log.json" </dev/null
