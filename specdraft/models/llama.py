"""A compact Llama-family forward (SmolLM2, Llama 1/2/3, Mistral, Qwen2-style q/k/v biases).

Weights are taken from a transformers model once (q/k/v and gate/up fused into one matmul each),
and a :class:`LlamaRuntime` runs any subset of the layers over a preallocated, position-indexed
KV cache. Keeping a subset of layers is how the layer-pruned "shallow and wide" self-draft is
built: it shares every tensor with the target and owns only its cache.

Shapes: B batch rows, T new tokens, S cache slots, C hidden size, H query heads, G key/value
heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import copy
import ctypes
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from specdraft import kernels
from specdraft.errors import SpecdraftError
from specdraft.models.runtime import ForwardOutput

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


@dataclass
class LayerWeights:
    """One decoder layer, fused for fewer, larger matmuls."""

    attn_norm: torch.Tensor  # (C,)
    wqkv: torch.Tensor  # ((H + 2G) * D, C)
    bqkv: torch.Tensor | None  # ((H + 2G) * D,) Qwen2 only
    wo: torch.Tensor  # (C, H * D)
    mlp_norm: torch.Tensor  # (C,)
    w_gate_up: torch.Tensor  # (2 * I, C)
    w_down: torch.Tensor  # (C, I)
    # int8 runtime only: fbgemm-packed weights of the four matmuls (None: dense matmuls)
    q_qkv: object = None
    q_o: object = None
    q_gate_up: object = None
    q_down: object = None


@dataclass
class LlamaWeights:
    """All weights of a Llama-family model plus the few config numbers the forward needs."""

    embed: torch.Tensor  # (V, C)
    layers: list[LayerWeights]
    norm: torch.Tensor  # (C,)
    lm_head: torch.Tensor  # (V, C); shares storage with embed when tied
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    inv_freq: torch.Tensor  # (D/2,) float32, after any RoPE scaling
    rope_scale: float  # the "attention_scaling" factor some RoPE types apply to cos/sin
    max_context: int
    q_head: object = None  # int8 runtime: packed LM head
    # dtype of activations, KV cache and logits; None: the weights' dtype. float32 with bf16
    # weights is "bf16 weights, fp32 arithmetic" (see :func:`bf16_compute_dtype`).
    compute: torch.dtype | None = None

    @classmethod
    def from_hf(
        cls, model, dtype: torch.dtype = torch.bfloat16, compute: torch.dtype | None = None
    ) -> LlamaWeights:
        """Extract (and fuse) the weights of a transformers Llama-family causal LM.

        Args:
            model: a transformers Llama/Mistral/Qwen2 causal LM.
            dtype: ``torch.bfloat16`` or ``torch.float32`` for dense weights, or ``torch.qint8``
                for the int8 runtime (see :func:`int8_linear`): activations stay float32.
            compute: dtype of the activations; default: :func:`bf16_compute_dtype` for bf16
                weights, the weights' dtype otherwise.
        """
        if dtype == torch.qint8:
            return cls.from_hf(model, torch.float32).quantize_int8()
        if compute is None:
            compute = bf16_compute_dtype() if dtype == torch.bfloat16 else dtype
        cfg = model.config
        if cfg.model_type not in LLAMA_FAMILY:
            raise SpecdraftError(
                f"compact runtime supports {', '.join(LLAMA_FAMILY)}, not {cfg.model_type!r}; "
                "use the transformers adapter (runtime='hf')"
            )
        inner = model.model

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dtype).contiguous()

        def v(t: torch.Tensor) -> torch.Tensor:  # norm weights and biases: compute dtype
            return t.detach().to(compute).contiguous()

        layers = []
        for layer in inner.layers:
            at, mlp = layer.self_attn, layer.mlp
            bias = None
            if getattr(at.q_proj, "bias", None) is not None:
                bias = v(torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]))
            layers.append(
                LayerWeights(
                    attn_norm=v(layer.input_layernorm.weight),
                    wqkv=w(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])),
                    bqkv=bias,
                    wo=w(at.o_proj.weight),
                    mlp_norm=v(layer.post_attention_layernorm.weight),
                    w_gate_up=w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    w_down=w(mlp.down_proj.weight),
                )
            )
        embed = w(inner.embed_tokens.weight)
        head = model.lm_head.weight
        tied = head.data_ptr() == inner.embed_tokens.weight.data_ptr()
        rotary = inner.rotary_emb
        return cls(
            embed=embed,
            layers=layers,
            norm=v(inner.norm.weight),
            lm_head=embed if tied else w(head),
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            eps=cfg.rms_norm_eps,
            inv_freq=rotary.inv_freq.detach().float().clone(),
            rope_scale=float(getattr(rotary, "attention_scaling", 1.0)),
            max_context=cfg.max_position_embeddings,
            compute=compute if compute != dtype else None,
        )

    def quantize_int8(self) -> LlamaWeights:
        """Pack every matmul (and the LM head) for :func:`int8_linear`; dense copies stay for reference."""
        for layer in self.layers:
            layer.q_qkv, layer.q_o = pack_int8(layer.wqkv), pack_int8(layer.wo)
            layer.q_gate_up, layer.q_down = pack_int8(layer.w_gate_up), pack_int8(layer.w_down)
        self.q_head = pack_int8(self.lm_head)
        return self

    def subset(self, layer_ids: list[int], dtype: torch.dtype) -> LlamaWeights:
        """A model made of ``layer_ids`` (in that order) with this model's embedding, norm and head,
        in ``dtype`` (``torch.qint8``: int8). Shares tensors when the dtype is unchanged."""
        n = len(self.layers)
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad or not layer_ids:
            raise SpecdraftError(f"layer ids {list(layer_ids)} invalid for a {n}-layer model")
        dense = torch.float32 if dtype == torch.qint8 else dtype
        # bf16 weights keep fp32 arithmetic where the CPU has no native bf16
        compute = bf16_compute_dtype() if dense == torch.bfloat16 else dense

        def cast(t, to=dense):
            return t if t is None or t.dtype == to else t.to(to)

        layers = [
            LayerWeights(
                *(
                    cast(getattr(self.layers[i], f), to)
                    for f, to in (
                        ("attn_norm", compute),
                        ("wqkv", dense),
                        ("bqkv", compute),
                        ("wo", dense),
                        ("mlp_norm", compute),
                        ("w_gate_up", dense),
                        ("w_down", dense),
                    )
                )
            )
            for i in layer_ids
        ]
        embed = cast(self.embed)
        head = embed if self.lm_head is self.embed else cast(self.lm_head)
        sub = replace(
            self,
            embed=embed,
            layers=layers,
            norm=cast(self.norm, compute),
            lm_head=head,
            q_head=None,
            compute=compute if compute != dense else None,
        )
        return sub.quantize_int8() if dtype == torch.qint8 else sub

    @property
    def precision(self) -> str:
        if self.q_head is not None:
            return "int8"
        name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(self.dtype, str(self.dtype))
        return name if self.compute is None else f"{name} weights, fp32 compute"

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of activations, KV cache and hidden states."""
        return self.compute or self.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """dtype the weights are stored in."""
        return self.embed.dtype


