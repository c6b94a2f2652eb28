#!/usr/bin/env bash
# Issue 17: the attacks at scale on 20 held-in prompts (10 Spec-Bench first turns, one per category
# but math, humanities and stem, + 10 GSM8K train questions: prompts20.jsonl), 64 new tokens, 2 threads.
# Usage: bash results/attack-2026-12-04/run.sh [STEP...]   (steps: designed prune lookup discrete report)
set -euo pipefail
O=results/attack-2026-12-04
P=$O/prompts20.jsonl
PRUNE=prune:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14  # the pruned draft that accepts most (results/study-smollm2-135m-untrained)
A="--target smollm2-135m --prompts $P --max-new-tokens 64 --threads 2"
SD=".venv/bin/specdraft"
STEPS=("$@"); [ $# -gt 0 ] || STEPS=(designed prune lookup report)
for step in "${STEPS[@]}"; do
  case $step in
    designed) $SD attack $A --limit 20 --draft designed:auto --method continuous --out $O/continuous-designed \
                2>&1 | tee $O/continuous-designed.log ;;
    prune) $SD attack $A --limit 20 --draft $PRUNE --method continuous --out $O/continuous-prune \
             2>&1 | tee $O/continuous-prune.log ;;
    lookup) $SD attack $A --limit 20 --draft lookup --method lookup --max-decoys 32 --out $O/lookup \
              2>&1 | tee $O/lookup.log ;;
    discrete) $SD attack $A --limit 20 --draft designed:auto --method discrete --out $O/discrete-designed \
                2>&1 | tee $O/discrete-designed.log ;;
    report) $SD report $O/*/attack.json --out $O 2>&1 | tee $O/report.log ;;
  esac
done
