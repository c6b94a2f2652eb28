#!/bin/bash
# Issue 17's attack cost (<= 2 minutes a prompt on 2 cores) with the continuous attack's window (the message's
# last 128 tokens perturbed, the text before them run once) against the whole message (--window 0, the search
# before the window), on the two long prompts of results/attack-budget-2026-12-05 (long2.jsonl), and the
# windowed attack on the 20 held-in prompts of results/attack-2026-12-04 (prompts20.jsonl), 64 new tokens.
# usage: results/attack-window-2026-12-05/run.sh l2|prune window|whole|all20
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
case "${1:-}" in
  l2) draft=designed:smollm2-135m-l2 ;;
  prune) draft=prune:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14 ;;
  *) echo "usage: $0 l2|prune window|whole|all20" >&2; exit 2 ;;
esac
case "${2:-}" in
  window) prompts=long2.jsonl extra=() ;;
  whole) prompts=long2.jsonl extra=(--window 0) ;;
  all20) prompts=prompts20.jsonl extra=() ;;
  *) echo "usage: $0 l2|prune window|whole|all20" >&2; exit 2 ;;
esac
step "$OUT/$1-$2.log" .venv/bin/specdraft attack --target smollm2-135m --prompts "$OUT/$prompts" \
  --max-new-tokens 64 --threads 2 --draft "$draft" --method continuous "${extra[@]}" --out "$OUT/$1-$2" </dev/null
