#!/bin/bash
# The safe arm's verdict as a CUSUM of losses (auto) against the decayed-ratio verdict before it
# (auto-window), in one process each (bench_policy.py), and on the simulated world of
# tests/test_policy_guard.py.
# Then the row watch told by a free drafter's unverified proposals (e8a56ff): detection on recorded
# requests (bench_detection.py) and throughput under attack (bench_collapse.py).
# usage: results/policy-cusum-2026-12-05/run.sh policy|context|lag|window|catchup|trace|sim|detection|collapse
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
F=designed:smollm2-135m-feature-4k-second
c=$(git rev-parse --short HEAD)
case "${1:-}" in
  policy)  # drafter, target dtype, batch, policies
    while read -r d T B P; do
      [ -n "${ONLY:-}" ] && [[ "$d $T $B" != *"$ONLY"* ]] && continue
      n=${d##*:}_${T}_b$B-$c
      step "$OUT/policy_$n.txt" .venv/bin/python benchmarks/bench_policy.py --draft "$d" --dtype "$T" \
        --batch "$B" --policies "$P" --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/policy_$n.json" </dev/null
    done <<END
$F bf16 1 auto,auto-window,1
lookup auto 1 auto,auto-window,auto-unguarded
$F auto 1 auto,auto-window,1
lookup auto 8 auto,auto-window,auto-unguarded
END
    ;;
  context)  # the safe arm reading plain steps at the step's context (auto) or as timed (auto-stale);
    # runs at 8681c81 only: that fix (3b6b068) measured no effect here and was reverted
    while read -r d T B P; do
      n=${d##*:}_${T}_b$B-$c
      step "$OUT/context_$n.txt" .venv/bin/python benchmarks/bench_policy.py --draft "$d" --dtype "$T" \
        --batch "$B" --policies "$P" --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/context_$n.json" </dev/null
    done <<END
lookup auto 1 auto,auto-stale,auto-window,auto-unguarded
$F bf16 1 auto,auto-stale,1
END
    ;;
  lag)  # the feature draft's catch-up bounded (max_lag): k = auto against k = 1, bf16 and quantized target
    for T in bf16 auto; do
      n=smollm2-135m-feature-4k-second_${T}_b1-$c
      step "$OUT/lag_$n.txt" .venv/bin/python benchmarks/bench_policy.py --draft "$F" --dtype "$T" --batch 1 \
        --policies auto,1 --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/lag_$n.json" </dev/null
    done ;;
  window)  # T_target(n) the median of the last 5 steps at n (latency_window), not an exponential average
    while read -r d T P; do
      n=${d##*:}_${T}_b1-$c
      step "$OUT/window_$n.txt" .venv/bin/python benchmarks/bench_policy.py --draft "$d" --dtype "$T" --batch 1 \
        --policies "$P" --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/window_$n.json" </dev/null
    done <<END
$F bf16 auto,1
$F auto auto,1
lookup auto auto,auto-unguarded
END
    ;;
  catchup)  # a feature draft forward over P pairs (what a catch-up costs), F at bf16: median of 10
    step "$OUT/catchup.txt" .venv/bin/python - <<'PY'
import statistics, time
import torch
from specdraft import api
pipe = api.load("smollm2-135m", "designed:smollm2-135m-feature-4k-second", dtype="bf16", threads=2)
d = pipe.drafter
print("pairs  draft forward ms (median of 10)")
for P in (1, 8, 16, 32, 64, 128):
    state = d.new_state(1, 1024)
    state.start[:] = 0
    x = torch.randn(1, P, d.embed.shape[1], dtype=d.embed.dtype)
    times = []
    for i in range(12):
        t = time.perf_counter()
        d._forward(state, x, torch.arange(P)[None])
        times.append(time.perf_counter() - t)
    print(f"{P:5d}  {statistics.median(times[2:]) * 1e3:.2f}")
PY
    ;;
  trace)  # why F's k = auto decodes plainly: each step's reason (s speculative, 0 the model's k = 0, o the
    # row switched off, A the safe arm's plain step, t trimmed to nothing) and the policy's state at the end
    step "$OUT/trace.txt" .venv/bin/python - <<'PY'
