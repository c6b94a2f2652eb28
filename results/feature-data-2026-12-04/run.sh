#!/bin/bash
# Does more training data, or training the second draft position on the draft's own feature, move the
# EAGLE-style feature draft on Spec-Bench? Three fine-tunes of drafts/smollm2-135m-feature (README), then
# Spec-Bench and held-out training-distribution prompts, every draft in one run each.
# usage: [W=/work/train] [LIMIT=2] results/feature-data-2026-12-04/run.sh builds|prompts|bench
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
W=${W:-/work/train}
build() {  # build NAME PROMPTS SECOND_WEIGHT: 2000 steps from the committed feature draft, 1 thread
  step "$OUT/build_$1.log" .venv/bin/specdraft design build --target smollm2-135m --dtype bf16 --threads 1 \
    --kind feature --init-from smollm2-135m-feature --layers 0 --head 8192 --prompts "$2" --val-prompts 48 \
    --sources gsm8k,hellaswag,self --gen-dtype bf16 --max-new-tokens 160 --gen-batch 16 --steps 2000 \
    --batch-size 8 --lr 3e-4 --second-weight "$3" --checkpoint-every 25 --eval-every 500 --save-dtype bf16 \
    --quiet --work "$W/$1-work" --out "$W/$1"
}
case "${1:-}" in
  builds)  # the data: specdraft design data ... --prompts 4000 (the committed draft's 2,000 answers and 2,000 more)
    # one core each: the 4,000-answer fine-tune then the 2,000-answer control, beside the second-position one
    { build feature-4k 4000 0; build feature-2k-more 2000 0; } &
    build feature-4k-second 4000 0.5 &
    wait ;;
  prompts)  # heldout.jsonl: the 48 held-out (val split) prompts of the training sources, never trained on
    .venv/bin/python - "$OUT/heldout.jsonl" <<'PY'
import json, sys
from specdraft import api
from specdraft.design.data import training_prompts
pipe = api.load("smollm2-135m", None, dtype="bf16", threads=2)
names = ("gsm8k", "hellaswag", "self")  # round-robin, as training_prompts mixes them
with open(sys.argv[1], "w") as f:
    for i, t in enumerate(training_prompts(48, split="val", sources=names, pipe=pipe)):
        f.write(json.dumps({"question_id": i, "category": names[i % 3], "turns": [t]}) + "\n")
PY
    ;;
  bench)
    F=designed:smollm2-135m-feature
    D="$F@1;$F@2;$F@auto"
    for n in feature-4k feature-4k-second; do D="$D;designed:$W/$n@1;designed:$W/$n@2;designed:$W/$n@auto"; done
    D="$D;designed:$W/feature-2k-more@2"  # the control: its acceptance
    step "$OUT/specbench.txt" .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --limit "${LIMIT:-2}" \
      --max-new-tokens 64 --threads 2 --drafts "$D" --json "$OUT/specbench.json" --plot "$OUT/specbench.png"
    step "$OUT/heldout.txt" .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --prompts "$OUT/heldout.jsonl" \
      --limit 8 --max-new-tokens 64 --threads 2 --drafts "$D" --json "$OUT/heldout.json" ;;
  *) echo "usage: $0 builds|prompts|bench" >&2; exit 2 ;;
esac
