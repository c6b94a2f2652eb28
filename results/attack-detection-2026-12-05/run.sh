#!/bin/bash
# Issue 17's detection on the continuous attack's own attacked requests (fd05540): the windowed continuous attack
# on the 20 held-in prompts of results/attack-2026-12-04 (prompts20.jsonl: 10 Spec-Bench first turns, 10 GSM8K
# train questions), each prompt's clean then attacked first-token outcomes (simulated on the differentiable models,
# one per position) replayed through one policy's detection with a model draft's read-backs.
# usage: results/attack-detection-2026-12-05/run.sh l2|prune [max-new-tokens, default 64]
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
case "${1:-}" in
  l2) draft=designed:smollm2-135m-l2 ;;
  prune) draft=prune:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14 ;;
  *) echo "usage: $0 l2|prune [max-new-tokens]" >&2; exit 2 ;;
esac
n=${2:-64}
step "$OUT/$1-$n.log" .venv/bin/specdraft attack --target smollm2-135m --prompts results/attack-2026-12-04/prompts20.jsonl \
  --max-new-tokens "$n" --threads 2 --draft "$draft" --method continuous --out "$OUT/$1-$n" </dev/null
