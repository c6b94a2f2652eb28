"""This CPU's bounds for a target forward over n new tokens, against what the runtime reaches.

Measures, with a small C program built by ``gcc`` (AVX2/FMA, OpenMP):

- peak fp32 FMA throughput: independent FMA chains on registers, no memory (GFLOP/s);
- memory read bandwidth: an AVX2 sum over a buffer far larger than the caches (GB/s);

then, for the target's linear layers with bf16 weights (fp32 arithmetic, as the runtime runs them
on a CPU without native bf16), the floors T(n) >= max(weight bytes / bandwidth, 2 n params / peak),
and the runtime's own T(1), T(8) at a 200-token context (medians of interleaved rounds). The
floors cover the linears only, and assume perfect overlap of streaming and arithmetic.

Then what the project's packed kernel (:mod:`specdraft.kernels`) reaches:

- its arithmetic rate for 8 rows with the weight in cache (one 576 x 1536 bf16 weight, called
  back to back through ctypes): the most an 8-row product can do here, DRAM aside;
- the model's linears alone, called back to back (1 and 8 rows), against the whole forward;
  ``O = forward - linears alone`` is the other work (attention, norms, activations, Python).

With ``L8 = 2 * 8 * params / in-cache rate`` (the 8-row linears at that rate with the weight stream
perfectly hidden) and ``L1`` = the stream floor, a forward with ``O`` ms of other work has
``T8 / T1 >= (L8 + O) / (L1 + O)``: it is printed for the runtime's own 1-token O, with the O at
which the bound reaches 1.2.

    .venv/bin/python benchmarks/cpu_roofline.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api, kernels
from specdraft.bench.profile import median_time, profile_latency

_PEAK = [float("nan")]  # the measured FMA peak, GFLOP/s

PROBE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv) {
    if (!strcmp(argv[1], "fma")) {
        long iters = 100000000; double t0 = omp_get_wtime(); float sink = 0;
        #pragma omp parallel reduction(+:sink)
        {
            __m256 a[12], b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
            for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
            long n = iters / omp_get_num_threads();
            for (long it = 0; it < n; it++) {
                #pragma GCC unroll 12
                for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
            }
            for (int i = 1; i < 12; i++) a[0] = _mm256_add_ps(a[0], a[i]);
            float f[8]; _mm256_storeu_ps(f, a[0]); sink += f[0];
        }
        printf("%f %f\n", iters * 12.0 * 16 / (omp_get_wtime() - t0) / 1e9, sink);
    } else {
        long n = 1L << 27; float *buf = aligned_alloc(64, n * sizeof(float));
        #pragma omp parallel for
        for (long i = 0; i < n; i++) buf[i] = 1.0f;
        double best = 0; float sink = 0;
        for (int r = 0; r < 5; r++) {
            double t0 = omp_get_wtime();
            #pragma omp parallel reduction(+:sink)
            {
                __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
                #pragma omp for
                for (long i = 0; i < n; i += 32) {
                    s0 = _mm256_add_ps(s0, _mm256_load_ps(buf + i));
                    s1 = _mm256_add_ps(s1, _mm256_load_ps(buf + i + 8));
                    s2 = _mm256_add_ps(s2, _mm256_load_ps(buf + i + 16));
                    s3 = _mm256_add_ps(s3, _mm256_load_ps(buf + i + 24));
                }
                float f[8];
                _mm256_storeu_ps(f, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
                sink += f[0];
            }
            double gbs = n * 4.0 / (omp_get_wtime() - t0) / 1e9;
            best = gbs > best ? gbs : best;
        }
        printf("%f %f\n", best, sink);
    }
    return 0;
}
"""


