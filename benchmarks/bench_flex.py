"""What FlexDraft's drafting costs on top of verification (issue 19: <= 10% of a target step).

FlexDraft (:mod:`specdraft.drafters.flex`) drafts inside the verification forward: a step verifies
``[last, d_1 .. d_k]`` and carries k + 1 groups of m mask tokens through the target's layers from
the split on, then :meth:`~specdraft.drafters.flex.FlexDrafter.propose` turns the accepted group
into the next draft (calibration, the draft's head, the choice of tokens). Three timings per
round, interleaved round by round on the bf16-weight compact runtime after a ``--context``-token
prefill, batch 1:

- ``verify``: the target's forward over k + 1 tokens alone (a plain chain step's forward);
- ``verify + masks``: the same forward with the mask groups (``FlexDrafter.forward_with_masks``);
- ``propose``: the next draft from a ready group.

The draft's cost is ``(verify + masks - verify) + propose``, printed as a share of ``verify``
(medians). The output tokens are not involved: this measures cost only; acceptance and speed come
from ``benchmarks/bench_drafters.py`` with the same draft.

    .venv/bin/python benchmarks/bench_flex.py --draft designed:NAME --k 4 --threads 2 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.drafters.base import DraftContext
from specdraft.verify import SamplingParams


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def one_round(pipe, prompt: torch.Tensor, k: int) -> dict[str, float]:
    """One verification step each way over a fresh prefill of ``prompt (1, S)``; ms per way."""
    rt, drafter = pipe.runtime, pipe.drafter
    S = prompt.shape[1]
    state = rt.new_state(1, S + k + drafter.block + 2)
    rt.forward(state, prompt[:, : S - 1], torch.arange(S - 1).unsqueeze(0))
    tokens = prompt[:, S - 1 - k :][:, : k + 1]  # any k + 1 tokens: the cost does not depend on them
    positions = (S - 1 + torch.arange(k + 1)).unsqueeze(0)
    out = {"verify": timed(lambda: rt.forward(state, tokens, positions))}
    groups = []
    out["verify + masks"] = timed(
        lambda: groups.append(drafter.forward_with_masks(state, tokens, positions)[1])
    )
    ds = drafter.new_state(1, state.capacity)
    L = torch.tensor([S + 1])
    drafter.take(ds, groups[0], torch.tensor([1]), prompt[0, -1:], L)  # one accepted: group 1
    buf = torch.cat([prompt, prompt[:, -1:]], 1)
    ctx = DraftContext(buf, L, [SamplingParams()], [None], None, state)
    out["propose"] = timed(lambda: drafter.propose(ds, ctx, k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--draft", default="flex", help="a FlexDraft spec: designed:NAME or flex[:SPLIT] (untrained)"
    )
    ap.add_argument("--k", type=int, default=4, help="draft tokens verified per step")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print("$ .venv/bin/python benchmarks/bench_flex.py " + " ".join(sys.argv[1:]))
    pipe = api.load(args.target, draft=args.draft, dtype="bf16", threads=args.threads)
    d = pipe.drafter
    if not getattr(d, "drafts_in_forward", False):
        raise SystemExit(f"{args.draft} is not a FlexDraft draft")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, pipe.runtime.vocab_size, (1, args.context), generator=g)
    one_round(pipe, prompt, args.k)  # warm-up
    res: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, ms in one_round(pipe, prompt, args.k).items():
            res.setdefault(name, []).append(ms)
    med = {name: statistics.median(ts) for name, ts in res.items()}
    groups = args.k + 1
    head = "full" if d.head_tokens is None else f"{len(d.head_tokens)} tokens"
    print(
        f"{pipe.target.name} ({pipe.runtime}), {d.name}: split {d.weights.split}, {groups} groups x "
        f"{d.block} mask tokens, head {head}, k {args.k}, {args.threads} threads, {args.rounds} rounds"
    )
    for name, m in med.items():
        print(f"  {name:16s} {m:8.2f} ms")
    masks = med["verify + masks"] - med["verify"]
    cost = masks + med["propose"]
    print(f"  draft cost: masks {masks:.2f} + propose {med['propose']:.2f} = {cost:.2f} ms")
    print(f"  = {cost / med['verify']:.1%} of the verification step (target <= 10%)")


if __name__ == "__main__":
    main()
