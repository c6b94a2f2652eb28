"""Training a DREAM-style draft (``specdraft design build --kind dream``).

The draft (:mod:`specdraft.drafters.dream`) is the EAGLE-style feature draft of
:mod:`specdraft.design.feature` plus a cross-attention block over the target's features of a few
intermediate layers. It trains on the same data (the target's own answers) and in the same loop
(:func:`~specdraft.design.train.train_offline`: checkpoints, resume, validation); what is new is
computed here, in one place.

**Target features.** The cached data holds only the target's final hidden states, so each batch runs
the frozen target once over its sequences (teacher forcing on the target's own answers, so these are
the states it computed while answering, up to batch rounding): the intermediate layers the draft
cross-attends to, and the attention maps the entropy rule reads.

**Entropy-adaptive intermediate target** (DREAM's data generation, ``mid_feature_collect`` in
SAI-Lab-NYU/DREAM): at every position, among the candidate layers ``1 .. int(frac * n) - 2`` of an
n-layer target, take the one whose attention is most concentrated, i.e. whose entropy
``-sum_j a_ij log a_ij`` (over keys j, averaged over heads) is lowest, and use that layer's *input*
hidden state as the target of the draft's intermediate feature (:func:`attention_entropy`,
:func:`entropy_select`). DREAM's text recipe uses ``frac = 0.4``.

**Loss** (DREAM's ``main_deepspeed.py``: ``v_w = 0.2``, ``p_w = 1.0``, mid weight 1.0)::

    loss = 0.2 * SmoothL1(f_hat_{p+1}, f_{p+1})          # the draft's last feature, the target's final
         + 1.0 * softCE(p_K, q)                           # the target's top-K distribution, renormalised
         + 1.0 * SmoothL1(m_hat_{p+1}, h^{l*}_{p+1})      # the draft's intermediate feature (its input to
                                                          # its last layer), the entropy-selected layer

The soft cross-entropy against the cached top-K of p is written as ``KL(p_K || q)``: they differ by
``H(p_K)``, which does not depend on the draft (same gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.design.data import TargetData
from specdraft.design.feature import FeatureBatch, FeatureDraftLM
from specdraft.design.train import distill_loss
from specdraft.drafters.dream import CROSS_KEYS, cross_attend, cross_weights
from specdraft.errors import SpecdraftError
from specdraft.models.llama import widened

FEAT_WEIGHT, SOFT_CE_WEIGHT, MID_WEIGHT = 0.2, 1.0, 1.0  # DREAM's loss weights (module docstring)


def default_layers(n_layers: int) -> list[int]:
    """Low / mid / high target layers (compact-runtime indices: layer i's output) of an n-layer
    target: about a quarter, half and three quarters of the way up (never the last layer, whose
    output the runtime hands out only after the final norm)."""
    picks = sorted({min(max(round(n_layers * f) - 1, 0), n_layers - 2) for f in (0.25, 0.5, 0.75)})
    return [p for p in picks if p >= 0] or [0]


def candidate_layers(n_layers: int, frac: float) -> list[int]:
    """The attention layers the entropy rule may pick: ``1 .. int(frac * n) - 2`` (DREAM), at least
    layer 1 of targets too shallow for that range."""
    hi = min(int(frac * n_layers) - 2, n_layers - 1)
    return list(range(1, max(hi, 1) + 1))


def attention_entropy(att: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, S)`` attention weights -> ``(B, S)`` entropy over keys, averaged over heads."""
    a = att.float()
    return -(a * torch.log(a.clamp(min=1e-12))).sum(-1).mean(1)


def entropy_select(entropy: dict[int, torch.Tensor]) -> torch.Tensor:
    """``{layer: (B, S) attention entropy}`` -> ``(B, S)`` the lowest-entropy layer at each position."""
    layers = sorted(entropy)
    stacked = torch.stack([entropy[i] for i in layers])  # (L_c, B, S)
    return torch.tensor(layers)[stacked.argmin(0)]


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layers: list[int], frac: float):
    """Run the frozen target over right-padded ``ids (B, S)``.

    Returns:
        ``memory (B, S, M, C)`` (the outputs of ``layers``) and ``mid (B, S, C)`` (the input hidden
        state of the lowest-entropy candidate layer at each position).
    """
    blocks = target.model.layers
    cands = candidate_layers(len(blocks), frac)
    entropy: dict[int, torch.Tensor] = {}

    def hook(i):
        def keep(module, args, out):
            entropy[i] = attention_entropy(out[1])

        return keep

    impl = target.config._attn_implementation
    target.set_attn_implementation("eager")  # (the others return no attention weights)
    handles = [blocks[i].self_attn.register_forward_hook(hook(i)) for i in cands]
    try:
        hs = target.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        for h in handles:
            h.remove()
        target.set_attn_implementation(impl)
    memory = torch.stack([hs[i + 1] for i in layers], dim=2).float()  # hs[i + 1]: layer i's output
    pick = entropy_select(entropy)  # (B, S) layer whose input is the target
    stack = torch.stack(hs[: max(cands) + 1])  # (L, B, S, C): hs[l] is layer l's input
    mid = stack.gather(0, pick.view(1, *pick.shape, 1).expand(1, -1, -1, stack.shape[-1]))[0]
    return memory, mid.float()


