"""Mask tokens appended to a compact-runtime forward (FlexDraft, arXiv 2605.20022).

FlexDraft drafts inside the target's verification forward: from a *split* layer s on, mask tokens
go through the target's layers s..L-1 next to the real tokens, with the draft's own attention
projectors (q/k/v/o) and the target's frozen norms and MLPs, and read the real tokens' keys/values.
Their final hidden states, turned into logits by the target's head (after a calibration,
:mod:`specdraft.drafters.flex`), are the next step's draft.

Losslessness rests on one rule: mask tokens attend to real tokens, never the reverse. Here the
real tokens run their usual forward (:meth:`LlamaRuntime.forward`: native kernels, bit for bit a
forward without mask tokens) and write the cache; the mask tokens run afterwards in torch's ops,
read the cache at layers s.. and keep their own keys/values in temporaries, never in the cache.
So the real rows are the very same computation with or without them (``tests/drafters/test_flex.py``
checks it bit for bit). On a GPU the paper batches both kinds of rows into one kernel launch; on a
CPU the mask rows' work is the same either way, and keeping them apart keeps the real rows on the
native kernels.

The same :func:`mask_hidden` trains the draft (:mod:`specdraft.design.flex`): with gradients on,
every op is a differentiable torch op.

Shapes: B batch rows, M mask tokens per row, S cache slots read, C hidden size, H query heads, G
key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.models.llama import LlamaKV, LlamaRuntime, linear, rms_norm, rotate_half
from specdraft.models.runtime import ForwardOutput


@dataclass
class MaskRows:
    """Mask tokens to run through a target's layers ``split..`` after a forward.

    Attributes:
        x: ``(B, M, C)`` their input at layer ``split`` (the draft's learned mask embedding).
        positions: ``(B, M)`` their RoPE positions.
        visible: ``(B, M)`` the last cache slot each one reads: real tokens ``0..visible``.
        group: ``(M,)`` each one's group; a mask token also reads the earlier mask tokens of its
            group (and no others).
        split: the first layer (index into the runtime's layers) they go through.
        wqkv: per layer from ``split``: the draft's fused q/k/v projection ``((H + 2G) D, C)``.
        wo: per layer from ``split``: the draft's output projection ``(C, H D)``.
    """

    x: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    group: torch.Tensor
    split: int
    wqkv: list[torch.Tensor]
    wo: list[torch.Tensor]


def _lin(x: torch.Tensor, w: torch.Tensor, packed=None) -> torch.Tensor:
    """``x @ w.T``: the runtime's matmul at inference, a differentiable one in training."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return F.linear(x, w.to(x.dtype))
    return linear(x, w, None, packed)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)
    return rms_norm(x, weight, eps)


def _attention_mask(rows: MaskRows, S: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, 1, M, S + M)`` additive mask (0 or -inf, made once for all layers): cache slots up to
    ``visible``, then the earlier mask tokens of the group."""
    M = rows.group.shape[0]
    see_real = torch.arange(S) <= rows.visible.unsqueeze(-1)  # (B, M, S)
    j = torch.arange(M)
    same = rows.group.unsqueeze(1) == rows.group.unsqueeze(0)
    see_mask = same & (j.unsqueeze(1) >= j.unsqueeze(0))  # (M, M)
    see = torch.cat([see_real, see_mask.expand(see_real.shape[0], M, M)], -1).unsqueeze(1)
    return torch.zeros(see.shape, dtype=dtype).masked_fill_(~see, float("-inf"))


def mask_hidden(runtime: LlamaRuntime, state: LlamaKV, rows: MaskRows) -> torch.Tensor:
    """``(B, M, C)`` the mask tokens' final hidden states (after the final norm).

    Reads ``state`` (the real tokens' keys/values, written by the forward that came before) and
    writes nothing into it.
    """
    w = runtime.w
    B, M, _ = rows.x.shape
    H, G, D = w.n_heads, w.n_kv_heads, w.head_dim
    S = max(int(rows.visible.max()) + 1, 0)
    mask = _attention_mask(rows, S, runtime.dtype)
    cos, sin = runtime._rope(rows.positions)  # (B, 1, M, D)
    if torch.is_grad_enabled():  # tables made under inference mode cannot be saved for backward
        cos, sin = cos.clone(), sin.clone()
    x = rows.x.to(runtime.dtype)
    layers = zip(
        runtime.layers[rows.split :], rows.wqkv, rows.wo, state.k[rows.split :], state.v[rows.split :]
    )
    for layer, wqkv, wo, k_cache, v_cache in layers:
        h = _norm(x, layer.attn_norm, w.eps)
        qk, v = _lin(h, wqkv).view(B, M, H + 2 * G, D).transpose(1, 2).split((H + G, G), dim=1)
        qk = qk * cos + rotate_half(qk) * sin  # (B, H + G, M, D)
        q, k = qk.split((H, G), dim=1)
        keys = torch.cat([k_cache[:, :, :S].to(k.dtype), k], 2)  # (B, G, S + M, D)
        values = torch.cat([v_cache[:, :, :S].to(v.dtype), v], 2)
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=G != H)
        x = x + _lin(att.transpose(1, 2).reshape(B, M, H * D), wo)
        h = _norm(x, layer.mlp_norm, w.eps)
        gate, up = _lin(h, layer.w_gate_up, layer.q_gate_up).chunk(2, dim=-1)
        x = x + _lin(F.silu(gate) * up, layer.w_down, layer.q_down)
    return _norm(x, w.norm, w.eps)


def forward_with_masks(
    runtime: LlamaRuntime, state: LlamaKV, tokens: torch.Tensor, positions: torch.Tensor, rows: MaskRows, **kw
) -> tuple[ForwardOutput, torch.Tensor]:
    """The runtime's forward over the real ``tokens`` (unchanged: same path, same bits), then the
    mask tokens' hidden states ``(B, M, C)`` over the cache it wrote."""
    out = runtime.forward(state, tokens, positions, **kw)
    with torch.inference_mode():
        return out, mask_hidden(runtime, state, rows)