def bf16_compute_dtype() -> torch.dtype:
    """Arithmetic dtype for bf16 weights: bf16 where the CPU has native bf16 matmul, else float32.

    Without AVX512-BF16/AMX, torch emulates bf16 matmuls; the few-row kernel
    (:mod:`specdraft.kernels`) instead widens bf16 weights to fp32 as it streams them, which
    halves the memory traffic of fp32 weights at fp32 accuracy of the arithmetic (and keeps
    verification bit-identical to single steps). Without that kernel, bf16 stays bf16 throughout.
    """
    return torch.float32 if not kernels.cpu_has_fast_bf16() and kernels.available() else torch.bfloat16


def widened(x):
    """A bf16 tensor or module in the runtime's arithmetic: an fp32 copy where
    :func:`bf16_compute_dtype` is float32 (bf16 widens exactly), else ``x`` itself. For torch code
    outside the native kernels (training a draft against the target): torch emulates bf16 products
    there, several times slower (on an AMD EPYC, Zen 3, 1 thread: DREAM's frozen-target pass over
    8 x 300 tokens 78 s in bf16 against 12 s in fp32, a session measurement)."""
    if x.dtype != torch.bfloat16 or bf16_compute_dtype() != torch.float32:
        return x
    return x.float() if isinstance(x, torch.Tensor) else copy.deepcopy(x).float()


