#!/bin/bash
# First-token outcomes a feature draft reads back at its catch-up pairs (hindsight, 9f84c7a): the feature
# draft F with k = auto (hindsight), auto-blind (without), auto-before (without, and the safe arm judging
# probes too: the policy before) and k = 1, quantized target,
# batch 1, one process (bench_policy.py); and collapse detection for F on recorded requests
# (bench_detection.py --hindsight: outcomes recorded at k = 1 per position, replayed with catch-ups).
# usage: results/hindsight-2026-12-05/run.sh policy|detection|detection-calibration|collapse|collapse-b8|lookup-b1|lookup-b8|k0 [tag]
#   lookup-b1, lookup-b8: prompt lookup (no read-backs: the change is the safe arm's) at batch 1 and 8
#   collapse: F's throughput with every draft spoiled (bench_collapse.py, batch 1, 25 rounds); collapse-b8:
#     4 of 8 rows spoiled, 3 rounds (run from a worktree of an earlier commit for the before)
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
F=designed:smollm2-135m-feature-4k-second
c=$(git rev-parse --short HEAD)${2:-}
case "${1:-}" in
  policy) step "$OUT/policy-$c.txt" .venv/bin/python benchmarks/bench_policy.py --draft $F --policies \
    ${POLICIES:-auto,auto-blind,auto-before,1} --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/policy-$c.json" </dev/null ;;
  detection) step "$OUT/detection-$c.txt" .venv/bin/python benchmarks/bench_detection.py --drafts $F --k 1 \
    --hindsight --limit 52 --gsm8k 20 --max-new-tokens 128 --threads 2 --out "$OUT/detection-hits.json" </dev/null ;;
  detection-calibration) step "$OUT/detection-calibration-$c.txt" .venv/bin/python benchmarks/bench_detection.py \
    --drafts $F --k 1 --hindsight --calibration 200 --gsm8k 20 --max-new-tokens 128 --threads 2 \
    --out "$OUT/detection-calibration-hits.json" </dev/null ;;  # the 200 training prompts thresholds were chosen on
  lookup-b1|lookup-b8) B=${1#lookup-b}  # prompt lookup: the policy now and before (probes counted), k = 1
    step "$OUT/$1-$c.txt" .venv/bin/python benchmarks/bench_policy.py --draft lookup --batch $B --policies \
      auto,auto-before,1 --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/$1-$c.json" </dev/null ;;
  collapse) step "$OUT/collapse_feature_b1_r25-$c.txt" .venv/bin/python benchmarks/bench_collapse.py --draft $F \
    --batch 1 --attacked 1 --max-new-tokens 128 --threads 2 --rounds 25 </dev/null ;;  # F under attack
  collapse-b8) step "$OUT/collapse_feature_b8-$c.txt" .venv/bin/python benchmarks/bench_collapse.py --draft $F \
    --batch 8 --attacked 4 --max-new-tokens 128 --threads 2 --rounds 3 </dev/null ;;  # 4 of 8 rows attacked
  k0)  # what F costs at k = 0: plain decoding, the target handing out its final hidden state, F with k = 0
    # (features kept, catch-up priced) under a fixed policy, the cost-aware one with its model's choice skipped,
    # and the cost-aware one choosing as it does while its model says 0 (every choice held at 0); decode ms
    # per step, 8 Spec-Bench first turns x 3 rounds, methods rotating per prompt
    step "$OUT/k0-$c.txt" .venv/bin/python - <<'PY'
import statistics, time
from specdraft import api
from specdraft.bench.prompts import fit_context, load_prompts
from specdraft.engine import Engine, Request
from specdraft.policy import CostAwareK, FixedK

pipe = api.load("smollm2-135m", "designed:smollm2-135m-feature-4k-second", threads=2)
prompts = [fit_context(pipe.encode(p.turns[0]), 512).ids for p in load_prompts(None, None, 1)][:8]


class Zero(CostAwareK):  # the cost-aware policy with its model's choice skipped: k = 0
    def _choose(self, states):
        self._probing = False
        return 0


class Held(CostAwareK):  # the cost-aware policy choosing as it does at k = 0 (its model, its probe
    def _best(self, bucket, t_draft):  # schedule), every choice then held at 0
        super()._best(bucket, t_draft)
        return 0

    def _choose(self, states):
        super()._choose(states)
        self._probing = False
        return 0


layers = pipe.drafter.hidden_layers
engines = {
    "plain": Engine(pipe.runtime),
    "plain, hidden out": Engine(pipe.runtime, None, hidden_layers=(-1,)),
    "F, fixed k = 0": Engine(pipe.runtime, pipe.drafter, FixedK(0), hidden_layers=layers),
    "F, auto, no model": Engine(pipe.runtime, pipe.drafter, Zero(), hidden_layers=layers),
    "F, auto held at 0": Engine(pipe.runtime, pipe.drafter, Held(), hidden_layers=layers),
}
names, per_step = list(engines), {n: [] for n in engines}


def decode(engine, ids):  # decode seconds per step (the prefill is add's)
    engine.add([Request(ids, 128)])
    t0, steps = time.perf_counter(), 0
    while engine.active:
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / steps


for n in names:
    decode(engines[n], prompts[0])
for r in range(3):
    for i, ids in enumerate(prompts):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            per_step[n].append(decode(engines[n], ids))
base = statistics.mean(per_step["plain"])
for n in names:
    m = statistics.mean(per_step[n])
    print(f"{n:20s} {m * 1e3:.3f} ms per step  {base / m:.3f}x plain")
PY
    ;;
  *) echo "usage: $0 policy|detection|detection-calibration|collapse|collapse-b8|lookup-b1|lookup-b8|k0 [tag]" >&2; exit 2 ;;
esac
