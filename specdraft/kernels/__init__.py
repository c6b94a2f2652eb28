"""Native kernels for decode and verification steps (``fewrows.c``), built with the system C
compiler on first use.

Decode and verification steps multiply 1..k+1 rows by every weight of the model. On CPUs
without native bf16 that shape is where torch's BLAS paths are weakest, so the compact runtime
sends it here (see :func:`specdraft.models.llama.linear`): fp32 or bf16 weights, fp32
arithmetic, each row's result independent of the other rows. The attention block of such a step
(RoPE, cache write, causal attention) is one call too (:class:`RopeAttention`): in torch it is a
dozen small ops whose overhead outweighs their arithmetic.

This module holds the ctypes wrappers. The shared library is compiled once per source version
into the user cache and checked on load by :mod:`specdraft.kernels.build`
(:func:`~specdraft.kernels.build.open_library`). Where no library can be had (no ``gcc``, no
AVX2/FMA, ``SPECDRAFT_KERNELS=0``) :func:`available` is False and the runtime falls back to
torch's matmuls, with a warning when a build failed; :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.kernels import build

log = logging.getLogger("specdraft")

SOURCE = Path(__file__).with_name("fewrows.c")
MAX_ROWS = 16  # above this, torch's GEMM is as fast or faster (benchmarks/bench_linear.py)
# bf16 weights: torch would widen the whole weight to fp32 on every call; in an ad-hoc timing
# (3072 x 576 weights, 2 threads, a busy machine) the packed kernel was ~3x faster up to 128 rows
# and still faster at 256
PACKED_MAX_ROWS = 256
USE_NATIVE_LAYERS = (
    True  # decode steps run all decoder layers in one native call (DecodeLayers); False: layer by layer
)
USE_PACKED = True  # bf16 weights through the packed kernel (benchmarks/bench_linear.py compares without)

PROFILE_NAME = "specdraft::fewrows_matmul"  # the name torch.profiler shows for the kernel
_profiling = torch._C._autograd._profiler_enabled

_lib: ctypes.CDLL | None = None
_why: str | None = None  # None: not tried yet


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    flags = build.cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _setup_fewrows(lib: ctypes.CDLL) -> None:
    for fn in (lib.fewrows_f32, lib.fewrows_bf16):
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        fn.restype = None
    lib.packed_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    lib.packed_bf16.restype = None
    lib.rope_attend.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 7
    lib.rope_attend.restype = None
    lib.rope_attend_window.argtypes = (
        [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
    )
    lib.rope_attend_window.restype = None
    lib.rope_attend_tree.argtypes = (
        [ctypes.c_void_p] * 5
        + [ctypes.c_int]
        + [ctypes.c_void_p] * 5
        + [ctypes.c_int] * 6
        + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
    )
    lib.rope_attend_tree.restype = None
    lib.rope_attend16.argtypes, lib.rope_attend16.restype = lib.rope_attend.argtypes, None
    lib.rope_attend_tree16.argtypes, lib.rope_attend_tree16.restype = lib.rope_attend_tree.argtypes, None
    lib.rmsnorm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float]
    lib.rmsnorm_f32.restype = None
    lib.decode_layers.argtypes = (
        [ctypes.c_void_p] * 2
        + [ctypes.c_int] * 8
        + [ctypes.c_float, ctypes.c_int]
        + [ctypes.c_void_p] * 10
        + [ctypes.c_int]
    )
    lib.decode_layers.restype = None
    lib.decode_layers_tree.argtypes = (
        [ctypes.c_void_p] * 5
        + [ctypes.c_int] * 9
        + [ctypes.c_float, ctypes.c_int]
        + [ctypes.c_void_p] * 10
        + [ctypes.c_int]
    )
    lib.decode_layers_tree.restype = None


def _load() -> ctypes.CDLL | None:
    global _lib, _why
    if _why is not None:
        return _lib
    if os.environ.get("SPECDRAFT_KERNELS", "1") == "0":
        _why = "disabled by SPECDRAFT_KERNELS=0"
    elif not build.cpu_can_build():
        _why = "CPU lacks AVX2/FMA"
    else:
        try:
            _lib, _why = build.open_library(SOURCE, _setup_fewrows), "ok"
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
            _why = f"build failed: {e}"
            log.warning("specdraft: native kernels unavailable (%s); using torch's matmuls", _why)
    return _lib


def available() -> bool:
    """True when the native kernel is built and loaded (building it on first call)."""
    return _load() is not None


def status() -> str:
    """``"ok"`` or why the kernel is not in use."""
    _load()
    return _why or "not tried"


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`fewrows_matmul` takes this product (and the kernel is available): up to
    :data:`MAX_ROWS` rows, or :data:`PACKED_MAX_ROWS` for bf16 weights the packed kernel takes."""
    if x.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % 8 or not w.is_contiguous():
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if w.dtype == torch.bfloat16:
        limit = PACKED_MAX_ROWS if takes_packed(w) else MAX_ROWS
    elif w.dtype == torch.float32:
        limit = MAX_ROWS
    else:
        return False
    return rows <= limit and available()


