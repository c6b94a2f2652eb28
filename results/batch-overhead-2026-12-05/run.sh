#!/bin/bash
# Prompt lookup at batch 8 with k = auto, and what a ragged step of B rows costs (issue 17's
# ">= 1.0x plain at batch 1-8"). Ratios compare within one file (one process) only.
# usage: results/batch-overhead-2026-12-05/run.sh ragged|ragged-before|policy|repeat|before|split|propose|detection|collapse|collapse-b1
#   ragged-before, before and propose (also) run the same command on main before this work (48f1a0f), in a worktree
#   beside this checkout (../sd-48f1a0f, so that ../shared is found), with this checkout's venv.
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
ROOT=$(pwd)
F=designed:smollm2-135m-feature-4k-second
c=$(git rev-parse --short HEAD)
BASE=48f1a0f
WT="$ROOT/../sd-$BASE"
worktree() { [ -d "$WT" ] || git worktree add --detach -q "$WT" "$BASE"; }
before() {  # before LOG CMD...: step LOG CMD... in a worktree of $BASE (the log's header names $BASE)
  worktree && (cd "$WT" && step "$@")
}
case "${1:-}" in
  ragged)  # ragged steps by shape on the quantized runtime (bench_quant.py --sections ragged)
    step "$OUT/ragged-$c.txt" .venv/bin/python benchmarks/bench_quant.py --threads 2 --sections ragged \
      --context 200 --json "$OUT/ragged-$c.json" ;;
  ragged-before)  # the same, with the kernel before c4028cd (2-3 rows: a nested omp team per call):
    # HEAD's bench_quant.py and bench/profile.py (its ragged section) copied into the worktree
    worktree && cp benchmarks/bench_quant.py "$WT/benchmarks/" && cp specdraft/bench/profile.py "$WT/specdraft/bench/"
    before "$OUT/ragged-$BASE.txt" "$ROOT/.venv/bin/python" benchmarks/bench_quant.py --threads 2 \
      --sections ragged --context 200 --json "$OUT/ragged-$BASE.json" ;;
  policy)  # k = auto (and without its safe arm, or k = 1) against plain decoding, in one process each
    while read -r d T B P tag; do
      n=${d##*:}_${T}_b$B-$c$tag
      step "$OUT/policy_$n.txt" .venv/bin/python benchmarks/bench_policy.py --draft "$d" --dtype "$T" \
        --batch "$B" --policies "$P" --limit 2 --max-new-tokens 128 --threads 2 --json "$OUT/policy_$n.json" </dev/null
    done <<END
lookup auto 8 auto,auto-unguarded
lookup auto 8 auto,auto-unguarded -2
lookup auto 1 auto,auto-unguarded
$F bf16 1 auto,1
$F auto 1 auto,1
END
    ;;
  repeat)  # prompt lookup at batch 8, three more runs of the first policy line (how far runs spread)
    for tag in 3 4 5; do
      n=lookup_auto_b8-$c-$tag
      step "$OUT/policy_$n.txt" .venv/bin/python benchmarks/bench_policy.py --draft lookup --dtype auto \
        --batch 8 --policies auto,auto-unguarded --limit 2 --max-new-tokens 128 --threads 2 </dev/null
    done ;;
  before)  # prompt lookup at batch 8 on main before this work
    before "$OUT/policy_lookup_auto_b8-$BASE.txt" "$ROOT/.venv/bin/python" benchmarks/bench_policy.py \
      --draft lookup --dtype auto --batch 8 --policies auto,auto-unguarded --limit 2 --max-new-tokens 128 \
      --threads 2 </dev/null ;;
  split)  # batch 8: each method's decode time split into the target's forwards, drafting and the rest
    step "$OUT/split-$c.txt" .venv/bin/python - <<'PY'
import collections
from specdraft import api
from specdraft.bench import harness
from specdraft.bench.prompts import fit_context, load_prompts
from specdraft.policy import CostAwareK

