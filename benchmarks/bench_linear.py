"""Which matmul layout the compact runtime should use, measured on the whole target.

Times a target forward over n = 1..8 new tokens at a 200-token context, with every linear
computed as ``F.linear(x, W)`` on the ``(out, in)`` weight, and with specdraft's
:func:`specdraft.models.llama.linear` (the matmul form chosen by the number of rows).
Strategies alternate round by round; medians are printed with their ratios.

    .venv/bin/python benchmarks/bench_linear.py --dtype fp32 --threads 1 --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api  # noqa: E402
from specdraft.models import llama  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="fp32", choices=["auto", "bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args(argv)
    print("command:", "python benchmarks/bench_linear.py " + " ".join(sys.argv[1:]), flush=True)

    pipe = api.load(args.target, "none", dtype=args.dtype, threads=args.threads)
    rt = pipe.runtime
    kv = rt.new_state(1, args.context + 16)
    rt.forward(kv, torch.randint(0, 1000, (1, args.context)), torch.arange(args.context).unsqueeze(0))

    def forward_s(n: int) -> float:
        tokens = torch.randint(0, 1000, (1, n))
        positions = (args.context + torch.arange(n)).unsqueeze(0)
        t0 = time.perf_counter()
        rt.forward(kv, tokens, positions)
        return time.perf_counter() - t0

    ours = llama.linear
    strategies = {
        "F.linear (out, in)": lambda x, w, b, packed: F.linear(x, w, b) if packed is None else ours(x, w, b, packed),
        "specdraft linear": ours,
    }
    sizes = (1, 2, 3, 4, 6, 8)
    times = {s: {n: [] for n in sizes} for s in strategies}
    try:
        for r in range(args.rounds + 1):
            for name, fn in strategies.items():
                llama.linear = fn
                for n in sizes:
                    t = forward_s(n)
                    if r:  # round 0 warms up (and builds the transposed copies)
                        times[name][n].append(t)
    finally:
        llama.linear = ours
    med = {s: {n: statistics.median(v) * 1e3 for n, v in d.items()} for s, d in times.items()}
    print(f"\n{args.target} {rt.w.precision}, {args.threads} thread(s), context {args.context}, median of {args.rounds} rounds")
    print("| strategy | " + " | ".join(f"T{n} ms" for n in sizes) + " | T8/T1 |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for s, m in med.items():
        print(f"| {s} | " + " | ".join(f"{m[n]:.1f}" for n in sizes) + f" | {m[8] / m[1]:.2f} |")
    base, new = med["F.linear (out, in)"], med["specdraft linear"]
    print("\nF.linear / specdraft linear: " + ", ".join(f"T{n} {base[n] / new[n]:.2f}x" for n in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