class LlamaKV:
    """Preallocated per-layer key/value cache, ``(B, G, S, D)`` per layer and kind.

    Nothing here tracks lengths: the loop decides which positions are valid, and the forward's
    causal rule (a query at position p sees slots 0..p) ignores anything stale beyond. ``k`` and ``v``
    are replaced as whole lists (rows selected or appended, capacity grown), never item by item from
    outside: :meth:`pointers` is made again only then.
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int, dtype):
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]

    @property
    def k(self) -> list[torch.Tensor]:
        return self._k

    @k.setter
    def k(self, caches: list[torch.Tensor]) -> None:
        self._k, self._pointers = caches, None

    @property
    def v(self) -> list[torch.Tensor]:
        return self._v

    @v.setter
    def v(self, caches: list[torch.Tensor]) -> None:
        self._v, self._pointers = caches, None

    def pointers(self) -> tuple[ctypes.Array, ctypes.Array]:
        """The layers' key and value cache addresses as two ctypes arrays, for the native kernels;
        made once per set of cache tensors (reading every layer's addresses again at each step cost
        time right after a forward: results/feature-draft-cost-2026-12-05/).

        Raises:
            ValueError: a cache tensor not contiguous float32 (float16: the quantized runtime's,
                whose kernels read fp16 caches), or of mixed dtypes.
        """
        if self._pointers is None:
            caches = (*self._k, *self._v)
            dtypes = {t.dtype for t in caches}
            if (
                len(dtypes) > 1
                or not dtypes <= {torch.float32, torch.float16}
                or not all(t.is_contiguous() for t in caches)
            ):
                raise ValueError("native kernels: caches must be contiguous float32 (or all float16)")
            n = len(self._k)
            arrays = [(ctypes.c_void_p * n)(*[t.data_ptr() for t in ts]) for ts in (self._k, self._v)]
            self._pointers = (arrays[0], arrays[1])
        return self._pointers

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def ensure_capacity(self, capacity: int) -> None:
        """Grow the slot dimension (a copy; happens rarely, e.g. when a long request joins)."""
        if capacity <= self.capacity:
            return
        for cache in (self.k, self.v):
            for i, t in enumerate(cache):
                grown = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
                grown[:, :, : t.shape[2]] = t
                cache[i] = grown
        self._pointers = None

    def move_slots(self, row: int, src: torch.Tensor, dst: int) -> None:
        """Copy row ``row``'s entries at slots ``src (n,)`` to slots ``dst .. dst + n - 1``, every layer.

        After a token-tree step (:mod:`specdraft.tree`) the accepted nodes' keys/values sit at their
        node slots; moving them to the slots of their positions gives the cache a chain step would
        have left (no re-forward). ``src`` may overlap the destination (the entries are read first).
        """
        dst_slots = torch.arange(dst, dst + src.shape[0])
        for cache in (self.k, self.v):
            for t in cache:
                t[row, :, dst_slots] = t[row, :, src]  # (G, n, D); advanced indexing reads a copy

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (in that order): how finished requests leave a batch."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]

    def append(self, other: LlamaKV) -> None:
        """Append another state's rows: how new requests join a batch after their prefill."""
        cap = max(self.capacity, other.capacity)
        self.ensure_capacity(cap)
        other.ensure_capacity(cap)
        self.k = [torch.cat([a, b]) for a, b in zip(self.k, other.k)]
        self.v = [torch.cat([a, b]) for a, b in zip(self.v, other.v)]


