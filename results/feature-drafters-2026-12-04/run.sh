#!/bin/bash
# Issue 18's drafters side by side on Spec-Bench (batch 1, greedy, bf16 target): the DREAM-style draft
# (drafts/smollm2-135m-dream) and the CTC draft (drafts/smollm2-135m-ctc), both fine-tuned from the
# EAGLE-style feature draft (drafts/smollm2-135m-feature), that draft alone and fused with its DeLS-Spec
# local head (local:designed:...), the feature draft that reads the prompt, and the designed l2 draft.
# usage: [OUT=DIR] [DRAFTS='spec@k;...'] [LIMIT=2] [ONLY_CHECK=1] results/feature-drafters-2026-12-04/run.sh
set -u
OUT=$(mkdir -p "${OUT:-$(dirname "$0")}" && cd "${OUT:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../.."
. results/step.sh  # step LOG cmd...
F=designed:smollm2-135m-feature
C=designed:smollm2-135m-ctc
D=designed:smollm2-135m-dream
L=designed:smollm2-135m-l2
L_F=local:$F
P=designed:smollm2-135m-feature-prompt
DRAFTS=${DRAFTS:-"$L@auto;$F@2;$F@auto;$L_F@2;$P@2;$C@4;$C@auto;$D@2;$D@auto"}
# bf16 outputs that differ from plain decoding: near-ties (specdraft.lossless) or not
for nd in "ctc $C" "dream $D" "local $L_F"; do
  step "$OUT/check_${nd%% *}.txt" .venv/bin/specdraft check --target smollm2-135m --draft "${nd#* }" --dtype bf16 \
    --k 4 --threads 2 --prompts ../shared/data/spec_bench/question.jsonl --limit 8 --max-new-tokens 64 --drift
done
[ -n "${ONLY_CHECK:-}" ] && exit 0
step "$OUT/bf16.txt" .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --limit "${LIMIT:-2}" \
  --max-new-tokens 64 --threads 2 --drafts "$DRAFTS" --json "$OUT/bf16.json" --plot "$OUT/bf16.png"
