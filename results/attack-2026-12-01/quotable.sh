#!/usr/bin/env bash
# Issue 17: the quotable attack / defense runs, for a quiet machine (2 threads each).
# Usage: bash results/attack-2026-12-01/quotable.sh OUT [LIMIT] [NEW_TOKENS] [DETECT_SPECBENCH] [DETECT_GSM8K]
# (smoke-tested as: nice -n 19 bash results/attack-2026-12-01/quotable.sh /tmp/h17/smoke 2 16 2 2)
set -euo pipefail
OUT=${1:?output directory}
LIMIT=${2:-10}
NEW=${3:-64}
DSB=${4:-52}
DGSM=${5:-20}
P=results/attack-2026-12-01/prompts10.jsonl   # 6 Spec-Bench first turns + 4 GSM8K train questions
PRUNE=prune:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14  # the pruned draft that accepts most (results/study-smollm2-135m-untrained)
SD=".venv/bin/specdraft"
A="--target smollm2-135m --prompts $P --limit $LIMIT --max-new-tokens $NEW --threads 2"
mkdir -p "$OUT"
$SD attack $A --draft designed:auto --method continuous --out "$OUT/continuous-designed" 2>&1 | tee "$OUT/continuous-designed.log"
$SD attack $A --draft "$PRUNE" --method continuous --out "$OUT/continuous-prune" 2>&1 | tee "$OUT/continuous-prune.log"
$SD attack $A --draft designed:auto --method discrete --out "$OUT/discrete-designed" 2>&1 | tee "$OUT/discrete-designed.log"
$SD attack $A --draft lookup --method lookup --out "$OUT/lookup" 2>&1 | tee "$OUT/lookup.log"
$SD report "$OUT"/*/attack.json --out "$OUT"
.venv/bin/python benchmarks/bench_collapse.py --batch 8 --attacked 4 --max-new-tokens "$NEW" --threads 2 \
  2>&1 | tee "$OUT/bench_collapse.log"
for B in 1 4 8; do
  .venv/bin/python benchmarks/bench_policy.py --policies auto,auto-batch --batch $B --limit 1 \
    --max-new-tokens "$NEW" --threads 2 --json "$OUT/bench_policy_b$B.json" 2>&1 | tee "$OUT/bench_policy_b$B.log"
done
.venv/bin/python benchmarks/bench_detection.py --drafts "lookup;designed:auto;$PRUNE" --limit "$DSB" --gsm8k "$DGSM" \
  --max-new-tokens "$NEW" --threads 2 --out "$OUT/hits.json" 2>&1 | tee "$OUT/bench_detection.log"
