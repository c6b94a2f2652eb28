#!/bin/bash
# Issue 17's attack cost (<= 2 minutes a prompt on 2 cores) on the two prompts the continuous attack took
# longest on in results/attack-2026-12-04 (summarization and rag, long articles: long2.jsonl, from its
# prompts20.jsonl), with and without --time-budget, for the designed l2 draft and the pruned draft there.
# usage: results/attack-budget-2026-12-05/run.sh l2|prune budget|full
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
case "${1:-}" in
  l2) draft=designed:smollm2-135m-l2 ;;
  prune) draft=prune:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14 ;;
  *) echo "usage: $0 l2|prune budget|full" >&2; exit 2 ;;
esac
case "${2:-}" in
  budget) extra=(--time-budget 100) ;;
  full) extra=() ;;
  *) echo "usage: $0 l2|prune budget|full" >&2; exit 2 ;;
esac
step "$OUT/$1-$2.log" .venv/bin/specdraft attack --target smollm2-135m --prompts "$OUT/long2.jsonl" \
  --max-new-tokens 64 --threads 2 --draft "$draft" --method continuous "${extra[@]}" --out "$OUT/$1-$2" </dev/null
