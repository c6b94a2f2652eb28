r"""A subset-head draft's proposal over the head's own columns against over the whole vocabulary.

A designed draft's head scores N of the V tokens (:mod:`specdraft.models.subset_head`). The model
and gated drafters choose each token from the N head columns and map only the choice back
(:meth:`specdraft.drafters.model.ModelDrafter.head_logits`); before, every draft token's logits were
spread over a ``(B, V)`` row of ``-inf`` and the argmax (and a gated draft's confidence softmax)
read all V. This times both in one process: the same drafter, its runtime seen either as the subset
head (``head``) or through a wrapper that only hands out the full-vocabulary logits (``vocab``),
proposing k tokens from a ``--context``-token cache (every token drafted: the gate is held open),
the two arms in turn round after round; medians over the rounds.

    .venv/bin/python benchmarks/bench_subset_head.py --target gemma3-270m \
        --draft designed:gemma3-270m-family/d4-quarter-h16k --json runs/subset_head.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench.profile import cpu_name
from specdraft.drafters.base import DraftContext
from specdraft.verify import SamplingParams


class VocabularyView:
    """A subset-head runtime seen from outside: full-vocabulary logits only (the old path)."""

    def __init__(self, rt):
        self.rt, self.vocab_size, self.max_context, self.dtype = rt, rt.vocab_size, rt.max_context, rt.dtype

    def new_state(self, batch_size: int, capacity: int):
        return self.rt.new_state(batch_size, capacity)

    def forward(self, *args, **kw):
        return self.rt.forward(*args, **kw)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="gemma3-270m")
    p.add_argument("--draft", default="designed:gemma3-270m-family/d4-quarter-h16k")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def proposal_time(drafter, B: int, k: int, context: int) -> float:
    """Seconds of one k-token proposal for B rows whose caches hold all but the last token."""
    tokens = torch.randint(0, 1000, (B, context + k), generator=torch.Generator().manual_seed(B))
    ctx = DraftContext(tokens, torch.full((B,), context), [SamplingParams()] * B, [None] * B)
    state = drafter.new_state(B, context + k)
    drafter.propose(state, ctx, k)  # reads the context
    state.fed = torch.full((B,), context - 1)
    t = time.perf_counter()
    drafter.propose(state, ctx, k)
    return time.perf_counter() - t


def main() -> int:
    args = parse_args()
    pipe = api.load(args.target, draft=args.draft, dtype=args.dtype, threads=args.threads)
    drafter = pipe.drafter
    if drafter.head is None:
        raise SystemExit(f"bench_subset_head: {args.draft} has no subset head")
    drafter.new_state(1, 8)  # a gated draft measures its cost model here, outside the timing
    views = {"head": drafter.runtime, "vocab": VocabularyView(drafter.runtime)}  # drafter.head follows
    print(f"# {cpu_name()}; {args.target} {args.draft} ({args.dtype}), k={args.k}, context {args.context}")
    rows = []
    for B in (int(b) for b in args.batch.split(",")):
        times = {name: [] for name in views}
        with drafter.drafting(True) if hasattr(drafter, "drafting") else contextlib.nullcontext():
            for _ in range(args.rounds):
                for name, runtime in views.items():
                    drafter.runtime = runtime
                    times[name].append(proposal_time(drafter, B, args.k, args.context))
        drafter.runtime = views["head"]
        med = {name: statistics.median(ts[2:]) for name, ts in times.items()}  # 2 warm-up rounds
        rows.append({"batch": B, **{f"{n}_ms": round(t * 1e3, 3) for n, t in med.items()}})
        print(
            f"batch {B}: head columns {med['head'] * 1e3:.2f} ms, whole vocabulary "
            f"{med['vocab'] * 1e3:.2f} ms per proposal: {med['vocab'] / med['head']:.2f}x"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"cpu": cpu_name(), "args": vars(args) | {"json": None}, "rows": rows})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
