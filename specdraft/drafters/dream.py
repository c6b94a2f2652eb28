"""DREAM-style drafting: cross-attention from the draft to the target's features of several layers.

After DREAM (Hu et al., "DREAM: Drafting with Refined Target Features and Entropy-Adaptive
Cross-Attention Fusion for Multimodal Speculative Decoding", arXiv 2505.19201; code
SAI-Lab-NYU/DREAM). A pair ``(f_p, token p + 1)`` enters as in EAGLE (``fc([f_p; e_{p+1}])``); a
cross-attention block then lets it read the target's hidden states of a few intermediate layers at
that position (low / mid / high: ``layers``), each RMS-normalised with its own scale, and adds what
it read to the residual stream; the draft's own decoder layer(s) then self-attend over the draft's
sequence (their KV cache is the shared base's, :mod:`specdraft.drafters.feature_base`) and the
target's frozen head reads the predicted feature.

The cross-attention is over layers at one position (M keys per query, M = ``len(layers)``), not
over past positions: the draft's self-attention already carries the sequence, and the memory needs
no cache of its own. Drafted pairs (past the last verified position) have no target features, so
they read the last verified position's. Training (``specdraft design build --kind dream``,
:mod:`specdraft.design.dream`) supervises the draft's last feature, its distribution and, DREAM's
refinement, its intermediate feature against the target layer chosen by attention entropy.

Text only. DREAM's multimodal half (visual-token compression, image features as cross-attention
memory) needs a vision-language target with offline weights, which this project does not have.
The extension point is ``memory``: an image path would append the compressed visual tokens' target
features as extra memory slots in :func:`cross_attend` (``M`` grows), and the training data would
carry them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdraft.drafters.feature_base import FeatureDrafterBase
from specdraft.errors import SpecdraftError

EPS = 1e-6
CROSS_KEYS = ("norm", "mem_norm", "q", "k", "v", "o")  # stored as ``cross.<key>``


def cross_weights(C: int, M: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Initial cross-attention weights: random q/k/v, a zero output projection (the block starts as
    the identity, so an untrained DREAM draft is the EAGLE draft it grows from)."""
    g = torch.Generator().manual_seed(seed)
    std = C**-0.5
    return {
        "norm": torch.ones(C),
        "mem_norm": torch.ones(M, C),
        "q": torch.randn(C, C, generator=g) * std,
        "k": torch.randn(C, C, generator=g) * std,
        "v": torch.randn(C, C, generator=g) * std,
        "o": torch.zeros(C, C),
    }


def cross_attend(
    x: torch.Tensor, memory: torch.Tensor, w: dict[str, torch.Tensor], heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + o(attention of x over memory)`` and the attention weights.

    Args:
        x: ``(B, T, C)`` the draft's inputs.
        memory: ``(B, T, M, C)`` the target's features of M layers at each of the T positions.
        w: :data:`CROSS_KEYS` -> weights (``mem_norm`` is ``(M, C)``: one scale per layer).
        heads: attention heads (C divisible by it).

    Returns:
        ``(B, T, C)`` and the attention ``(B, T, heads, M)``.
    """
    B, T, C = x.shape
    M, D = memory.shape[2], C // heads
    h = F.rms_norm(x, (C,), w["norm"], EPS)
    mem = F.rms_norm(memory, (C,), None, EPS) * w["mem_norm"]  # (B, T, M, C)
    q = F.linear(h, w["q"]).view(B, T, heads, D)
    k = F.linear(mem, w["k"]).view(B, T, M, heads, D)
    v = F.linear(mem, w["v"]).view(B, T, M, heads, D)
    att = torch.softmax(torch.einsum("bthd,btmhd->bthm", q, k) / math.sqrt(D), dim=-1)  # (B, T, H, M)
    o = torch.einsum("bthm,btmhd->bthd", att, v).reshape(B, T, C)
    return x + F.linear(o, w["o"]), att


class DreamDrafter(FeatureDrafterBase):
    """DREAM-style drafting (module docstring) in the engine.

    Args:
        runtime: the draft's runtime (see :class:`FeatureDrafterBase`).
        fc: ``(C, 2C)`` input projection over ``[feature, token embedding]``.
        cross: the cross-attention weights (:data:`CROSS_KEYS`).
        embed: ``(V, C)`` the target's token embedding.
        name: shown in statistics.
        layers: the target layers read (compact-runtime indices: layer i's output).
        heads: cross-attention heads.
        local: an optional local head (:mod:`specdraft.drafters.local`).
    """

    def __init__(self, runtime, fc, cross: dict, embed, name: str, layers, heads: int, local=None):
        if not layers:
            raise SpecdraftError("a DREAM draft reads at least one intermediate target layer")
        super().__init__(runtime, embed, name, layers=layers, local=local)
        self.fc = fc
        self.cross = {k: cross[k].to(fc.dtype) for k in CROSS_KEYS}
        self.heads = heads

    def inputs(self, feats: torch.Tensor, tokens: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        dt = self.fc.dtype
        x = F.linear(torch.cat([feats.to(dt), self.embed[tokens].to(dt)], dim=-1), self.fc)  # (B, T, C)
        return cross_attend(x, memory.to(dt), self.cross, self.heads)[0]
