"""This CPU's bounds for a target forward over n new tokens, against what the runtime reaches.

Measures, with a small C program built by ``gcc`` (AVX2/FMA, OpenMP):

- peak fp32 FMA throughput: independent FMA chains on registers, no memory (GFLOP/s);
- memory read bandwidth: an AVX2 sum over a buffer far larger than the caches (GB/s);

then, for the target's linear layers with bf16 weights (fp32 arithmetic, as the runtime runs them
on a CPU without native bf16), the floors T(n) >= max(weight bytes / bandwidth, 2 n params / peak),
and the runtime's own T(1), T(8) at a 200-token context (medians of interleaved rounds). The
floors cover the linears only, and assume perfect overlap of streaming and arithmetic.

    .venv/bin/python benchmarks/cpu_roofline.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api  # noqa: E402
from specdraft.bench.profile import profile_latency  # noqa: E402

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
                float f[8]; _mm256_storeu_ps(f, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3))); sink += f[0];
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
        bw = probe("stream", args.threads, exe)
    pipe = api.load(args.target, "none", dtype="auto", threads=args.threads)
    w = pipe.runtime.w
    params = sum(t.numel() for layer in w.layers for t in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    params += w.lm_head.numel()
    weight_gb = params * 2 / 1e9  # bf16
    prof = profile_latency(pipe.runtime, None, new_tokens=(1, 8), context=args.context, repeats=args.repeats, warmup=3)
    t1, t8 = prof.target_time(1) * 1e3, prof.target_time(8) * 1e3
    floor = {n: max(weight_gb / bw, 2 * n * params / 1e9 / peak) * 1e3 for n in (1, 8)}
    print(f"\n{args.target}: {params / 1e6:.1f} M parameters in linear layers ({weight_gb * 1e3:.0f} MB as bf16), "
          f"{args.threads} thread(s), context {args.context}")
    print(f"peak fp32 FMA: {peak:.0f} GFLOP/s; memory read: {bw:.1f} GB/s")
    print("| n new tokens | linears: stream floor ms | linears: FMA floor ms | floor ms | runtime forward ms |")
    print("|---|---|---|---|---|")
    for n, t in ((1, t1), (8, t8)):
        print(f"| {n} | {weight_gb / bw * 1e3:.1f} | {2 * n * params / 1e9 / peak * 1e3:.1f} | {floor[n]:.1f} | {t:.1f} |")
    print(f"T8/T1: floors {floor[8] / floor[1]:.2f}, runtime {t8 / t1:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
