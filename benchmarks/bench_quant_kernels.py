"""The quantized matmul kernels (quant.c) against the bf16 kernel, per SmolLM2 matrix shape and row
count, and where a quantized step's time goes.

In one run, 2 threads by default, rounds alternating between the kernels, medians:

- per matrix shape of SmolLM2-135M's Q4_1 GGUF (q, k/v, o, gate/up, down, the Q8_0 head) and
  rows M = 1, 2, 5, 9, 16: ms per product and GOPS (2 M N K / t) of ``quant_matmul`` (the file's
  blocks; activation rows quantized inside the call) and of the bf16 kernel
  (:func:`specdraft.kernels.fewrows_matmul` on the same weights de-quantized to bf16);
- a step profile of :class:`QuantRuntime` for T = 1, 2, 5, 9 new tokens at a ``--context``-token
  cache: the whole forward, the matmuls' share (each layer's 7 products times the layers, plus the
  head, timed one by one as above), and the rest (attention, norms, activation quantization,
  SiLU, embedding, Python): T(n) / T(1) is the verification cost the policy sees. Products timed
  alone keep their weights in cache where they fit, while the step streams them from memory, so
  "rest" is a lower bound (negative when the step is memory-bound).

``--clock cpu`` (with ``--threads 1``) times process CPU time: on a loaded machine wall-clock
figures are mostly waits for a core, and an A/B of two kernels is better read from CPU time.

    .venv/bin/python benchmarks/bench_quant_kernels.py --threads 2 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import kernels
from specdraft.models import quant
from specdraft.models.quant import QuantMatrix, QuantRuntime, QuantWeights, dequantize_rows, quant_matmul

ROWS = (1, 2, 5, 9, 16)
SHAPES = ("q", "k", "o", "gate", "down")  # v has k's shape, up has gate's
PER_LAYER = {"q": 1, "k": 2, "o": 1, "gate": 2, "down": 1}  # products of each shape per layer


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


CLOCK = time.perf_counter  # --clock cpu: time.process_time (1 thread on a loaded machine)


def timed(fn, reps: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call), over ``reps`` calls."""
    fn()
    t = CLOCK()
    for _ in range(reps):
        fn()
    return (CLOCK() - t) / reps


def bf16_of(m: QuantMatrix) -> torch.Tensor:
    return dequantize_rows(m, torch.arange(m.rows)).to(torch.bfloat16).contiguous()


def kernel_table(w: QuantWeights, rounds: int) -> dict[tuple[str, int], float]:
    """Median seconds of the quantized product per (shape, M); prints the table with bf16's."""
    mats = {n: getattr(w.layers[0], n) for n in SHAPES} | {"head": w.head}
    quant_s: dict[tuple[str, int], float] = {}
    print(
        f"{'matrix':>6} {'N x K':>12} {'type':>5} {'M':>3} | {'quant ms':>9} {'GOPS':>6} | "
        f"{'bf16 ms':>8} {'GOPS':>6} | bf16/quant"
    )
    for name, m in mats.items():
        wb = bf16_of(m)
        reps = 3 if name == "head" else 40
        for M in ROWS:
            x = torch.randn(M, m.cols)
            if not kernels.supports(x, wb):
                continue
            tq, tb = [], []
            for _ in range(rounds):
                tq.append(timed(lambda m=m, x=x: quant_matmul(m, x), reps))
                tb.append(timed(lambda x=x, wb=wb: kernels.fewrows_matmul(x, wb), reps))
            q, b = statistics.median(tq), statistics.median(tb)
            quant_s[name, M] = q
            ops = 2 * M * m.rows * m.cols / 1e9
            print(
                f"{name:>6} {m.rows:>5} x {m.cols:<4} {quant.QTYPES[m.type]:>5} {M:>3} | {q * 1e3:9.3f} "
                f"{ops / q:6.1f} | {b * 1e3:8.3f} {ops / b:6.1f} | {b / q:5.2f}x",
                flush=True,
            )
    return quant_s


def step_profile(w: QuantWeights, quant_s: dict, context: int, rounds: int) -> None:
    """T(n) of the runtime's forward and its matmul share, n = 1 and the table's rows up to 9."""
    rt = QuantRuntime(w)
    kv = rt.new_state(1, context + 32)
    rt.forward(kv, torch.randint(0, 1000, (1, context)), torch.arange(context).unsqueeze(0))
    L = len(w.layers)
    print(f"\nstep profile at a {context}-token context (ms, medians of {rounds}):")
    print(f"{'T':>3} {'forward':>8} {'T/T1':>5} | {'matmuls':>8} {'head':>6} | {'rest':>6}")
    t1 = None
    for T in (n for n in ROWS if n <= 9):
        tok = torch.randint(0, 1000, (1, T))
        pos = torch.arange(context, context + T).unsqueeze(0)
        s = statistics.median(
            timed(lambda tok=tok, pos=pos: rt.forward(kv, tok, pos), 10) for _ in range(rounds)
        )
        t1 = t1 or s
        mm = L * sum(k * quant_s[n, T] for n, k in PER_LAYER.items())
        head = quant_s["head", T]
        print(
            f"{T:>3} {s * 1e3:8.2f} {s / t1:5.2f} | {mm * 1e3:8.2f} {head * 1e3:6.2f} | "
            f"{(s - mm - head) * 1e3:6.2f}",
            flush=True,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--context", type=int, default=100)
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time, for --threads 1 on a loaded machine (other threads' waits not counted)",
    )
    args = p.parse_args(argv)
    if args.clock == "cpu":
        if args.threads != 1:
            p.error("--clock cpu needs --threads 1")
        global CLOCK
        CLOCK = time.process_time
    print("command: python benchmarks/bench_quant_kernels.py " + " ".join(sys.argv[1:]))
    torch.set_num_threads(args.threads)
    variant = quant.variants()[-1]
    print(f"CPU: {cpu_model()}; threads {args.threads}; {args.clock} clock; kernel variant {variant}")
    w = QuantWeights.from_gguf(quant.gguf_path(args.target))
    quant_s = kernel_table(w, args.rounds)
    step_profile(w, quant_s, args.context, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
