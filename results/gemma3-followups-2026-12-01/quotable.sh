#!/usr/bin/env bash
# Issue 20: the quotable Gemma-3-270M runs, for a quiet machine (2 threads).
# Usage: bash results/gemma3-followups-2026-12-01/quotable.sh OUT [PROMPTS_PER_DATASET] [NEW_TOKENS]
# 1. bench_gemma3: compact vs transformers decode, agreement, T(n), and load time / peak RSS of the
#    compact runtime from its files, with the transformers model kept, and the adapter.
# 2. specdraft study on gemma3-270m: 11 drafts (layer-pruned: shallow + last, evenly spaced, early
#    exits; the same with a 16k-id head; prompt lookup) x k 1-4 x batch 1,2,4 x 4 Spec-Bench
#    categories, then specdraft report. A loaded-machine run of a smaller grid (9 drafts, 2 prompts
#    x 2 categories x 32 tokens) took 604 s wall for 132 s of CPU: expect ~6-10 min here.
set -euo pipefail
OUT=${1:?output directory}
PPD=${2:-4}
NEW=${3:-64}
mkdir -p "$OUT"
.venv/bin/python benchmarks/bench_gemma3.py --threads 2 --prompts 6 --new-tokens 64 --rounds 7 \
  --startup-runs 2 --json "$OUT/bench_gemma3.json" 2>&1 | tee "$OUT/bench_gemma3.txt"
E9=0,1,2,3,4,5,6,7,8                      # early exit: the first 9 of 18 layers
E16=0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 # early exit: the first 16
DRAFTS="prune:0,17;prune:0,1,17;prune:0,1,2,17;prune:0,6,11,17;prune:$E9;prune:$E16"
DRAFTS="$DRAFTS;prune:0,17,head=16384;prune:0,1,2,17,head=16384;prune:$E9,head=16384;prune:$E16,head=16384;lookup"
.venv/bin/specdraft study --target gemma3-270m --threads 2 --workers 1 --drafts "$DRAFTS" \
  --k 1-4 --batch 1,2,4 --datasets qa,writing,math_reasoning,summarization \
  --prompts-per-dataset "$PPD" --heldout 8 --max-new-tokens "$NEW" --max-prompt-tokens 512 \
  --profile-repeats 3 --validate 4 --out "$OUT/study-gemma3-270m" 2>&1 | tee "$OUT/study.log"
.venv/bin/specdraft report "$OUT/study-gemma3-270m/results.jsonl" --out "$OUT/study-gemma3-270m"
