#!/bin/bash
# The feature draft that reads the prompt (drafts/smollm2-135m-feature-prompt) beside the committed
# answer-only feature draft, the designed l2 draft and prompt lookup on Spec-Bench, batch 1, greedy;
# on the quantized target (auto.*) and the bf16 one (bf16.*).
# usage: [OUT=DIR] [NEW=DRAFT] [DRAFTS='spec@k;...'] [DTYPES='auto bf16'] results/feature-prompt-2026-12-03/run.sh
set -u
OUT=$(mkdir -p "${OUT:-$(dirname "$0")}" && cd "${OUT:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../.."
. results/step.sh  # step LOG cmd...
NEW=designed:${NEW:-smollm2-135m-feature-prompt}
OLD=designed:smollm2-135m-feature
DRAFTS=${DRAFTS:-"$OLD@4;$NEW@2;$NEW@3;$NEW@4;$NEW@auto;tree:dyn,$NEW@6;designed:smollm2-135m-l2@auto;lookup@auto"}
# bf16 outputs that differ from plain decoding: near-ties (specdraft.lossless) or not
step "$OUT/check_bf16.txt" .venv/bin/specdraft check --target smollm2-135m --draft $NEW --dtype bf16 --k 4 \
  --threads 2 --prompts ../shared/data/spec_bench/question.jsonl --limit 8 --max-new-tokens 64 --drift
[ -n "${ONLY_CHECK:-}" ] && exit 0
for dt in ${DTYPES:-auto bf16}; do
  step "$OUT/$dt.txt" .venv/bin/python benchmarks/bench_drafters.py --dtype "$dt" --limit 2 --max-new-tokens 64 \
    --threads 2 --drafts "$DRAFTS" --json "$OUT/$dt.json" --plot "$OUT/$dt.png"
done
