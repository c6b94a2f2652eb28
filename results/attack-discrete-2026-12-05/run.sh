#!/bin/bash
# Issue 17's discrete (suffix) attack on the designed l2 draft at scale, its head run once (losses.Prefix, 3d647ab):
# the 20 held-in prompts of results/attack-2026-12-04 (prompts20.jsonl), and its cost on the summarization
# prompt of long2.jsonl (3,259 characters) at this commit and at 79ed61c (every candidate's forward over the
# whole prompt), 64 new tokens, 2 threads, the default search (20 steps, 32 candidates, an 8-token suffix).
# usage: results/attack-discrete-2026-12-05/run.sh all20|long-after|long-before
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
args=(--target smollm2-135m --max-new-tokens 64 --threads 2 --draft designed:smollm2-135m-l2 --method discrete)
case "${1:-}" in
  all20) step "$OUT/all20.log" .venv/bin/specdraft attack "${args[@]}" --prompts "$OUT/prompts20.jsonl" \
           --out "$OUT/all20" </dev/null ;;
  long-after) step "$OUT/long-after.log" .venv/bin/specdraft attack "${args[@]}" --prompts "$OUT/long2.jsonl" \
                --limit 1 --out "$OUT/long-after" </dev/null ;;
  long-before) dir=$(checkout_at 79ed61c)
               (cd "$dir" && step "$OUT/long-before.log" env PYTHONPATH="$dir" "$OLDPWD/.venv/bin/python" -m \
                  specdraft.cli attack "${args[@]}" --prompts "$OUT/long2.jsonl" --limit 1 --out "$OUT/long-before" \
                  </dev/null) ;;
  *) echo "usage: $0 all20|long-after|long-before" >&2; exit 2 ;;
esac
