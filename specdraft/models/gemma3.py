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

from dataclasses import dataclass, fields, replace

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
        if dtype == torch.qint8:
            return cls.from_hf(model, torch.float32).quantize_int8()
        if compute is None:
            compute = bf16_compute_dtype() if dtype == torch.bfloat16 else dtype
        cfg = model.config
        if cfg.model_type not in GEMMA3_FAMILY:
            raise SpecdraftError(f"not a Gemma 3 text model: {cfg.model_type!r}")
        if cfg.attn_logit_softcapping is not None:
            raise SpecdraftError(
                "attention soft-capping is not supported by the compact runtime: use --runtime hf"
            )
        inner = model.model

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dtype).contiguous()

        def norm(module) -> torch.Tensor:  # Gemma's RMSNorm scales by 1 + weight, in float32
            return (1.0 + module.weight.detach().float()).to(compute).contiguous()

        layers = [_layer(layer, kind, w, norm) for layer, kind in zip(inner.layers, cfg.layer_types)]
        embed = w(inner.embed_tokens.weight)
        head = model.lm_head.weight
        tied = head.data_ptr() == inner.embed_tokens.weight.data_ptr()
        rotary = inner.rotary_emb
        return cls(
            embed=embed,
            layers=layers,
            norm=norm(inner.norm),
            lm_head=embed if tied else w(head),
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            eps=cfg.rms_norm_eps,
            inv_freq=rotary.full_attention_inv_freq.detach().float().clone(),
            rope_scale=float(rotary.full_attention_attention_scaling),
            max_context=cfg.max_position_embeddings,
            compute=compute if compute != dtype else None,
            local_inv_freq=rotary.sliding_attention_inv_freq.detach().float().clone(),
            local_rope_scale=float(rotary.sliding_attention_attention_scaling),
            window=int(cfg.sliding_window),
            embed_scale=float(inner.embed_tokens.scalar_embed_scale),
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


def _layer(layer, kind: str, w, norm) -> GemmaLayerWeights:
    """One transformers ``Gemma3DecoderLayer`` as :class:`GemmaLayerWeights`."""
    at, mlp = layer.self_attn, layer.mlp
    if at.q_proj.bias is not None:
        raise SpecdraftError("Gemma 3 with attention biases is not supported by the compact runtime")
    return GemmaLayerWeights(
        attn_norm=norm(layer.input_layernorm),
        wqkv=w(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])),
        bqkv=None,
        wo=w(at.o_proj.weight),
        mlp_norm=norm(layer.pre_feedforward_layernorm),
        w_gate_up=w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
        w_down=w(mlp.down_proj.weight),
        q_norm=norm(at.q_norm),
        k_norm=norm(at.k_norm),
        post_attn_norm=norm(layer.post_attention_layernorm),
        post_mlp_norm=norm(layer.post_feedforward_layernorm),
        sliding=kind == "sliding_attention",
    )


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