def probe(kind: str, threads: int, exe: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([str(exe), kind], capture_output=True, text=True, check=True, env=env).stdout
    return float(out.split()[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    print("command: python benchmarks/cpu_roofline.py " + " ".join(sys.argv[1:]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "probe.c"), Path(tmp, "probe")
        src.write_text(PROBE)
        subprocess.run(["gcc", "-O3", "-mavx2", "-mfma", "-fopenmp", str(src), "-o", str(exe)], check=True)
        peak = probe("fma", args.threads, exe)
        _PEAK[0] = peak
        bw = probe("stream", args.threads, exe)
    pipe = api.load(args.target, "none", dtype="bf16", threads=args.threads)  # the bf16 runtime's roofline
    w = pipe.runtime.w
    params = sum(
        t.numel() for layer in w.layers for t in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
    )
    params += w.lm_head.numel()
    weight_gb = params * 2 / 1e9  # bf16
    prof = profile_latency(
        pipe.runtime, None, new_tokens=(1, 8), context=args.context, repeats=args.repeats, warmup=3
    )
    t1, t8 = prof.target_time(1) * 1e3, prof.target_time(8) * 1e3
    floor = {n: max(weight_gb / bw, 2 * n * params / 1e9 / peak) * 1e3 for n in (1, 8)}
    print(
        f"\n{args.target}: {params / 1e6:.1f} M parameters in linear layers ({weight_gb * 1e3:.0f} MB as "
        f"bf16), {args.threads} thread(s), context {args.context}"
    )
    print(f"peak fp32 FMA: {peak:.0f} GFLOP/s; memory read: {bw:.1f} GB/s")
    print(
        "| n new tokens | linears: stream floor ms | linears: FMA floor ms | floor ms | runtime forward ms |"
    )
    print("|---|---|---|---|---|")
    for n, t in ((1, t1), (8, t8)):
        print(
            f"| {n} | {weight_gb / bw * 1e3:.1f} | {2 * n * params / 1e9 / peak * 1e3:.1f} | "
            f"{floor[n]:.1f} | {t:.1f} |"
        )
    print(f"T8/T1: floors {floor[8] / floor[1]:.2f}, runtime {t8 / t1:.2f}")
    if kernels.available() and w.dtype == torch.bfloat16:
        kernel_bound(pipe, params, weight_gb / bw * 1e3, args)
    return 0


def kernel_bound(pipe, params: int, stream_floor_ms: float, args) -> None:
    """The packed kernel's in-cache 8-row rate, its linears alone and in the forward, and the T8/T1 bound."""
    lib = kernels._lib
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    wc = kernels.packed((torch.randn(1536, 576, generator=g) * 0.05).to(torch.bfloat16))
    x8 = torch.randn(8, 1536, generator=g)
    y8 = torch.empty(8, 1536)
    calls = 200

    def in_cache():
        for _ in range(calls):
            lib.packed_bf16(x8.data_ptr(), wc.data_ptr(), y8.data_ptr(), 8, 576, 1536, threads)

    in_cache()
    rate = 2 * 8 * 576 * 1536 * calls / median_time(in_cache, args.repeats) / 1e9

    w = pipe.runtime.w
    weights = [t for layer in w.layers for t in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)] + [
        w.lm_head
    ]
    shapes = [(kernels.packed(t), t.shape[1], t.shape[0]) for t in weights]
    x = torch.randn(8, max(k for _, k, _ in shapes), generator=g)
    y = torch.empty(8, max(n for _, _, n in shapes))

    def linears(m: int):
        for wp, k, n in shapes:
            lib.packed_bf16(x.data_ptr(), wp.data_ptr(), y.data_ptr(), m, k, n, threads)

    rt = pipe.runtime
    state = rt.new_state(1, args.context + 16)
    rt.forward(state, torch.randint(0, 1000, (1, args.context)), torch.arange(args.context).unsqueeze(0))

    def forward(n: int):
        rt.forward(state, torch.randint(0, 1000, (1, n)), (args.context + torch.arange(n)).unsqueeze(0))

    times: dict[str, list] = {}
    for r in range(args.repeats + 2):  # linears alone and whole forwards interleaved; 2 warm-up rounds
        for name, fn in (
            ("lin1", lambda: linears(1)),
            ("lin8", lambda: linears(8)),
            ("fwd1", lambda: forward(1)),
            ("fwd8", lambda: forward(8)),
        ):
            t0 = time.perf_counter()
            fn()
            if r >= 2:
                times.setdefault(name, []).append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    l8 = 2 * 8 * params / 1e9 / rate * 1e3
    other = {n: med[f"fwd{n}"] - med[f"lin{n}"] for n in (1, 8)}
    o = other[1]
    print(
        f"\npacked kernel, 8 rows, weight in cache: {rate:.0f} GFLOP/s ({rate / _PEAK[0] * 100:.0f}% of "
        "the FMA peak)"
    )
    print("| rows | linears alone ms | forward ms | other work ms (forward - linears) |")
    print("|---|---|---|---|")
    for n in (1, 8):
        print(f"| {n} | {med[f'lin{n}']:.1f} | {med[f'fwd{n}']:.1f} | {other[n]:.1f} |")
    print(
        f"8-row linears at the in-cache rate, stream hidden: L8 = {l8:.1f} ms; 1-row stream floor L1 = "
        f"{stream_floor_ms:.1f} ms"
    )
    need = (l8 - 1.2 * stream_floor_ms) / 0.2
    print(
        f"bound T8/T1 >= (L8 + O) / (L1 + O) = {(l8 + o) / (stream_floor_ms + o):.2f} with this "
        f"runtime's O = {o:.1f} ms (1-token forward minus its linears); it reaches 1.2 only for O >= "
        f"{need:.1f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