@dataclass
class DreamBatch(FeatureBatch):
    """A :class:`FeatureBatch` plus the target's intermediate features.

    Attributes:
        memory: ``(B, T, M, C)`` the target's ``layers`` at each pair's position.
        mid_target: ``(N, C)`` the entropy-selected intermediate feature at each labelled pair's next
            position.
    """

    memory: torch.Tensor = None
    mid_target: torch.Tensor = None


class DreamDraftLM(FeatureDraftLM):
    """The trainable DREAM-style draft (module docstring).

    Args:
        draft: a ``LlamaForCausalLM`` (its layers and norm are used; embedding/head are the target's).
        head_tokens: ``(N,)`` ids the head predicts, or None for the whole vocabulary.
        target: the target ``LlamaForCausalLM`` (frozen; run per batch for its features, in the
            runtime's arithmetic: :func:`~specdraft.models.llama.widened`).
        layers: target layers to cross-attend to (default :func:`default_layers`).
        heads: cross-attention heads (default: the draft's attention heads).
        frac: DREAM's candidate range for the entropy rule (:func:`candidate_layers`).
        fc, noise: as :class:`FeatureDraftLM`.
    """

    second_position = None  # its drafted pairs also read target layers (validate: first only)

    def __init__(
        self, draft, head_tokens, target, layers=None, heads=None, frac: float = 0.4, fc=None, noise=0.1
    ):
        super().__init__(draft, head_tokens, fc=fc, noise=noise, reg_weight=FEAT_WEIGHT)
        n = target.config.num_hidden_layers
        self.layers = list(layers) if layers else default_layers(n)
        if min(self.layers) < 0 or max(self.layers) > n - 2:
            raise SpecdraftError(
                f"DREAM layers must lie in 0..{n - 2} for a {n}-layer target, got {self.layers}"
            )
        C = draft.config.hidden_size
        self.heads = heads or draft.config.num_attention_heads
        if C % self.heads:
            raise SpecdraftError(f"cross-attention heads ({self.heads}) must divide the width {C}")
        self.frac = frac
        init = cross_weights(C, len(self.layers))
        self.cross = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in init.items()})
        # a list: not a submodule (not trained, not saved)
        self._target = [widened(target).eval().requires_grad_(False)]

    def trainable(self) -> list[torch.nn.Parameter]:
        return super().trainable() + list(self.cross.values())

    def own_state(self) -> dict[str, torch.Tensor]:
        return {**super().own_state(), **{f"cross.{k}": v.detach() for k, v in self.cross.items()}}

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        missing = [k for k in CROSS_KEYS if f"cross.{k}" not in state]
        if missing:
            raise SpecdraftError(f"weights lack cross.{missing[0]}: not a DREAM draft")
        with torch.no_grad():
            for k in CROSS_KEYS:
                self.cross[k].copy_(state.pop(f"cross.{k}"))
        super().load_own_state(state)

    def features(self, feats, tokens, positions, memory=None):
        """Pairs -> ``(B, T, C)`` predicted next features and ``(B, T, C)`` the draft's intermediate
        feature (the input of its last layer)."""
        x = self.fc(torch.cat([feats, self.draft.get_input_embeddings()(tokens)], dim=-1))
        x = cross_attend(x, memory, dict(self.cross), self.heads)[0]
        out = self.draft.model(
            inputs_embeds=x, position_ids=positions, output_hidden_states=True, use_cache=False
        )
        return out.last_hidden_state, out.hidden_states[-2]

    def make_batch(self, data: TargetData, idx: list[int], max_len: int) -> DreamBatch:
        """The feature batch, plus the target's layers at each pair and the entropy-selected
        intermediate feature at each label (one frozen-target forward over the batch)."""
        fb = super().make_batch(data, idx, max_len)
        n = torch.bincount(fb.rows, minlength=len(idx))  # pairs per row
        seqs = [data.tokens[i][: data.prompt_lens[i] + int(n[b])] for b, i in enumerate(idx)]
        ids = torch.zeros(len(seqs), max(s.shape[0] for s in seqs), dtype=torch.int64)
        for b, s in enumerate(seqs):
            ids[b, : s.shape[0]] = s
        memory, mid = target_features(self._target[0], ids, self.layers, self.frac)
        pos = fb.positions.clamp(max=ids.shape[1] - 1)  # (B, T); padding pairs read a real position
        B, T = pos.shape
        mem = memory.gather(1, pos.view(B, T, 1, 1).expand(-1, -1, *memory.shape[2:]))  # (B, T, M, C)
        nxt = fb.positions[fb.rows, fb.cols] + 1  # the labelled pairs' next positions
        fields = {f: getattr(fb, f) for f in fb.__dataclass_fields__}
        return DreamBatch(**fields, memory=mem, mid_target=mid[fb.rows, nxt])

    def loss(self, batch: DreamBatch, cfg) -> tuple[torch.Tensor, dict]:
        feats = batch.feats
        if self.training and self.noise:
            feats = feats + (torch.rand_like(feats) * 2 - 1) * self.noise
        f, m = self.features(feats, batch.ids, batch.positions, batch.memory)
        return dream_loss(
            self.tokens.head(f[batch.rows, batch.cols]),
            f[batch.rows, batch.cols],
            m[batch.rows, batch.cols],
            batch,
        )

    def head_logits(self, batch: DreamBatch) -> torch.Tensor:
        f, _ = self.features(batch.feats, batch.ids, batch.positions, batch.memory)
        return self.tokens.head(f[batch.rows, batch.cols])


def dream_loss(logits, feat, mid, batch: DreamBatch) -> tuple[torch.Tensor, dict]:
    """DREAM's loss (module docstring) at the N labelled pairs: ``logits (N, V_head)``, the draft's
    last feature ``feat (N, C)`` and intermediate feature ``mid (N, C)``."""
    _, parts = soft = distill_loss(logits, batch, 0.0, 1.0)
    reg = F.smooth_l1_loss(feat, batch.feat_target)
    mid_reg = F.smooth_l1_loss(mid, batch.mid_target)
    loss = SOFT_CE_WEIGHT * soft[0] + FEAT_WEIGHT * reg + MID_WEIGHT * mid_reg
    parts = {"soft_ce": parts["kl"], "reg": float(reg.detach()), "mid": float(mid_reg.detach())}
    return loss, parts
