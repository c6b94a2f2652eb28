"""Which matmul path the compact runtime should use for decode-sized inputs, on the whole target.

Times a target forward over n = 1..8 new tokens at a 200-token context with every linear
computed three ways on the same fp32 weights, plus the bf16-weight runtime:

- ``F.linear``: torch's GEMM on the ``(out, in)`` weight;
- ``torch few-row forms``: :func:`specdraft.models.llama.linear` with the native kernel switched
  off (an ``(in, out)`` copy for M <= 3 rows, ``(W x^T)^T`` for M = 4-5);
- ``native kernel``: :mod:`specdraft.kernels` (fp32 weights), the default where it builds;
- ``native kernel, bf16 weights``: the ``--dtype bf16`` runtime on a CPU without native bf16
  (bf16 weights widened to fp32 as they stream; half the memory traffic), the default runtime: every
  decoder layer of the step in one native call (:class:`specdraft.kernels.DecodeLayers`);
- ``... layer by layer``: the same kernels called layer by layer from Python (the rows below too);
- ``... row-dot tiles``: the same with bf16 weights in torch's layout through the row-dot kernel
  instead of the packed outer-product one;
- ``... torch attention``: the same with the attention block in torch's ops instead of the fused
  native RoPE + cache write + attention (:class:`specdraft.kernels.RopeAttention`), which every
  other row uses.

Strategies alternate round by round; medians are printed with their ratios to ``F.linear``.

    .venv/bin/python benchmarks/bench_linear.py --threads 2 --rounds 12
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

from specdraft import api, kernels
from specdraft.models import llama
from specdraft.models.llama import LlamaRuntime, LlamaWeights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args(argv)
    print("command:", "python benchmarks/bench_linear.py " + " ".join(sys.argv[1:]), flush=True)

    pipe = api.load(args.target, "none", dtype="fp32", threads=args.threads)
    runtimes = {
        "fp32": pipe.runtime,
        "bf16": LlamaRuntime(LlamaWeights.from_hf(pipe.target.model, torch.bfloat16)),
    }
    states = {}
    for name, rt in runtimes.items():
        kv = states[name] = rt.new_state(1, args.context + 16)
        rt.forward(kv, torch.randint(0, 1000, (1, args.context)), torch.arange(args.context).unsqueeze(0))

    def forward_s(name: str, n: int) -> float:
        tokens = torch.randint(0, 1000, (1, n))
        positions = (args.context + torch.arange(n)).unsqueeze(0)
        t0 = time.perf_counter()
        runtimes[name].forward(states[name], tokens, positions)
        return time.perf_counter() - t0

    ours, supports, att_supports = llama.linear, kernels.supports, kernels.attention_supports
    have_kernel = kernels.available()
    strategies = {  # name: (runtime, linear, kernel on, fused attention on, packed bf16 on, native layers on)
        "F.linear": ("fp32", lambda x, w, b, packed, exact=False: F.linear(x, w, b), False, True, True, True),
        "torch few-row forms": ("fp32", ours, False, True, True, True),
    }
    if have_kernel:
        strategies["native kernel"] = ("fp32", ours, True, True, True, True)
        strategies["native kernel, bf16 weights"] = ("bf16", ours, True, True, True, True)
        strategies["native kernel, bf16 weights, layer by layer"] = ("bf16", ours, True, True, True, False)
        strategies["native kernel, bf16 weights, row-dot tiles"] = ("bf16", ours, True, True, False, False)
        strategies["native kernel, bf16 weights, torch attention"] = ("bf16", ours, True, False, True, False)
    else:
        print(f"native kernel not available: {kernels.status()}")
    sizes = (1, 2, 3, 4, 6, 8)
    times = {s: {n: [] for n in sizes} for s in strategies}
    try:
        for r in range(args.rounds + 1):
            for name, (rt, fn, on, att, pk, nl) in strategies.items():
                llama.linear = fn
                kernels.USE_PACKED = pk
                kernels.USE_NATIVE_LAYERS = nl
                kernels.supports = supports if on else (lambda x, w: False)
                kernels.attention_supports = att_supports if att else (lambda *a: False)
                for n in sizes:
                    t = forward_s(rt, n)
                    if r:  # round 0 warms up (and builds the transposed copies)
                        times[name][n].append(t)
    finally:
        llama.linear, kernels.supports, kernels.attention_supports = ours, supports, att_supports
        kernels.USE_PACKED = kernels.USE_NATIVE_LAYERS = True
    med = {s: {n: statistics.median(v) * 1e3 for n, v in d.items()} for s, d in times.items()}
    print(
        f"\n{args.target}, {torch.get_num_threads()} thread(s), context {args.context}, median of "
        f"{args.rounds} rounds"
    )
    print("| strategy | " + " | ".join(f"T{n} ms" for n in sizes) + " | T8/T1 |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for s, m in med.items():
        print(f"| {s} | " + " | ".join(f"{m[n]:.1f}" for n in sizes) + f" | {m[8] / m[1]:.2f} |")
    base = med["F.linear"]
    for s, m in med.items():
        if s != "F.linear":
            print(f"F.linear / {s}: " + ", ".join(f"T{n} {base[n] / m[n]:.2f}x" for n in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
