"""A native few-row matmul (``fewrows.c``), built with the system C compiler on first use.

Decode and verification steps multiply 1..k+1 rows by every weight of the model. On CPUs
without native bf16 that shape is where torch's BLAS paths are weakest, so the compact runtime
sends it here (see :func:`specdraft.models.llama.linear`): fp32 or bf16 weights, fp32
arithmetic, each row's result independent of the other rows.

The shared library is compiled once per source version into the user cache
(``~/.cache/specdraft/kernels``, or ``$SPECDRAFT_CACHE/kernels``) and loaded with ctypes. Where
it cannot be (no ``gcc``, no AVX2/FMA, ``SPECDRAFT_KERNELS=0``) :func:`available` is False and the
runtime falls back to torch's matmuls; :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("fewrows.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]
MAX_ROWS = 16  # above this, torch's GEMM is as fast or faster (benchmarks/bench_linear.py)

PROFILE_NAME = "specdraft::fewrows_matmul"  # the name torch.profiler shows for the kernel
_profiling = torch._C._autograd._profiler_enabled

_lib: ctypes.CDLL | None = None
_why: str | None = None  # None: not tried yet


def cache_dir() -> Path:
    from specdraft.models.loading import cache_root  # at call time: loading imports transformers

    return cache_root() / "kernels"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _cpu_ok() -> bool:
    flags = _cpu_flags()
    return "avx2" in flags and "fma" in flags


def _build() -> Path:
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / f"fewrows-{tag}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # compile aside, rename into place
    os.close(fd)
    try:
        r = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _why
    if _why is not None:
        return _lib
    if os.environ.get("SPECDRAFT_KERNELS", "1") == "0":
        _why = "disabled by SPECDRAFT_KERNELS=0"
    elif not _cpu_ok():
        _why = "CPU lacks AVX2/FMA"
    else:
        try:
            lib = ctypes.CDLL(str(_build()))
            for fn in (lib.fewrows_f32, lib.fewrows_bf16):
                fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
                fn.restype = None
            lib.rmsnorm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float]
            lib.rmsnorm_f32.restype = None
            _lib, _why = lib, "ok"
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why = f"build failed: {e}"
    return _lib


def available() -> bool:
    """True when the native kernel is built and loaded (building it on first call)."""
    return _load() is not None


def status() -> str:
    """``"ok"`` or why the kernel is not in use."""
    _load()
    return _why or "not tried"


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`fewrows_matmul` takes this product (and the kernel is available)."""
    return (
        x.dtype == torch.float32
        and w.dtype in (torch.float32, torch.bfloat16)
        and w.dim() == 2
        and w.shape[1] % 8 == 0
        and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
        and w.is_contiguous()
        and available()
    )


def _call(name: str, fn, *args) -> None:
    """``fn(*args)``, shown to torch.profiler as ``name`` while it records (ctypes calls are
    invisible to it otherwise; specdraft.bench.profile counts :data:`PROFILE_NAME` as a matmul)."""
    if _profiling():
        with torch.profiler.record_function(name):
            fn(*args)
    else:
        fn(*args)


def fewrows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for fp32 ``x (..., K)`` with at most :data:`MAX_ROWS` rows and fp32 or bf16
    ``w (N, K)``; float32 out. Call :func:`supports` first."""
    lib = _load()
    K, N = w.shape[1], w.shape[0]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    fn = lib.fewrows_bf16 if w.dtype == torch.bfloat16 else lib.fewrows_f32
    _call(PROFILE_NAME, fn, x2.data_ptr(), w.data_ptr(), y.data_ptr(), M, K, N, torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dimension of a few fp32 rows, or None where the kernel does not apply
    (the caller then uses torch's). Faster than ``F.rms_norm`` for decode-sized inputs, where the
    per-op overhead of torch's composite dominates."""
    K = x.shape[-1]
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or K % 8
        or x.numel() // K > MAX_ROWS
        or not available()
    ):
        return None
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty_like(x2)
    _call("specdraft::rms_norm", _lib.rmsnorm_f32, x2.data_ptr(), weight.data_ptr(), y.data_ptr(), x2.shape[0], K, eps)
    return y.view(x.shape)
