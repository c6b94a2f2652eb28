#!/bin/bash
# The collapse detection's thresholds, chosen on training prompts and measured on the evaluation set
# (issue 17: >= 90% of always-wrong requests flagged, <= 5% of clean ones).
# usage: results/detection-calibration-2026-12-05/run.sh calibrate|evaluate|feature|spread
#   calibrate: prompt lookup on 200 training prompts (100 HellaSwag contexts, 100 GSM8K train questions
#     after the evaluation set's 20), every grid point of RowWatch.detect_concentration x detect_alpha
#   evaluate: the same grid on the evaluation set (52 Spec-Bench first turns, the first 20 GSM8K questions)
#   feature: the feature draft F on the evaluation set, the chosen thresholds and the binomial before them
#   spread: how far requests' first-token acceptance spreads beyond chance in the recorded hits, as the
#     concentration a + b of a Beta by moments (a binomial's is infinite)
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
c=$(git rev-parse --short HEAD)
F=designed:smollm2-135m-feature-4k-second
GRID="--alphas 0.01,0.005,0.002 --concentrations none,100,50,20,10,5"
run() { step "$OUT/$1-$c.txt" .venv/bin/python benchmarks/bench_detection.py "${@:2}" --max-new-tokens 128 --threads 2; }
case "${1:-}" in
  calibrate) run calibration --drafts lookup --calibration 200 --gsm8k 20 $GRID --out "$OUT/calibration-hits.json" ;;
  evaluate) run evaluation --drafts lookup --limit 52 --gsm8k 20 $GRID --out "$OUT/evaluation-hits.json" ;;
  feature) run feature --drafts "$F" --limit 52 --gsm8k 20 --alphas 0.01,0.002 --concentrations none,20 \
    --out "$OUT/feature-hits.json" ;;
  spread) step "$OUT/spread-$c.txt" .venv/bin/python - "$OUT"/*-hits.json <<'PY'
import json, sys

def concentration(records):  # (hits, proposals) per request -> a + b by moments (None: no spread)
    k, hits, total = len(records), sum(h for h, _ in records), sum(n for _, n in records)
    m = hits / total
    s = sum((h - n * m) ** 2 / n for h, n in records) / (m * (1 - m))
    rho = (s - (k - 1)) / (total - sum(n * n for _, n in records) / total - (k - 1))
    return 1 / rho - 1 if rho > 0 else None

print("file  drafter  requests (>= 8 proposals)  pooled acceptance  concentration a + b")
for path in sys.argv[1:]:
    for spec, hits in json.load(open(path))["hits"].items():
        recs = [(sum(h), len(h)) for h in hits if len(h) >= 8]
        pooled = sum(h for h, _ in recs) / sum(n for _, n in recs)
        print(f"{path.split('/')[-1]}  {spec}  {len(recs)}  {pooled:.3f}  {concentration(recs):.1f}")
PY
    ;;
  *) echo "usage: $0 calibrate|evaluate|feature|spread" >&2; exit 2 ;;
esac
