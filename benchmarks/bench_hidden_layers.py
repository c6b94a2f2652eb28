"""What asking the compact runtime for intermediate hidden layers costs a decode step (issue 18).

A DREAM-style draft makes the engine ask the target for ``hidden_layers=(-1, *layers)`` at every
step. Three ways of one decode step (batch 1, one new token, after a ``--context``-token prefill),
interleaved round by round on the same bf16-weight runtime:

- ``plain``: no hidden layers: every layer in one native call (``kernels.DecodeLayers``);
- ``hidden, native spans``: ``(-1, *layers)``: the native layers in one call per span up to each
  asked layer (``DecodeLayers(span=...)``), the default;
- ``hidden, layer by layer``: the same with the one-call native layers switched off (what such a
  step ran before the spans: each layer from Python over the fused attention kernel).

Medians per step and their ratios to ``plain`` are printed.

    .venv/bin/python benchmarks/bench_hidden_layers.py --threads 2 --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api, kernels


def step_ms(rt, prompt: torch.Tensor, hidden: tuple[int, ...], native: bool, steps: int) -> float:
    """Median ms of ``steps`` decode steps after a prefill of ``prompt (1, S)``."""
    kernels.USE_NATIVE_LAYERS = native
    S = prompt.shape[1]
    state = rt.new_state(1, S + steps + 1)
    rt.forward(state, prompt, torch.arange(S).unsqueeze(0))
    times = []
    for i in range(steps):
        t = time.perf_counter()
        rt.forward(state, prompt[:, i : i + 1], torch.tensor([[S + i]]), hidden_layers=hidden)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", default="6,14", help="intermediate layers asked for besides -1")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per round and way")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print("$ .venv/bin/python benchmarks/bench_hidden_layers.py " + " ".join(sys.argv[1:]))
    pipe = api.load(args.target, draft="none", dtype="bf16", threads=args.threads)
    rt = pipe.runtime
    hidden = (-1, *(int(x) for x in args.layers.split(",")))
    prompt = torch.randint(0, rt.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    ways = {
        "plain": ((), True),
        "hidden, native spans": (hidden, True),
        "hidden, layer by layer": (hidden, False),
    }
    res: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for name, (h, native) in ways.items():
            res[name].append(step_ms(rt, prompt, h, native, args.steps))
    kernels.USE_NATIVE_LAYERS = True
    base = statistics.median(res["plain"])
    print(f"{type(rt).__name__} ({pipe.target.name}), hidden layers {hidden}, {args.threads} threads")
    for name, ts in res.items():
        m = statistics.median(ts)
        print(f"  {name:24s} {m:7.2f} ms/step  {m / base:5.2f}x plain")


if __name__ == "__main__":
    main()
