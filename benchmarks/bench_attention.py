"""The native attention kernel (``rope_attend16``: RoPE, fp16 key/value cache write, causal
attention) of this checkout against the same kernel at another commit, in one run.

Both ``specdraft/kernels/fewrows.c`` versions are compiled (the base from ``git show
BASE:specdraft/kernels/fewrows.c``) and called through ctypes on the same inputs: SmolLM2-135M's
attention shape (9 query heads, 3 KV heads, head dim 64), ``--layers`` layers of fp16 caches (so a
step reads each layer's keys and values from memory, as a real step does), for T = ``--tokens``
new tokens at each ``--contexts`` length; rounds alternate between the two, best and median of
``--rounds``. Every configuration's outputs and caches are compared bit for bit (a kernel change
here must not change a result). Ratios compare the two kernels of this run only; the CPU is
printed.

    .venv/bin/python benchmarks/bench_attention.py --base 040fd3e --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import kernels
from specdraft.bench.profile import cpu_name
from specdraft.kernels.build import open_library

H, G, D = 9, 3, 64  # SmolLM2-135M


def library_at(rev: str, tmp: Path):
    """fewrows.c as of git revision ``rev``, built and loaded."""
    src = tmp / rev / "fewrows.c"
    src.parent.mkdir(parents=True)
    src.write_bytes(
        subprocess.run(
            ["git", "show", f"{rev}:specdraft/kernels/fewrows.c"], check=True, capture_output=True
        ).stdout
    )
    return open_library(src, kernels._setup_fewrows)


def step(lib, qkv, pos, cos, sin, caches, out, T, cap, threads) -> float:
    """One step's attention over every layer; seconds."""
    t = time.perf_counter()
    for kc, vc in caches:
        lib.rope_attend16(
            qkv.data_ptr(),
            pos.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            kc.data_ptr(),
            vc.data_ptr(),
            out.data_ptr(),
            1,
            T,
            H,
            G,
            D,
            cap,
            threads,
        )
    return time.perf_counter() - t


def compare(libs, ctx: int, T: int, layers: int, rounds: int, threads: int) -> tuple[list[list[float]], bool]:
    g = torch.Generator().manual_seed(ctx * 10 + T)
    cap = ctx + T
    qkv = torch.randn(T, (H + 2 * G) * D, generator=g)
    ang = torch.randn(cap, D, generator=g)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    pos = torch.arange(ctx, ctx + T)
    base = [
        (torch.randn(G, cap, D, generator=g).half(), torch.randn(G, cap, D, generator=g).half())
        for _ in range(layers)
    ]
    caches = [[(k.clone(), v.clone()) for k, v in base] for _ in libs]
    outs = [torch.zeros(T, H * D) for _ in libs]
    times: list[list[float]] = [[] for _ in libs]
    for _ in range(rounds):
        for i, lib in enumerate(libs):
            times[i].append(step(lib, qkv, pos, cos, sin, caches[i], outs[i], T, cap, threads))
    same = torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(caches[0], caches[1])
    )
    return times, same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose fewrows.c is the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="128,512,1024,2048,4000")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}; threads {args.threads}; {args.layers} layers, H={H} G={G} D={D}, fp16 caches")
    print(f"base {args.base} against this checkout; ms per step (all layers), best / median of {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        libs = [library_at(args.base, Path(tmp)), kernels._load()]
        if libs[1] is None:
            print("no native kernels here")
            return 1
        head = ("T", "context", "base best", "new best", "ratio", "base med", "new med", "ratio")
        print(" ".join(f"{h:>9}" for h in head), " same bits")
        ok = True
        for T in map(int, args.tokens.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                t, same = compare(libs, ctx, T, args.layers, args.rounds, args.threads)
                best, med = [min(x) * 1e3 for x in t], [statistics.median(x) * 1e3 for x in t]
                cells = [T, ctx, f"{best[0]:.3f}", f"{best[1]:.3f}", f"{best[0] / best[1]:.2f}x"]
                cells += [f"{med[0]:.3f}", f"{med[1]:.3f}", f"{med[0] / med[1]:.2f}x"]
                print(" ".join(f"{c:>9}" for c in cells), f" {same}")
                ok &= same
    print("outputs and caches bit-identical in every configuration" if ok else "OUTPUTS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
