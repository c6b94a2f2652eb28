"""Where a decode step's time goes: the target's forward, drafting, and the rest (the engine's
bookkeeping, the policy, verification), plain decoding against a drafter with ``k = auto`` (or other
``--policies``, at one or more ``--draft-dtypes``).

Each method decodes the same Spec-Bench first turns (greedy, ``--batch`` rows at a time) for
``--rounds`` rounds, each batch by every method in a rotating order
(:func:`specdraft.bench.harness.interleave`: a shared machine's slow minutes hit both alike), one
policy per method for the whole run. Per step: the target's forward (``SpecStats.target_time``), the
drafter's proposals (``draft_time``) and the rest of the decode's wall time. The rest is Python
and small tensor operations; right after a forward has streamed the weights through the caches
each of those costs several times what it does warm, so it is measured here, in place, not in a
micro-benchmark. ``--attack`` decodes with every row's drafts spoiled
(:class:`specdraft.drafters.adversarial.WrongRows`), the collapse defense's worst case. ``--cold``
times instead a few small tensor operations right after a one-token forward and again at once.

    .venv/bin/python benchmarks/bench_step_overhead.py --batch 1 --limit 1 --rounds 2 --threads 2

Spec-Bench is evaluation-only here; nothing is tuned on it.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench import harness, profile
from specdraft.bench.prompts import fit_context, load_prompts
from specdraft.drafters.adversarial import WrongRows
from specdraft.policy import make_policy


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="lookup")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--draft-dtypes",
        default="auto",
        help="','-separated draft precisions, one k = auto method each (auto, q, bf16, ...: --draft-dtype)",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--limit", type=int, default=1, help="prompts per Spec-Bench category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--policies", default="auto", help="','-separated k policies: auto, or a fixed k")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--attack", action="store_true", help="spoil every row's drafts (WrongRows)")
    ap.add_argument("--cold", action="store_true", help="small tensor operations after a forward, then warm")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def split(run: harness.BatchRun) -> collections.Counter:
    """One batch's decode seconds, split per step."""
    ks = run.stats.k_history
    return collections.Counter(
        decode=run.seconds - run.stats.prefill_time,  # every step, the first included
        target=run.stats.target_time,
        draft=run.stats.draft_time,
        steps=len(ks),
        speculative=sum(1 for k in ks if k),
    )


EIGHT = torch.arange(8)
OPS = {
    "torch.zeros(3)": lambda logits: torch.zeros(3),
    "torch.tensor([1, 2])": lambda logits: torch.tensor([1, 2]),
    "(8 ints).tolist()": lambda logits: EIGHT.tolist(),
    "logits.numpy().argmax(-1)": lambda logits: logits.numpy().argmax(-1),
}


def cold(rt, forwards: int = 50) -> None:
    """Median microseconds of each of :data:`OPS` (on the forward's logits) as the first thing after a
    one-token forward, and the same call repeated at once."""
    state = rt.new_state(1, forwards + 8)
    rt.forward(state, torch.ones(1, 4, dtype=torch.int64), torch.arange(4).unsqueeze(0))
    first, again = collections.defaultdict(list), collections.defaultdict(list)
    for i in range(forwards):
        for name, op in OPS.items():
            logits = rt.forward(state, torch.ones(1, 1, dtype=torch.int64), torch.tensor([[4 + i]])).logits
            for record in (first, again):
                t = time.perf_counter()
                op(logits)
                record[name].append(time.perf_counter() - t)
    print(f"operation                  after a forward (us)  again (us); medians of {forwards} forwards")
    for name in OPS:
        a, b = statistics.median(first[name]) * 1e6, statistics.median(again[name]) * 1e6
        print(f"{name:26s} {a:20.1f}  {b:10.1f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    print("command: python benchmarks/bench_step_overhead.py " + " ".join(given))
    print(f"cpu: {profile.cpu_name()}, threads {args.threads}", flush=True)
    pipe = api.load(args.target, args.draft, dtype=args.dtype, threads=args.threads)
    rt = pipe.runtime
    if args.cold:
        cold(rt)
        return 0
    plain = harness.engine_method("plain", rt, None, eos_ids=pipe.eos_ids)
    budget = harness.prompt_budget(rt, [plain], args.max_new_tokens, 512)
    prompts = [fit_context(pipe.encode(p.turns[0]), budget).ids for p in load_prompts(None, None, args.limit)]
    methods = [plain, *speculative(args, pipe, prompts)]
    harness.warm_up(methods, prompts[0][:64], 16)
    agg = {m.name: collections.Counter() for m in methods}
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    for i, batch in enumerate(batches * args.rounds):  # each batch by every method, in turn first
        for m in harness.interleave(methods, i):
            agg[m.name] += split(m.run_batch(batch, args.max_new_tokens))
    report(args, len(prompts), agg)
    if args.json:
        record = {"args": vars(args) | {"json": str(args.json)}, "totals": agg}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


def speculative(args, pipe, prompts: list[list[int]]) -> list[harness.Method]:
    """A method per ``--policies`` entry and ``--draft-dtypes`` entry (``auto``: the loaded pipeline's
    drafter; another precision: the same draft built at it), named ``POLICY`` or ``POLICY@PRECISION``."""
    out = []
    for name in args.draft_dtypes.split(","):
        drafter = pipe.drafter
        if name != "auto":
            drafter = api.make_drafter(args.draft, pipe.target, pipe.runtime, name)
        if args.attack:
            drafter = WrongRows(drafter, prompts, pipe.runtime.vocab_size)
        for k in args.policies.split(","):
            label = k if name == "auto" else f"{k}@{name}"
            policy = make_policy(k)
            out.append(harness.engine_method(label, pipe.runtime, drafter, policy, eos_ids=pipe.eos_ids))
    return out


def report(args, n: int, agg: dict) -> None:
    attacked = ", every row's drafts spoiled (WrongRows)" if args.attack else ""
    print(
        f"{n} Spec-Bench first turns x {args.rounds} rounds, batch {args.batch}, {args.max_new_tokens} new "
        f"tokens, draft {args.draft} (precision {args.draft_dtypes}){attacked}"
    )
    print("method     decode s  vs plain  steps  speculative  target ms/step  draft ms/step  rest ms/step")
    for name, a in agg.items():
        s = a["steps"]
        rest = (a["decode"] - a["target"] - a["draft"]) / s * 1e3
        print(
            f"{name:9s}  {a['decode']:8.2f}  {agg['plain']['decode'] / a['decode']:7.3f}x  {s:5d}  "
            f"{a['speculative']:11d}  {a['target'] / s * 1e3:14.3f}  {a['draft'] / s * 1e3:13.3f}  "
            f"{rest:12.3f}"
        )


if __name__ == "__main__":
    sys.exit(main())