def _call(name: str, fn, *args) -> None:
    """``fn(*args)``, shown to torch.profiler as ``name`` while it records (ctypes calls are
    invisible to it otherwise; specdraft.bench.profile counts :data:`PROFILE_NAME` as a matmul)."""
    if _profiling():
        with torch.profiler.record_function(name):
            fn(*args)
    else:
        fn(*args)


PACK_PERM = torch.tensor([p // 2 + 8 * (p % 2) for p in range(16)])  # see fewrows.c
_PACKED: dict[int, tuple[int, torch.Tensor]] = {}


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """The ``(N / 16, K, 16)`` layout of a bf16 ``w (N, K)`` that the packed kernel streams."""
    N, K = w.shape
    return w.view(N // 16, 16, K)[:, PACK_PERM, :].transpose(1, 2).contiguous()


def takes_packed(w: torch.Tensor) -> bool:
    """Whether a ``(N, K)`` weight goes through the packed kernel: bf16, N a multiple of 16."""
    return USE_PACKED and w.dtype == torch.bfloat16 and w.dim() == 2 and w.shape[0] % 16 == 0


def packed(w: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bf16` of ``w``, cached per weight tensor (rebuilt if ``w`` was changed in
    place). The packed copy adds the bf16 weight's size again to memory."""
    hit = _PACKED.get(id(w))
    if hit is None:
        weakref.finalize(w, _PACKED.pop, id(w), None)
    if hit is None or hit[0] != w._version:
        hit = _PACKED[id(w)] = (w._version, pack_bf16(w))
    return hit[1]


def prepack(*weights: torch.Tensor) -> None:
    """Make now the packed copies (:func:`packed`) of those ``weights`` the packed kernel takes, so
    that the first step multiplying by them does not pay for packing: that step is timed by an
    adaptive policy, which read a feature draft's first proposal (about ten times its usual time)
    as its latency and decoded plainly (``results/policy-warmup-2026-12-05/README.md``). Runtimes
    call it when they are built."""
    if not available():
        return
    for w in weights:
        if takes_packed(w):
            packed(w)


def fewrows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for fp32 ``x (..., K)`` and fp32 or bf16 ``w (N, K)``; float32 out. Call
    :func:`supports` first.

    bf16 weights with N a multiple of 16 go through the packed outer-product kernel (a packed
    copy made on first use, :func:`packed`); others through the row-dot kernel. Either way each
    row's result is independent of the other rows."""
    lib = _lib or _load()
    N, K = w.shape
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty(x.shape[:-1] + (N,), dtype=torch.float32)
    if takes_packed(w):
        fn, wp = lib.packed_bf16, packed(w)
    else:
        fn, wp = (lib.fewrows_bf16 if w.dtype == torch.bfloat16 else lib.fewrows_f32), w
    _call(
        PROFILE_NAME,
        fn,
        x.data_ptr(),
        wp.data_ptr(),
        y.data_ptr(),
        x.numel() // K,
        K,
        N,
        torch.get_num_threads(),
    )
    return y


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
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty_like(x)
    _call(
        "specdraft::rms_norm",
        _lib.rmsnorm_f32,
        x.data_ptr(),
        weight.data_ptr(),
        y.data_ptr(),
        x.numel() // K,
        K,
        eps,
    )
    return y


def attention_supports(T: int, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether :class:`RopeAttention` takes a step of T new tokens per row with these heads."""
    return (
        T <= MAX_ROWS and head_dim % 16 == 0 and head_dim <= 256 and n_heads % n_kv_heads == 0 and available()
    )


@dataclass
class TreeLayout:
    """Where a token-tree step's queries look, in the form the native attention takes
    (``rope_attend_tree`` in fewrows.c): query (b, t) at position p sees p + 1 slots, the slots
    below ``lo[b]`` and then ``vmap[b, t, : p + 1 - lo[b]]`` (ascending), exactly the keys a chain
    step over its path sees in the same order, so its output is bit-identical to that chain's.

    Attributes:
        slot: ``(B, T)`` int64 cache slot of each new token's key and value.
        lo: ``(B,)`` int64 first slot of each row that is read through the map.
        vmap: ``(B, T, W)`` int64 contiguous, the slots each query sees from ``lo`` on (W: at least
            the most any query sees; T for a tree below a root at ``lo - 1``).
    """

    slot: torch.Tensor
    lo: torch.Tensor
    vmap: torch.Tensor

    def pointers(self) -> tuple[int, int, int, int]:
        """The kernels' tree arguments: slot, lo and vmap pointers and the map's row width W."""
        return self.slot.data_ptr(), self.lo.data_ptr(), self.vmap.data_ptr(), self.vmap.shape[-1]


def tree_layout(attn_mask: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> TreeLayout | None:
    """The :class:`TreeLayout` of a step with ``attn_mask (B, T, S)`` over cache slots, or None when
    the mask is not of that form (the runtime then takes torch's attention). Row b's first token
    (the tree's root) is at its own position ``r``; every query sees slots ``0 .. r`` and, past
    them, as many slots as its position is past r, at most T (:meth:`specdraft.tree.TokenTree.step_mask`)."""
    B, T = attn_mask.shape[:2]
    lo = positions[:, 0] + 1  # (B,)
    vmap = torch.zeros(B, T, T, dtype=torch.int64)
    for b in range(B):
        r1 = int(lo[b])
        seen = attn_mask[b, :, r1:]  # (T, S - r1)
        want = positions[b] + 1 - r1  # (T,) slots each query sees past the root
        if (
            int(slots[b, 0]) != r1 - 1
            or not bool(attn_mask[b, :, :r1].all())
            or not bool((seen.sum(1) == want).all())
            or bool((want < 0).any() or (want > T).any())
        ):
            return None
        # the True slots first, in ascending order (a stable sort of "not seen")
        order = torch.sort((~seen).to(torch.int8), dim=1, stable=True).indices[:, :T]  # (T, <= T)
        vmap[b, :, : order.shape[1]] = order + r1
    return TreeLayout(slots.to(torch.int64).contiguous(), lo.to(torch.int64).contiguous(), vmap)


class RopeAttention:
    """RoPE, the KV-cache write and causal attention of a decode / verification step in one
    native call per layer (``rope_attend`` in fewrows.c). Made once per forward (what all layers
    share is checked once), then called per layer.

    Args:
        positions: ``(B, T)`` each new token's position, which is also its cache slot; a query at
            position p attends to slots 0..p.
        cos, sin: ``(n, D)`` fp32 half-split RoPE tables covering the positions.
        n_heads, n_kv_heads: H query heads sharing G key/value heads.
        window: W > 0: a query at position p attends to slots p - W + 1..p only (sliding-window
            layers, as transformers' Gemma 3); 0: slots 0..p.
        scale: the scores' scale; None: 1 / sqrt(D).
        tree: a token-tree step's :class:`TreeLayout` (keys and values at its slots, each query
            over its own slots); None: causal, every token at its position.

    Call :func:`attention_supports` first.
    """

    def __init__(
        self,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        n_heads: int,
        n_kv_heads: int,
        window: int = 0,
        scale: float | None = None,
        tree: TreeLayout | None = None,
    ):
        self.B, self.T = positions.shape
        self.tree = tree
        self.D = cos.shape[-1]
        if (
            cos.dtype != torch.float32
            or sin.dtype != torch.float32
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError("RopeAttention: RoPE tables must be contiguous float32")
        self.last = int(positions.max())  # the native code indexes tables and caches by position
        if tree is not None:
            self.last = max(self.last, int(tree.slot.max()))
        if cos.shape[0] <= self.last:
            raise ValueError(
                f"RopeAttention: RoPE tables cover {cos.shape[0]} positions, not {self.last + 1}"
            )
        self.pos = positions.to(torch.int64).contiguous()
        self.cos, self.sin = cos, sin
        self.H, self.G = n_heads, n_kv_heads
        self.width = (n_heads + 2 * n_kv_heads) * self.D
        self.window = int(window)
        if scale is None:  # 1 / sqrt(D) rounded as fp32 ops round it (rope_attend's 1.0f / sqrtf(D))
            scale = float(1.0 / torch.tensor(float(self.D)).sqrt())
        self.scale = float(scale)
        self.fn = _load().rope_attend_window if tree is None else _load().rope_attend_tree
        self.threads = torch.get_num_threads()

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``qkv (B, T, (H + 2G) D)`` fp32 -> ``(B, T, H D)``; writes the new keys (rotated) and
        values into the ``(B, G, cap, D)`` fp32 caches at the positions."""
        if (
            qkv.dtype != torch.float32
            or qkv.shape[-1] != self.width
            or qkv.numel() != self.B * self.T * self.width
        ):
            raise ValueError(f"RopeAttention: qkv must be float32 ({self.B}, {self.T}, {self.width})")
        if not (
            k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        ):
            raise ValueError("RopeAttention: caches must be contiguous float32 (they are written in place)")
        if (
            k_cache.shape != v_cache.shape
            or k_cache.shape[0] != self.B
            or k_cache.shape[1] != self.G
            or k_cache.shape[3] != self.D
        ):
            raise ValueError(f"RopeAttention: cache shape {tuple(k_cache.shape)} does not match")
        if k_cache.shape[2] <= self.last:
            raise ValueError(f"RopeAttention: position {self.last} beyond cache capacity {k_cache.shape[2]}")
        qkv = qkv.contiguous()
        out = torch.empty(self.B, self.T, self.H * self.D, dtype=torch.float32)
        _call(
            "specdraft::rope_attend",
            self.fn,
            qkv.data_ptr(),
            self.pos.data_ptr(),
            *(() if self.tree is None else self.tree.pointers()),
            self.cos.data_ptr(),
            self.sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            self.B,
            self.T,
            self.H,
            self.G,
            self.D,
            k_cache.shape[2],
            self.window,
            self.scale,
            self.threads,
        )
        return out


class DecodeLayers:
    """The decoder layers of a decode / verification step in one native call (``decode_layers`` in
    fewrows.c): RMSNorm, the four matmuls through the packed bf16 kernel, the fused RoPE + cache
    write + attention, SiLU and the residual adds, with no Python between the layers. For bf16
    Llama-family weights without biases and fp32 activations; see :meth:`supports`.

    Args:
        layers: the runtime's layer weights (``LayerWeights``), in order.
        n_heads, n_kv_heads, head_dim, eps: the model's.
    """

    def __init__(self, layers: list, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
        self.layers = layers
        self.H, self.G, self.D, self.eps = n_heads, n_kv_heads, head_dim, eps
        self._weights = [w for lw in layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
        self._ptrs = None  # (weight versions, keep-alive tensors, pointer arrays)

    @staticmethod
    def supports(T: int, rows: int, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
        """Whether :meth:`__call__` takes a step of T new tokens over ``rows = B T`` rows (given
        layers that :meth:`supports_layers`)."""
        return USE_PACKED and rows <= PACKED_MAX_ROWS and attention_supports(T, n_heads, n_kv_heads, head_dim)

    @staticmethod
    def supports_layers(layers: list) -> bool:
        """Whether these layer weights can run here: bf16 matmul weights with widths the packed
        kernel takes, fp32 norms, no biases, no int8, and the kernels built."""
        if not available():
            return False
        for lw in layers:
            if lw.bqkv is not None or lw.q_qkv is not None or lw.attn_norm.dtype != torch.float32:
                return False
            for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down):
                if w.dtype != torch.bfloat16 or w.shape[0] % 16 or w.shape[1] % 8 or not w.is_contiguous():
                    return False
        return True

    def _pointers(self):
        versions = [w._version for w in self._weights]
        if self._ptrs is None or self._ptrs[0] != versions:
            keep, arrays = [], []
            for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
                ts = [getattr(lw, name) for lw in self.layers]
                ts = [t.contiguous() if name.endswith("norm") else packed(t) for t in ts]
                keep.append(ts)
                arrays.append((ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts]))
            self._ptrs = (versions, keep, arrays, [ctypes.addressof(a) for a in arrays])
        return self._ptrs[3]

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tree: TreeLayout | None = None,
        span: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """``x (B, T, C)`` fp32 (the embeddings) -> the residual stream after the last layer,
        computed in place in ``x`` (made contiguous first); writes each layer's new keys and values
        into its ``(B, G, cap, D)`` caches in ``kv`` (a :class:`~specdraft.models.llama.LlamaKV`; at
        ``tree.slot`` for a token-tree step).

        ``span = (first, stop)`` runs layers ``first .. stop - 1`` only (``x``: layer ``first``'s
        input): consecutive spans give bit for bit what one call over all layers gives, since the
        kernel runs layer after layer the same way, and let a caller read the stream in between."""
        first, stop = (0, len(self.layers)) if span is None else span
        if not 0 <= first < stop <= len(self.layers):
            raise ValueError(f"DecodeLayers: layer span {span} outside 0..{len(self.layers)}")
        B, T, C = x.shape
        F = self.layers[0].w_down.shape[1]
        cap = kv.capacity
        last = int(positions.max()) if tree is None else max(int(positions.max()), int(tree.slot.max()))
        if last >= cap or cos.shape[0] <= last:
            raise ValueError(
                f"DecodeLayers: position {last} beyond the cache ({cap}) or the RoPE tables ({cos.shape[0]})"
            )
        if C % 8 or F % 8:
            raise ValueError("DecodeLayers: widths must be multiples of 8")
        if kv.batch_size != B or len(kv.k) != len(self.layers):
            raise ValueError(
                f"DecodeLayers: a cache of {kv.batch_size} rows and {len(kv.k)} layers for {B} rows"
            )
        kc, vc = kv.pointers()  # checked and made once per set of cache tensors
        if x.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError("DecodeLayers: activations and RoPE tables must be float32")
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        pos = positions.to(torch.int64).contiguous()
        _call(
            "specdraft::decode_layers",
            _lib.decode_layers if tree is None else _lib.decode_layers_tree,
            x.data_ptr(),
            pos.data_ptr(),
            *(() if tree is None else tree.pointers()),
            B,
            T,
            C,
            self.H,
            self.G,
            self.D,
            F,
            cap,
            self.eps,
            stop - first,
            *[
                a + first * ctypes.sizeof(ctypes.c_void_p) for a in self._pointers()
            ],  # arrays from layer first
            ctypes.addressof(kc) + first * ctypes.sizeof(ctypes.c_void_p),
            ctypes.addressof(vc) + first * ctypes.sizeof(ctypes.c_void_p),
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )
        return x
