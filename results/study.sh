#!/bin/bash
# The study over trained drafts (issue 20), one target family per run: the committed draft family
# (drafts/TARGET-family: one recipe, 400 steps each), the target's layers pruned without training
# (the "existing" drafts; SmolLM2-135M and Gemma-3-270M have no smaller sibling), and prompt lookup;
# bf16 target, 7 datasets x 8 prompts, k 1-8 (Gemma 1-6), batch 1-8, configurations validated online with latencies
# re-measured around each run. Writes results/study-TARGET/ (results.jsonl, REPORT.md, plots, logs).
# usage: [OUT=DIR] [FAMILY='d1-full-h16k ...'] [POLICY_DRAFTS='spec@k;...' [POLICY_ONLY=1]] results/study.sh smollm2-135m|gemma3-270m
set -u
target=${1:?usage: results/study.sh smollm2-135m|gemma3-270m}
OUT=${OUT:-$(dirname "$0")/study-$target}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
. results/step.sh  # step LOG cmd...
FAMILY=${FAMILY:-$(cd "drafts/$target-family" && ls -d d*-h*)}
DRAFTS=$(printf "designed:$target-family/%s;" $FAMILY)
case $target in
  smollm2-135m)
    DRAFTS+='designed:smollm2-135m-l2;prune:0;prune:0,1;prune:0,1,2,3;lookup'
    ARGS=(--k 1,2,3,4,5,6,7,8 --max-prompt-tokens 1024 --validate 12) ;;
  gemma3-270m)
    DRAFTS+='prune:0,head=16384;prune:0,17,head=16384;prune:0,1,2,3,4,5,6,7,8,head=16384;'
    DRAFTS+='prune:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,head=16384;prune:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15;lookup'
    ARGS=(--k 1,2,3,4,5,6 --max-prompt-tokens 512 --validate 10) ;;
  *) echo "results/study.sh: unknown target $target" >&2; exit 2 ;;
esac
if [ -z "${POLICY_ONLY:-}" ]; then  # POLICY_ONLY=1: the bench below only
step "$OUT/study.log" .venv/bin/specdraft study --target "$target" --dtype bf16 --drafts "$DRAFTS" \
  --datasets qa,writing,math_reasoning,summarization,coding,translation,hellaswag --prompts-per-dataset 8 \
  --batch 1,2,4,8 --heldout 8 --max-new-tokens 48 --profile-repeats 5 --threads 2 --workers 2 \
  --validate-prompts 8 --validate-reprofile --no-progress "${ARGS[@]}" --out "$OUT"
REL=$(realpath --relative-to=. "$OUT")  # the report names its input as given
step "$OUT/report.log" .venv/bin/specdraft report "$REL/results.jsonl" --out "$REL"
fi
# With the policy on: the best trained and the best existing draft of the report (each at k=auto)
# against plain decoding on Spec-Bench, one run. POLICY_DRAFTS='spec@auto;spec@auto' names them.
if [ -n "${POLICY_DRAFTS:-}" ]; then
  step "$OUT/policy_on.txt" .venv/bin/python benchmarks/bench_drafters.py --target "$target" --dtype bf16 \
    --limit 1 --max-new-tokens 64 --threads 2 --drafts "$POLICY_DRAFTS" --json "$OUT/policy_on.json"
fi
