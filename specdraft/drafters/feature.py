"""EAGLE-style drafting from the target's final hidden state (a designed ``feature`` draft).

The draft model is trained by the CLI's ``design build --kind feature`` (its training model is
``FeatureDraftLM`` of the design package); :class:`FeatureDrafter` runs it in the engine on the
shared base of feature drafters (:mod:`specdraft.drafters.feature_base`). Wrong or missing features
can only cost acceptance: verification is unchanged.
"""

from __future__ import annotations

import torch

from specdraft import kernels
from specdraft.drafters.feature_base import FeatureDrafterBase, FeatureDraftState
from specdraft.models.llama import linear
from specdraft.models.quant import QuantMatrix, dequantize_rows, quant_matmul

__all__ = ["FeatureDraftState", "FeatureDrafter"]


class FeatureDrafter(FeatureDrafterBase):
    """EAGLE-style drafting from the target's final hidden state (module docstring).

    A pair's input is ``fc([f_p; e_{p+1}])``. It needs the engine to hand it the target's final
    hidden state: build the engine with ``hidden_layers=(-1,)`` (:attr:`hidden_layers`;
    ``Pipeline.engine`` does).

    Args:
        runtime: the draft's runtime (see :class:`FeatureDrafterBase`).
        fc: ``(C, 2C)`` weight of the input projection over ``[feature, token embedding]``, in the
            runtime's weight dtype (bf16 runs through the same packed kernels as its layers) or its
            activations' dtype; GGUF blocks beside a quantized target (``--draft-dtype q``: the
            draft's layers on :class:`~specdraft.models.quant.QuantRuntime`, Q8_0 made at load).
        embed: ``(V, C)`` the target's token embedding (its GGUF blocks beside a quantized target).
        name: shown in statistics.
        local: an optional local head (:mod:`specdraft.drafters.local`).
        prompt_pairs: prompt pairs the draft reads (:class:`FeatureDrafterBase`; what it was trained
            with).
    """

    def __init__(self, runtime, fc: torch.Tensor, embed: torch.Tensor, name: str, local=None, prompt_pairs=0):
        super().__init__(runtime, embed, name, local=local, prompt_pairs=prompt_pairs)
        self.fc = fc
        if not isinstance(fc, QuantMatrix):
            kernels.prepack(fc)

    def inputs(self, feats: torch.Tensor, tokens: torch.Tensor, memory=None) -> torch.Tensor:
        if isinstance(self.fc, QuantMatrix):  # the quantized runtime's blocks and matmul (fp32 activations)
            pairs = torch.cat([feats.float(), dequantize_rows(self.embed, tokens)], dim=-1)
            return quant_matmul(self.fc, pairs, self.core.variant)
        dt = self.runtime.dtype  # the runtime's activations; fc may be stored narrower (bf16)
        pairs = torch.cat([feats.to(dt), self.embed[tokens].to(dt)], dim=-1)  # (B, T, 2C)
        return linear(pairs, self.fc, None, None)  # (B, T, C): the runtime's matmul for fc's dtype
