#!/bin/bash
# The first trained parallel drafters (issue 19): the block-diffusion draft (drafts/smollm2-135m-diffusion)
# with its length head and at fixed block lengths, and the FlexDraft draft (drafts/smollm2-135m-flex),
# beside the feature draft that reads the prompt, on Spec-Bench, batch 1, greedy, bf16 target.
# usage: [OUT=DIR] [DIFF=DRAFT] [FLEX=DRAFT] [DRAFTS='spec@k;...'] [LIMIT=2] results/parallel-drafters-2026-12-03/run.sh
set -u
OUT=$(mkdir -p "${OUT:-$(dirname "$0")}" && cd "${OUT:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../.."
. results/step.sh  # step LOG cmd...
D=diffusion:${DIFF:-smollm2-135m-diffusion}
F=designed:${FLEX:-smollm2-135m-flex}
P=designed:smollm2-135m-feature-prompt
DRAFTS=${DRAFTS:-"$P@2;$D@auto;$D,fixed@auto;$D,fixed@3;$D,fixed@5;$D,fixed@7;$F@auto;$F@2;$F@4"}
# bf16 outputs that differ from plain decoding: near-ties (specdraft.lossless) or not
for d in "$D" "$F"; do
  step "$OUT/check_$(basename "${d#*:}").txt" .venv/bin/specdraft check --target smollm2-135m --draft "$d" --dtype bf16 --k 4 \
    --threads 2 --prompts ../shared/data/spec_bench/question.jsonl --limit 8 --max-new-tokens 64 --drift
done
[ -n "${ONLY_CHECK:-}" ] && exit 0
# what FlexDraft's mask tokens and next draft cost on top of a verification forward
step "$OUT/flex_cost.txt" .venv/bin/python benchmarks/bench_flex.py --draft "$F" --k 4 --threads 2 --rounds 30
step "$OUT/bf16.txt" .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --limit "${LIMIT:-2}" \
  --max-new-tokens 64 --threads 2 --drafts "$DRAFTS" --json "$OUT/bf16.json" --plot "$OUT/bf16.png"