pipe = api.load("smollm2-135m", "lookup", dtype="auto", threads=2)
names, B = ["plain", "auto", "auto-unguarded"], 8
policies = {"auto": CostAwareK(), "auto-unguarded": CostAwareK(guard=None)}
methods = [harness.engine_method("plain", pipe.runtime, None, eos_ids=pipe.eos_ids)]
methods += [harness.engine_method(n, pipe.runtime, pipe.drafter, policies[n], eos_ids=pipe.eos_ids) for n in names[1:]]
budget = harness.prompt_budget(pipe.runtime, methods, 128, 512)
ids = [fit_context(pipe.encode(p.turns[0]), budget).ids for p in load_prompts(None, None, 2)]
harness.warm_up(methods, ids[0][:64], 16)
agg = collections.defaultdict(collections.Counter)
for i in range(0, len(ids), B):
    for m in harness.interleave(methods, i // B):
        run, a = m.run_batch(ids[i : i + B], 128), agg[m.name]
        a["decode"] += run.seconds - run.first_token_seconds
        a["target"] += run.stats.target_time
        a["draft"] += run.stats.draft_time
        a["steps"] += len(run.stats.k_history)
        a["spec"] += sum(1 for k in run.stats.k_history if k)
print(f"{len(ids)} Spec-Bench first turns, batch {B}, 128 new tokens, prompt lookup, quantized target")
print("method          decode s  vs plain  target s  draft s  steps  speculative  target ms/step  rest ms/step")
for n in names:
    a = agg[n]
    rest = (a["decode"] - a["target"] - a["draft"]) / a["steps"] * 1e3
    print(f"{n:15s} {a['decode']:8.2f}  {agg['plain']['decode'] / a['decode']:7.3f}x  {a['target']:8.2f}  "
          f"{a['draft']:7.3f}  {a['steps']:5d}  {a['spec']:11d}  {a['target'] / a['steps'] * 1e3:14.2f}  {rest:12.2f}")
PY
    ;;
  propose)  # prompt lookup's proposals for 8 rows, each growing a token per step, at HEAD (an n-gram
    # index per row) and at $BASE (a numpy scan of the context)
    for where in head base; do
      log="$OUT/propose-$([ $where = head ] && echo "$c" || echo $BASE).txt"
      run=$([ $where = head ] && echo step || echo before)
      $run "$log" "$ROOT/.venv/bin/python" -c "$(cat <<'PY'
import statistics, time
import torch
from specdraft.drafters.base import DraftContext
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.verify import SamplingParams

B, steps, g = 8, 128, torch.Generator().manual_seed(0)
print("rows  context  ms per proposal of k = 4 for every row (median of the last 100 of 128 steps)")
for L in (128, 512, 2048):
    tokens = torch.randint(0, 2000, (B, L + steps), generator=g)  # a 2000-token vocabulary: matches occur
    d = PromptLookupDrafter()
    state, times = d.new_state(B, L + steps), []
    for i in range(steps):
        ctx = DraftContext(tokens, torch.full((B,), L + i), [SamplingParams()] * B, [None] * B)
        t = time.perf_counter()
        d.propose(state, ctx, 4)
        times.append(time.perf_counter() - t)
    print(f"{B:4d}  {L:7d}  {statistics.median(times[-100:]) * 1e3:.3f}")
PY
)"
    done ;;
  detection)  # the defense after the policy's changes: recorded clean requests replayed with always-wrong ones
    step "$OUT/detection-$c.txt" .venv/bin/python benchmarks/bench_detection.py --drafts "lookup" --limit 52 \
      --gsm8k 20 --max-new-tokens 128 --threads 2 ;;
  collapse)  # under attack (WrongRows): 4 of 8 rows (3 rounds), 1 of 1 (9 rounds); median decode seconds
    for BAR in "8 4 3" "1 1 9"; do
      set -- $BAR
      step "$OUT/collapse_lookup_b$1-$c.txt" .venv/bin/python benchmarks/bench_collapse.py --draft lookup \
        --batch "$1" --attacked "$2" --max-new-tokens 128 --threads 2 --rounds "$3" </dev/null
    done ;;
  collapse-b1)  # batch 1 again, 25 rounds: one prompt's decode is ~1 s, and 9 rounds spread by several per cent
    step "$OUT/collapse_lookup_b1_r25-$c.txt" .venv/bin/python benchmarks/bench_collapse.py --draft lookup \
      --batch 1 --attacked 1 --max-new-tokens 128 --threads 2 --rounds 25 </dev/null ;;
  *) echo "usage: $0 ragged|ragged-before|policy|repeat|before|split|propose|detection|collapse|collapse-b1" >&2; exit 2 ;;
esac