import collections
from specdraft import api
from specdraft.bench import harness
from specdraft.bench.prompts import fit_context, load_prompts
from specdraft.policy import CostAwareK


class Traced(CostAwareK):
    def __init__(self):
        super().__init__()
        self.reasons = []

    def choose(self, rows=None, lag=None):
        forced = self.rate.forced
        k = super().choose(rows, lag)
        off = rows and all(r in self.row_state and self.row_state[r].off for r in rows)
        self._why = "A" if self.rate.forced > forced else ("s" if k else ("o" if off else "0"))
        return k

    def trim(self, num_valid, bucket, rows=None):
        out = super().trim(num_valid, bucket, rows)
        self._why = "t" if self._why == "s" and int(out.max()) == 0 else self._why
        return out

    def update(self, *args, **kw):
        super().update(*args, **kw)
        self.reasons.append(self._why)


pipe = api.load("smollm2-135m", "designed:smollm2-135m-feature-4k-second", dtype="bf16", threads=2)
policy = Traced()
method = harness.engine_method("auto", pipe.runtime, pipe.drafter, policy, eos_ids=pipe.eos_ids)
for i, p in enumerate(load_prompts(None, None, 2)):
    harness.run_prompt([method], fit_context(pipe.encode(p.turns[0]), 512).ids, i, 128)
print("steps by reason:", dict(collections.Counter(policy.reasons)))
print("T_target(n) ms:", {n: round(t * 1e3, 2) for n, t in sorted(policy.t_target.items())})
print(f"t_draft {policy.t_draft * 1e3:.2f} ms, t_lag {policy.t_lag * 1e3:.3f} ms per catch-up pair")
print("acceptance c_j:", [round(c, 2) for c in policy.rates(None)])
print("".join(policy.reasons))
PY
    ;;
  sim)  # the test's world: acceptance 0.35 at k = 1, a step a quarter dearer than plain, the model
    # always drafting; fall-backs and speculative steps per 600 steps, the CUSUM against the window
    step "$OUT/sim.txt" .venv/bin/python - <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from bench_policy import WindowVerdict
from specdraft.policy import CostAwareK, SafeArm
from tests.test_policy_guard import Clock, World, simulate

world = World(1, alpha=0.35, slope=0.2, told=0.0, told_draft=0.0)
print("seed  verdict  fall-backs  speculative steps of 600  speed vs plain")
for seed in range(6):
    for name in ("cusum", "window"):
        clock = Clock()
        policy = CostAwareK(k_max=1, k_start=1, probe_k=1, watch=None, guard=SafeArm(clock=clock))
        if name == "window":
            policy.rate = WindowVerdict(SafeArm(clock=clock))
        run = simulate(policy, clock, world, 600, seed=seed)
        print(f"{seed:4d}  {name:7s}  {policy.rate.fallbacks:10d}  {run.spec_steps:24d}  {run.vs_plain:.3f}")
PY
    ;;
  detection)  # recorded clean requests replayed with always-wrong ones (lookup: watched at every step)
    step "$OUT/detection-$c.txt" .venv/bin/python benchmarks/bench_detection.py --drafts "lookup" --limit 52 \
      --gsm8k 20 --max-new-tokens 128 --threads 2 ;;
  collapse)  # under attack (WrongRows): drafter, batch, rows attacked, rounds (median decode seconds)
    while read -r d B A R; do
      [ -n "${ONLY:-}" ] && [[ "$d $B" != *"$ONLY"* ]] && continue
      step "$OUT/collapse_${d##*:}_b$B-$c.txt" .venv/bin/python benchmarks/bench_collapse.py --draft "$d" \
        --batch "$B" --attacked "$A" --max-new-tokens 128 --threads 2 --rounds "$R" </dev/null
    done <<END
lookup 8 4 3
lookup 1 1 9
END
    ;;
  *) echo "usage: $0 policy|context|lag|window|catchup|trace|sim|detection|collapse" >&2; exit 2 ;;
esac