def by_rows(fn, x: torch.Tensor, n: int = kernels.MAX_ROWS) -> torch.Tensor | None:
    """``fn(x)`` computed ``n`` rows of ``x (..., K)`` at a time, or None where ``fn`` declines.

    The native kernels compute each row on its own, so chunking rows changes no bit of the result;
    this is how a scoring step (see :meth:`LlamaRuntime.forward`) stays on them beyond their row
    limit instead of switching to torch's ops, whose results depend on the row count.
    """
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if x2.shape[0] <= n:
        return fn(x)
    parts = [fn(x2[i : i + n]) for i in range(0, x2.shape[0], n)]
    if parts[0] is None:
        return None
    return torch.cat(parts).view(*x.shape[:-1], parts[0].shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, exact: bool = False) -> torch.Tensor:
    """RMSNorm as transformers' Llama computes it: statistics in float32, weight in model dtype.

    ``exact``: any number of fp32 rows through the kernel (:func:`by_rows`), each row bit-identical
    to a one-row call; otherwise the kernel takes decode-sized inputs and torch the rest.
    """
    if x.dtype == torch.float32:
        y = kernels.rms_norm(x, weight, eps)  # decode-sized inputs
        if y is None and exact:  # more rows than the kernel's limit
            y = by_rows(lambda part: kernels.rms_norm(part, weight, eps), x)
        return F.rms_norm(x, weight.shape, weight, eps) if y is None else y
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def pack_int8(w: torch.Tensor):
    """Per-output-channel symmetric int8 weights, prepacked for fbgemm."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.int64)
    return torch.ops.quantized.linear_prepack(
        torch.quantize_per_channel(w, scale, zero, 0, torch.qint8), None
    )


_BUFFERS: dict[tuple[int, int], torch.Tensor] = {}


def int8_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` with int8 weights and per-row int8 activations (fbgemm), batch-invariant.

    fbgemm's dynamic linear quantizes activations with ONE scale for the whole input, so a row's
    result would depend on the other rows (and a (k+1)-token verification would disagree with a
    1-token forward). Each row is therefore scaled to max |x| = 1 first, and a calibration row
    ``[-1, 1, 0, ...]`` pins the tensor's range to exactly [-1, 1]: the quantization parameters no
    longer depend on the batch, the integer matmul is exact, and every row's output is
    bit-identical whatever else is in the batch. Per-row scaling is also more accurate.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # (M, K)
    M, K = x2.shape
    buf = _BUFFERS.get((M, K))
    if buf is None:  # rows 0..M-1: the scaled input; row M: the calibration row
        buf = torch.zeros(M + 1, K)
        buf[M, 0], buf[M, 1] = -1.0, 1.0
        _BUFFERS[(M, K)] = buf
    s = torch.linalg.vector_norm(x2, float("inf"), dim=-1, keepdim=True).clamp_(min=1e-12)  # (M, 1)
    torch.div(x2, s, out=buf[:M])
    out = torch.ops.quantized.linear_dynamic(buf, packed, True)[:M].mul_(s)  # (M, N)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.shape[-1])


# id(weight) -> (weight's version, weight transposed to (in, out)); dropped when the weight dies
_TRANSPOSED: dict[int, tuple[int, torch.Tensor]] = {}


def transposed(w: torch.Tensor) -> torch.Tensor:
    """``w.t().contiguous()``, cached per weight tensor (rebuilt if ``w`` was changed in place)."""
    hit = _TRANSPOSED.get(id(w))
    if hit is None:
        weakref.finalize(w, _TRANSPOSED.pop, id(w), None)
    if hit is None or hit[0] != w._version:
        hit = _TRANSPOSED[id(w)] = (w._version, w.t().contiguous())
    return hit[1]


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed, exact: bool = False
) -> torch.Tensor:
    """``x @ w.T + b`` for fp32 activations, the matmul chosen by weight dtype and row count M.

    - int8 weights (``packed``, drafts only): :func:`int8_linear`.
    - decode and verification steps with the native kernel built (:func:`specdraft.kernels.supports`:
      M <= ``MAX_ROWS`` with fp32 weights, row by row; M <= ``PACKED_MAX_ROWS`` with bf16 weights,
      through a packed copy): :func:`specdraft.kernels.fewrows_matmul`, each row's result
      independent of the other rows.
    - ``exact`` (a scoring step, see :meth:`LlamaRuntime.forward`) with more rows than that: the
      same kernel, ``MAX_ROWS`` rows at a time (:func:`by_rows`), so every row stays bit-identical
      to a one-row product.
    - bf16 weights otherwise (long prefills): widened to fp32 for ``F.linear``.
    - fp32 weights without the kernel: ``x @ W^T`` on an ``(in, out)`` copy for M <= 3
      (:func:`transposed`), ``(W @ x^T)^T`` for M = 4, 5, ``F.linear`` beyond; with them a whole
      1- to 4-token forward was 1.34-2.22x faster than with ``F.linear`` alone on this project's AVX2
      CPU (``results/engine-native/bench_linear.log``, ``benchmarks/bench_linear.py``).
    """
    if packed is not None:
        return int8_linear(x, packed, b)
    if kernels.supports(x, w):
        y = kernels.fewrows_matmul(x, w)
        return y if b is None else y + b
    if exact and kernels.supports(x.reshape(-1, x.shape[-1])[: kernels.MAX_ROWS], w):
        y = by_rows(lambda part: kernels.fewrows_matmul(part, w), x)
        return y if b is None else y + b
    if w.dtype != x.dtype:  # bf16 weights, fp32 activations, many rows (prefill)
        return F.linear(x, w.to(x.dtype), b)
    M = x.numel() // x.shape[-1]
    if x.dtype != torch.float32 or M > 5:
        return F.linear(x, w, b)
    if M <= 3:
        y = x @ transposed(w)
    else:
        y = (w @ x.reshape(M, -1).t()).t().reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


def rope_tables(
    inv_freq: torch.Tensor, scale: float, n: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, D)`` half-split cos and sin tables for positions ``0..n-1`` (as transformers' Llama
    builds them), times the RoPE type's attention scaling ``scale``."""
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # (n, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (n, D)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaRuntime:
    """A Llama-family model (or a subset of its layers) over :class:`LlamaKV`.

    Args:
        weights: extracted weights, shared between runtimes built from the same target.
        layer_ids: which decoder layers to run, in order; ``None`` keeps all (the target).
            A subset gives the untrained layer-pruned self-draft.
    """

    def __init__(self, weights: LlamaWeights, layer_ids: list[int] | None = None):
        n = len(weights.layers)
        self.layer_ids = list(range(n)) if layer_ids is None else list(layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < n]
        if bad or not self.layer_ids:
            raise SpecdraftError(f"layer ids {self.layer_ids} invalid for a {n}-layer model")
        self.w = weights
        self.layers = [weights.layers[i] for i in self.layer_ids]
        self.vocab_size = weights.vocab_size
        self.max_context = weights.max_context
        self.dtype = weights.compute_dtype  # activations, KV cache, hidden states
        self._rope_len = 0
        self._cos = self._sin = None
        self._decode_layers = None  # kernels.DecodeLayers, or False where the layers cannot run natively
        matmuls = (w for lw in self.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
        kernels.prepack(*matmuls, weights.lm_head)

    def __repr__(self) -> str:
        return f"LlamaRuntime(layers={len(self.layers)}/{len(self.w.layers)}, {self.w.precision})"

    def new_state(self, batch_size: int, capacity: int) -> LlamaKV:
        w = self.w
        return LlamaKV(len(self.layers), batch_size, w.n_kv_heads, capacity, w.head_dim, self.dtype)

    def _rope_tables(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n, D)`` cos and sin tables (RoPE scaling applied) covering positions below ``need``."""
        if need > self._rope_len:
            n = max(need, 2 * self._rope_len, 1024)
            self._cos, self._sin = rope_tables(self.w.inv_freq, self.w.rope_scale, n, self.dtype)
            self._rope_len = n
        return self._cos, self._sin

    def _native_layers(self, T: int, rows: int) -> bool:
        """Whether this step's layers run in one native call (:class:`specdraft.kernels.DecodeLayers`)."""
        w = self.w
        if self._decode_layers is None:  # decided once: the layers' dtypes and shapes do not change
            ok = kernels.DecodeLayers.supports_layers(self.layers)
            self._decode_layers = (
                kernels.DecodeLayers(self.layers, w.n_heads, w.n_kv_heads, w.head_dim, w.eps) if ok else False
            )
        return (
            bool(self._decode_layers)
            and kernels.USE_NATIVE_LAYERS
            and kernels.DecodeLayers.supports(T, rows, w.n_heads, w.n_kv_heads, w.head_dim)
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._rope_tables(int(positions.max()) + 1)
        # (B, 1, T, D): broadcast over heads
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @torch.inference_mode()
    def forward(
        self,
        state: LlamaKV,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        hidden_layers: tuple[int, ...] = (),
        attn_mask: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run the layers over new tokens (see :class:`specdraft.models.runtime.Runtime`).

        ``slots`` (``(B, T)``, with ``attn_mask``): the cache slots of the new tokens where they
        differ from their RoPE positions, as in a token tree (:mod:`specdraft.tree`: siblings share
        a position, each node has its own slot); default: the positions.

        A *scoring step* (causal, no ``logits_index``: a decode step, or a verification of draft
        tokens) in fp32 gives each row and token bit for bit what that row alone gets one token at
        a time, whatever B and T: it runs on the native kernels, which compute every row and query
        the same way at any size, beyond the size limits that otherwise send many rows or tokens to
        torch's ops (where torch is faster but its results depend on the row count). A token-tree
        step (``attn_mask`` and ``slots`` of :meth:`specdraft.tree.TokenTree.step_mask` form,
        :func:`specdraft.kernels.tree_layout`) is a scoring step too: each node's row is bit for bit
        the one a chain step over its path gives. A forward with ``logits_index`` (a prefill) or
        another ``attn_mask`` keeps the size-based choice.

        Three paths (:meth:`_path`): ``"native"`` runs every layer in one native call
        (:class:`specdraft.kernels.DecodeLayers`); ``"fused"`` runs the layers here with each
        attention block in one native call (:class:`specdraft.kernels.RopeAttention`); ``"torch"``
        runs them with torch's attention (:class:`TorchAttention`).
        """
        last = int(positions.max())
        if slots is not None and attn_mask is None:
            raise SpecdraftError("slots apart from positions need an attention mask over the slots")
        top = last if slots is None else max(last, int(slots.max()))
        if top >= state.capacity:
            raise SpecdraftError(f"position {top} beyond cache capacity {state.capacity}")
        if any(not -1 <= i < len(self.layers) for i in hidden_layers):
            raise SpecdraftError(f"hidden layers {hidden_layers}: -1 or 0..{len(self.layers) - 1}")
        tree = self._tree_layout(attn_mask, positions, slots, logits_index)
        mask = None if tree is not None else attn_mask  # a tree the kernels take is a scoring step
        exact = mask is None and logits_index is None and self.dtype == torch.float32
        path = self._path(tokens.shape, mask, exact)
        x = self._embed(tokens)  # (B, T, C)
        hidden: dict[int, torch.Tensor] = {}
        if path == "native":  # no per-op overhead between the layers
            x = self._native_run(x, positions, state, last, tree, set(hidden_layers), hidden)
        else:
            native_tree = {"tree": tree} if tree is not None and path == "fused" else {}
            attend = self._attention(path, positions, attn_mask, slots, **native_tree)
            x = self._run_layers(x, state, attend, exact, set(hidden_layers), hidden)
        return self._head(x, exact, hidden_layers, hidden, logits_index)

    def _native_run(self, x, positions, state: LlamaKV, last: int, tree, wanted: set[int], hidden: dict):
        """The layers over ``x (B, T, C)`` in native calls, one per span up to each ``wanted``
        layer (then a copy of the stream into ``hidden``) and one for the rest: bit for bit the
        one call over all layers (:class:`specdraft.kernels.DecodeLayers` ``span``)."""
        cos, sin = self._rope_tables(last + 1)
        n = len(self.layers)
        first = 0
        for li in sorted({i for i in wanted if i >= 0} | {n - 1}):
            x = self._decode_layers(x, positions, state, cos, sin, tree, span=(first, li + 1))
            first = li + 1
            if li in wanted:
                hidden[li] = x.clone()  # the next span updates x in place
        return x

    def _tree_layout(
        self,
        attn_mask: torch.Tensor | None,
        positions: torch.Tensor,
        slots: torch.Tensor | None,
        logits_index: torch.Tensor | None,
    ) -> kernels.TreeLayout | None:
        """The native kernels' layout of a token-tree step (fp32, kernels built, a mask of the
        tree form), else None."""
        if attn_mask is None or slots is None or logits_index is not None or self.dtype != torch.float32:
            return None
        if not kernels.available():
            return None
        return kernels.tree_layout(attn_mask, positions, slots)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, C)`` input embeddings in the compute dtype."""
        return self.w.embed[tokens].to(self.dtype)

    def _path(self, shape: torch.Size, attn_mask: torch.Tensor | None, exact: bool) -> str:
        """``"native"``, ``"fused"`` or ``"torch"``: which path :meth:`forward` takes for a step of
        ``shape = (B, T)`` tokens."""
        w = self.w
        B, T = shape
        Tk = 1 if exact else T  # the kernels' size limits apply to other steps only
        # Decode-sized causal steps: RoPE, cache write and attention in one native call;
        # prefill, custom masks and bf16 compute take torch's ops.
        fused = (
            attn_mask is None
            and self.dtype == torch.float32
            and kernels.attention_supports(Tk, w.n_heads, w.n_kv_heads, w.head_dim)
        )
        if not fused:
            return "torch"
        # ... and, where the layers allow it, all of them in native calls (one, or one per span
        # up to each hidden layer asked for: :meth:`_native_run`)
        native = self._native_layers(Tk, 1 if exact else B * T)
        return "native" if native else "fused"

    def _attention(
        self,
        path: str,
        positions: torch.Tensor,
        attn_mask: torch.Tensor | None,
        slots: torch.Tensor | None,
        tree: kernels.TreeLayout | None = None,
    ):
        """This step's attention block, called per layer as ``attend(qkv, k_cache, v_cache)``
        (``tree``: the fused path's token-tree layout)."""
        w = self.w
        if path == "fused":
            cos, sin = self._rope_tables(int(positions.max()) + 1)
            return kernels.RopeAttention(positions, cos, sin, w.n_heads, w.n_kv_heads, tree=tree)
        return TorchAttention(positions, *self._rope(positions), w.n_heads, w.n_kv_heads, attn_mask, slots)

    def _run_layers(
        self, x: torch.Tensor, state: LlamaKV, attend, exact: bool, wanted: set[int], hidden: dict
    ) -> torch.Tensor:
        """The decoder layers over ``x (B, T, C)``, layer by layer; the hidden states of the
        ``wanted`` layers go into ``hidden``."""
        w = self.w
        for li, (layer, k_cache, v_cache) in enumerate(zip(self.layers, state.k, state.v)):
            h = rms_norm(x, layer.attn_norm, w.eps, exact)
            qkv = linear(h, layer.wqkv, layer.bqkv, layer.q_qkv, exact)  # (B, T, (H + 2G) * D)
            att = attend(qkv, k_cache, v_cache)  # (B, T, H * D)
            x = x + linear(att, layer.wo, None, layer.q_o, exact)
            h = rms_norm(x, layer.mlp_norm, w.eps, exact)
            gate, up = linear(h, layer.w_gate_up, None, layer.q_gate_up, exact).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.w_down, None, layer.q_down, exact)
            if li in wanted:
                hidden[li] = x
        return x

    def _head(
        self,
        x: torch.Tensor,
        exact: bool,
        hidden_layers: tuple[int, ...],
        hidden: dict,
        logits_index: torch.Tensor | None,
    ) -> ForwardOutput:
        """Final norm and LM head over ``x (B, T, C)`` (at ``logits_index`` only, when given)."""
        w = self.w
        x = rms_norm(x, w.norm, w.eps, exact)
        if -1 in hidden_layers:
            hidden[-1] = x
        if logits_index is not None:
            x = x.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        logits = linear(x, w.lm_head, None, w.q_head, exact).float()  # (B, T, V)
        return ForwardOutput(logits=logits, hidden=hidden)


class TorchAttention:
    """RoPE, the KV-cache write and attention of one step in torch's ops: the path of prefills,
    custom masks, bf16 compute and steps beyond the native kernels' limits. Made once per forward,
    then called per layer, as :class:`specdraft.kernels.RopeAttention`.

    Args:
        positions: ``(B, T)`` each new token's position, which is also its cache slot (unless ``slots``).
        cos, sin: ``(B, 1, T, D)`` RoPE tables at those positions.
        n_heads, n_kv_heads: H query heads sharing G key/value heads.
        attn_mask: ``(B, T, S)`` boolean mask over cache slots; None: causal (a query at
            position p sees slots 0..p).
        slots: ``(B, T)`` cache slots of the new tokens (with ``attn_mask``); None: the positions.
        window: W > 0: a query at position p sees only slots above p - W (sliding-window layers,
            as transformers' Gemma 3); with ``attn_mask`` the rule applies to slot numbers, which
            is the same as long as a token tree is shallower than W.
        scale: the scores' scale; None: 1 / sqrt(D).
    """

    def __init__(
        self,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        n_heads: int,
        n_kv_heads: int,
        attn_mask: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        window: int = 0,
        scale: float | None = None,
    ):
        B, T = positions.shape
        slots = positions if slots is None else slots
        self.B, self.T, self.H, self.G = B, T, n_heads, n_kv_heads
        self.cos, self.sin, self.scale = cos, sin, scale
        # Where do the new keys go? One contiguous run shared by all rows (batch 1, or equal
        # lengths) is a slice write; ragged rows scatter by position.
        self.start = int(slots[0, 0])
        self.contiguous = bool((slots == self.start + torch.arange(T)).all())
        self.S = int(positions.max()) + 1 if attn_mask is None else attn_mask.shape[-1]
        if attn_mask is not None:
            self.mask = attn_mask.unsqueeze(1)  # (B, 1, T, S)
        elif self.contiguous and T == 1 and not 0 < window < self.S:
            self.mask = None  # the single query sees every slot 0..S-1
        else:
            self.mask = (torch.arange(self.S) <= positions.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, S)
        if 0 < window < self.S:
            self.mask = self.mask & (torch.arange(self.S) > positions.unsqueeze(-1) - window).unsqueeze(1)
        if not self.contiguous:  # (rows, heads, slots) indices of the new keys
            # index shapes (B, 1, 1), (1, G, 1), (B, 1, T)
            self.index = (
                torch.arange(B).view(B, 1, 1),
                torch.arange(n_kv_heads).view(1, -1, 1),
                slots.unsqueeze(1),
            )

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``qkv (B, T, (H + 2G) D)`` -> ``(B, T, H D)``; writes the new keys (rotated) and values
        into the ``(B, G, cap, D)`` caches at the positions."""
        B, T, H, G, S = self.B, self.T, self.H, self.G, self.S
        D = k_cache.shape[-1]
        qk, v = qkv.view(B, T, H + 2 * G, D).transpose(1, 2).split((H + G, G), dim=1)
        qk = qk * self.cos + rotate_half(qk) * self.sin  # (B, H + G, T, D): RoPE on queries and keys at once
        q, k = qk.split((H, G), dim=1)
        if self.contiguous:
            k_cache[:, :, self.start : self.start + T] = k
            v_cache[:, :, self.start : self.start + T] = v
        else:
            k_cache.index_put_(self.index, k)
            v_cache.index_put_(self.index, v)
        # att: (B, H, T, D)
        att = F.scaled_dot_product_attention(
            q, k_cache[:, :, :S], v_cache[:, :, :S], attn_mask=self.mask, enable_gqa=G != H, scale=self.scale
        )
        return att.transpose(1, 2).reshape(B, T, H * D)
