"""Gemma 3 (text) on the compact runtime: the Llama runtime's cache, kernels and attention paths
with Gemma 3's layer.

What differs from Llama (transformers' ``modeling_gemma3.py``), and where it is handled here:

* input embeddings times ``sqrt(C)`` (:meth:`Gemma3Runtime._embed`);
* RMSNorm scales by ``1 + weight``: the weights are stored as ``1 + weight``, so the Llama norm
  (and its kernel) computes it (:meth:`Gemma3Weights.from_hf`);
* four norms per layer: before and after attention, before and after the MLP, and RMSNorm over
  each query and key head (QK-norm) before RoPE (:meth:`Gemma3Runtime._run_layers`);
* a GeGLU MLP (tanh-approximated GELU);
* sliding-window layers (a query at position p sees positions above p - W) with their own RoPE
  base, and global layers (every 6th in the released models) with the global base and scaling:
  two RoPE tables and two attention blocks per step (:meth:`Gemma3Runtime._attention`), the
  window applied by the native attention kernel (``rope_attend_window``) or torch's mask;
* scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``D ** -0.5``;
* the LM head tied to the (262k-token) embedding, and final logit soft-capping where the config
  has it. Attention soft-capping (Gemma 2) is refused: no Gemma 3 config sets it.

Decode and verification steps keep the Llama runtime's guarantee: every row and token is computed
by the same float operations whatever B and T, so a (k+1)-token verification equals k+1 one-token
steps bit for bit. Gemma's layers run layer by layer (``"fused"`` path: the attention block in one
native call per layer); the all-layers native call (:class:`specdraft.kernels.DecodeLayers`) is
the Llama layer's.

Shapes: B batch rows, T new tokens, C hidden size, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specdraft import kernels
from specdraft.errors import SpecdraftError
from specdraft.models.llama import (
    LayerWeights,
    LlamaKV,
    LlamaRuntime,
    LlamaWeights,
    TorchAttention,
    bf16_compute_dtype,
    linear,
    rms_norm,
    rope_tables,
)

GEMMA3_FAMILY = ("gemma3_text",)


@dataclass
class GemmaLayerWeights(LayerWeights):
    """One Gemma 3 decoder layer: the Llama layer's fields (``attn_norm`` is the input norm,
    ``mlp_norm`` the pre-feed-forward norm, ``w_gate_up`` the GeGLU's gate and up) plus these.
    Every norm weight is stored as ``1 + weight``."""

    q_norm: torch.Tensor | None = None  # (D,) shared by the query heads
    k_norm: torch.Tensor | None = None  # (D,) shared by the key heads
    post_attn_norm: torch.Tensor | None = None  # (C,)
    post_mlp_norm: torch.Tensor | None = None  # (C,)
    sliding: bool = False  # a sliding-window (local) layer


@dataclass
class Gemma3Weights(LlamaWeights):
    """A Gemma 3 text model: :class:`LlamaWeights` (``inv_freq`` and ``rope_scale`` are the global
    layers') plus the local layers' RoPE, the window and the scales."""

    local_inv_freq: torch.Tensor | None = None  # (D/2,) float32, sliding-window layers
    local_rope_scale: float = 1.0
    window: int = 0  # W: a local layer's query at position p sees positions p - W + 1..p
    embed_scale: float = 1.0  # sqrt(C)
    attn_scale: float | None = None  # query_pre_attn_scalar ** -0.5
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

    @classmethod
    def from_hf(
        cls, model, dtype: torch.dtype = torch.bfloat16, compute: torch.dtype | None = None
    ) -> Gemma3Weights:
        """Extract (and fuse) the weights of a transformers ``Gemma3ForCausalLM``.

        Args:
            model: the transformers model (``model_type`` ``gemma3_text``).
            dtype: ``torch.bfloat16`` or ``torch.float32`` matmul weights, or ``torch.qint8``
                (int8 matmuls, for drafts).
            compute: dtype of the activations; default as :meth:`LlamaWeights.from_hf`.
        """
        state = model.state_dict()  # views of the parameters, tied ones under both names
        return cls.from_tensors(model.config, lambda name, dt: state[name].detach().to(dt), dtype, compute)

    @classmethod
    def from_safetensors(
        cls, directory: Path, dtype: torch.dtype = torch.bfloat16, compute: torch.dtype | None = None
    ) -> Gemma3Weights:
        """The weights of a transformers directory (``config.json``, ``model.safetensors``, as
        ``save_pretrained`` and the GGUF conversion cache write them), read tensor by tensor: no
        transformers model, no float32 copy of the whole model (arguments as :meth:`from_hf`).

        Raises:
            SpecdraftError: not a Gemma 3 text model, or a file that cannot be read.
        """
        from safetensors import SafetensorError
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(directory, local_files_only=True)
            return cls.from_tensors(cfg, _SafetensorsReader(directory / "model.safetensors"), dtype, compute)
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            raise SpecdraftError(f"cannot read the Gemma 3 weights in {directory}: {type(e).__name__}: {e}")

    @classmethod
    def from_tensors(
        cls,
        cfg,
        get: Callable[[str, torch.dtype], torch.Tensor],
        dtype: torch.dtype,
        compute: torch.dtype | None,
    ) -> Gemma3Weights:
        """The weights from a transformers Gemma 3 config and ``get(name, dtype)``, which returns
        the tensor of that state-dict name (``model.layers.0.self_attn.q_proj.weight``) in ``dtype``."""
        if dtype == torch.qint8:
            return cls.from_tensors(cfg, get, torch.float32, compute).quantize_int8()
        if compute is None:
            compute = bf16_compute_dtype() if dtype == torch.bfloat16 else dtype
        if cfg.model_type not in GEMMA3_FAMILY:
            raise SpecdraftError(f"not a Gemma 3 text model: {cfg.model_type!r}")
        if cfg.attn_logit_softcapping is not None:
            raise SpecdraftError(
                "attention soft-capping is not supported by the compact runtime: use --runtime hf"
            )
        if getattr(cfg, "attention_bias", False):
            raise SpecdraftError("Gemma 3 with attention biases is not supported by the compact runtime")

        def w(name: str) -> torch.Tensor:
            return get(name, dtype).contiguous()

        def norm(name: str) -> torch.Tensor:  # Gemma's RMSNorm scales by 1 + weight, in float32
            return (1.0 + get(name, torch.float32)).to(compute).contiguous()

        layers = [_layer(f"model.layers.{i}.", kind, w, norm) for i, kind in enumerate(cfg.layer_types)]
        embed = w("model.embed_tokens.weight")
        rotary = _rotary(cfg)
        return cls(
            embed=embed,
            layers=layers,
            norm=norm("model.norm.weight"),
            lm_head=embed if cfg.tie_word_embeddings else w("lm_head.weight"),
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            eps=cfg.rms_norm_eps,
            inv_freq=rotary.full_attention_inv_freq.float().clone(),
            rope_scale=float(rotary.full_attention_attention_scaling),
            max_context=cfg.max_position_embeddings,
            compute=compute if compute != dtype else None,
            local_inv_freq=rotary.sliding_attention_inv_freq.float().clone(),
            local_rope_scale=float(rotary.sliding_attention_attention_scaling),
            window=int(cfg.sliding_window),
            embed_scale=float(cfg.hidden_size**0.5),  # Gemma3TextModel's embed_scale
            attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            final_softcap=cfg.final_logit_softcapping,
        )

    def subset(self, layer_ids: list[int], dtype: torch.dtype) -> Gemma3Weights:
        """A model made of ``layer_ids`` (in that order) with this model's embedding, norm and head,
        in ``dtype`` (``torch.qint8``: int8 matmuls). Shares tensors when the dtype is unchanged."""
        n = len(self.layers)
        if not layer_ids or any(not 0 <= i < n for i in layer_ids):
            raise SpecdraftError(f"layer ids {list(layer_ids)} invalid for a {n}-layer model")
        dense = torch.float32 if dtype == torch.qint8 else dtype
        compute = bf16_compute_dtype() if dense == torch.bfloat16 else dense

        def cast(t: torch.Tensor, norm: bool) -> torch.Tensor:
            to = compute if norm else dense
            return t if t.dtype == to else t.to(to)

        def cast_layer(layer: GemmaLayerWeights) -> GemmaLayerWeights:
            tensors = {
                f.name: cast(getattr(layer, f.name), f.name.endswith("norm"))
                for f in fields(layer)
                if isinstance(getattr(layer, f.name), torch.Tensor)
            }
            return replace(layer, **tensors, q_qkv=None, q_o=None, q_gate_up=None, q_down=None)

        embed = cast(self.embed, False)
        sub = replace(
            self,
            embed=embed,
            layers=[cast_layer(self.layers[i]) for i in layer_ids],
            norm=cast(self.norm, True),
            lm_head=embed if self.lm_head is self.embed else cast(self.lm_head, False),
            q_head=None,
            compute=compute if compute != dense else None,
        )
        return sub.quantize_int8() if dtype == torch.qint8 else sub


def _layer(prefix: str, kind: str, w, norm) -> GemmaLayerWeights:
    """The decoder layer whose state-dict names start with ``prefix`` (``model.layers.3.``)."""
    at, mlp = prefix + "self_attn.", prefix + "mlp."
    return GemmaLayerWeights(
        attn_norm=norm(prefix + "input_layernorm.weight"),
        wqkv=torch.cat([w(at + f"{x}_proj.weight") for x in "qkv"]),
        bqkv=None,
        wo=w(at + "o_proj.weight"),
        mlp_norm=norm(prefix + "pre_feedforward_layernorm.weight"),
        w_gate_up=torch.cat([w(mlp + "gate_proj.weight"), w(mlp + "up_proj.weight")]),
        w_down=w(mlp + "down_proj.weight"),
        q_norm=norm(at + "q_norm.weight"),
        k_norm=norm(at + "k_norm.weight"),
        post_attn_norm=norm(prefix + "post_attention_layernorm.weight"),
        post_mlp_norm=norm(prefix + "post_feedforward_layernorm.weight"),
        sliding=kind == "sliding_attention",
    )


def _rotary(cfg):
    """transformers' Gemma 3 RoPE module for ``cfg`` with both layer types' ``inv_freq`` and
    scaling (it builds tables only for the kinds ``layer_types`` names, and a pruned draft may keep
    sliding-window layers only)."""
    import copy

    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    both = copy.copy(cfg)
    both.layer_types = ["sliding_attention", "full_attention"]
    return Gemma3RotaryEmbedding(both)


class _SafetensorsReader:
    """``get(name, dtype)`` over a safetensors file, opened per read (and per block of rows of a
    large tensor), so that at most ``ROWS`` rows of the file's float32 pages are mapped at a time:
    the peak memory is the compact weights plus one block."""

    ROWS = 16384

    def __init__(self, path: Path):
        self.path = path

    def open(self):
        from safetensors import safe_open

        return safe_open(self.path, "pt")

    def __call__(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        with self.open() as f:
            shape = f.get_slice(name).get_shape()
        if len(shape) < 2 or shape[0] <= self.ROWS:
            with self.open() as f:
                return f.get_tensor(name).to(dtype)
        out = torch.empty(shape, dtype=dtype)
        for r in range(0, shape[0], self.ROWS):
            with self.open() as f:
                out[r : r + self.ROWS] = f.get_slice(name)[r : r + self.ROWS]
        return out


class Gemma3Runtime(LlamaRuntime):
    """A Gemma 3 text model (or a subset of its layers) over :class:`LlamaKV`; see the module
    docstring for what differs from :class:`LlamaRuntime`."""

    w: Gemma3Weights

    def __init__(self, weights: Gemma3Weights, layer_ids: list[int] | None = None):
        super().__init__(weights, layer_ids)
        self._decode_layers = False  # DecodeLayers runs the Llama layer only
        self._local_len = 0
        self._local = None  # the sliding-window layers' (cos, sin) tables

    def __repr__(self) -> str:
        return f"Gemma3Runtime(layers={len(self.layers)}/{len(self.w.layers)}, {self.w.precision})"

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return super()._embed(tokens) * self.w.embed_scale  # (B, T, C)

    def _local_tables(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding-window layers' ``(n, D)`` cos and sin tables covering positions below ``need``."""
        if need > self._local_len:
            n = max(need, 2 * self._local_len, 1024)
            self._local = rope_tables(self.w.local_inv_freq, self.w.local_rope_scale, n, self.dtype)
            self._local_len = n
        return self._local

    def _attention(
        self,
        path: str,
        positions: torch.Tensor,
        attn_mask: torch.Tensor | None,
        slots: torch.Tensor | None,
        tree: kernels.TreeLayout | None = None,
    ) -> tuple:
        """This step's attention blocks ``(global, local)``, indexed by ``layer.sliding``."""
        w = self.w
        need = int(positions.max()) + 1
        blocks = []
        for (cos, sin), window in ((self._rope_tables(need), 0), (self._local_tables(need), w.window)):
            if path == "fused":
                blocks.append(
                    kernels.RopeAttention(
                        positions, cos, sin, w.n_heads, w.n_kv_heads, window, w.attn_scale, tree=tree
                    )
                )
            else:  # (B, 1, T, D) tables: broadcast over heads
                cos_p, sin_p = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
                blocks.append(
                    TorchAttention(
                        positions,
                        cos_p,
                        sin_p,
                        w.n_heads,
                        w.n_kv_heads,
                        attn_mask,
                        slots,
                        window,
                        w.attn_scale,
                    )
                )
        return tuple(blocks)

    def _qk_norm(self, qkv: torch.Tensor, layer: GemmaLayerWeights, exact: bool) -> torch.Tensor:
        """RMSNorm over each query and key head of ``qkv (B, T, (H + 2G) D)``; values unchanged."""
        w = self.w
        B, T, _ = qkv.shape
        H, G = w.n_heads, w.n_kv_heads
        q, k, v = qkv.view(B, T, H + 2 * G, w.head_dim).split((H, G, G), dim=2)
        q = rms_norm(q, layer.q_norm, w.eps, exact)  # (B, T, H, D)
        k = rms_norm(k, layer.k_norm, w.eps, exact)  # (B, T, G, D)
        return torch.cat((q, k, v), dim=2).view(B, T, -1)

    def _run_layers(
        self, x: torch.Tensor, state: LlamaKV, attend: tuple, exact: bool, wanted: set[int], hidden: dict
    ) -> torch.Tensor:
        """Gemma 3's decoder layers over ``x (B, T, C)``; ``attend``: ``(global, local)`` blocks."""
        eps = self.w.eps
        for li, (layer, k_cache, v_cache) in enumerate(zip(self.layers, state.k, state.v)):
            h = rms_norm(x, layer.attn_norm, eps, exact)
            qkv = self._qk_norm(linear(h, layer.wqkv, None, layer.q_qkv, exact), layer, exact)
            att = attend[layer.sliding](qkv, k_cache, v_cache)  # (B, T, H * D)
            x = x + rms_norm(linear(att, layer.wo, None, layer.q_o, exact), layer.post_attn_norm, eps, exact)
            h = rms_norm(x, layer.mlp_norm, eps, exact)
            gate, up = linear(h, layer.w_gate_up, None, layer.q_gate_up, exact).chunk(2, dim=-1)
            h = linear(F.gelu(gate, approximate="tanh") * up, layer.w_down, None, layer.q_down, exact)
            x = x + rms_norm(h, layer.post_mlp_norm, eps, exact)
            if li in wanted:
                hidden[li] = x
        return x

    def _head(self, x, exact, hidden_layers, hidden, logits_index):
        out = super()._head(x, exact, hidden_layers, hidden, logits_index)
        cap = self.w.final_softcap
        if cap:
            out.logits = torch.tanh(out.logits / cap) * cap
        return out
