#!/bin/bash
# The study re-run on trained drafts (issue 20): the committed draft family
# (drafts/smollm2-135m-family, one recipe, 400 steps each), the designed l2 draft, the target's layers
# pruned without training (the "existing" drafts) and prompt lookup; bf16 target, k 1-8, batch
# 1-8, the 14 datasets; 12 configurations validated online with latencies re-measured around each.
# usage: [OUT=DIR] [FAMILY='d1-full-h16k ...'] results/study-smollm2-135m/run.sh
set -u
OUT=$(mkdir -p "${OUT:-$(dirname "$0")}" && cd "${OUT:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../.."
. results/step.sh  # step LOG cmd...
FAMILY=${FAMILY:-$(cd drafts/smollm2-135m-family && ls -d d*-h*)}
DRAFTS=$(printf 'designed:smollm2-135m-family/%s;' $FAMILY)
DRAFTS+='designed:smollm2-135m-l2;prune:0;prune:0,1;prune:0,1,2,3;lookup'
step "$OUT/study.log" .venv/bin/specdraft study --target smollm2-135m --dtype bf16 --drafts "$DRAFTS" \
  --k 1,2,3,4,5,6,7,8 --batch 1,2,4,8 --prompts-per-dataset 3 --heldout 8 --max-new-tokens 48 \
  --max-prompt-tokens 1024 --profile-repeats 5 --threads 2 --workers 2 --validate 12 --validate-prompts 3 \
  --validate-reprofile --no-progress --out "$OUT"
step "$OUT/report.log" .venv/bin/specdraft report "$OUT/results.jsonl" --out "$OUT"
