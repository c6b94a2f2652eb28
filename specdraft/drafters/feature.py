"""EAGLE-style drafting from the target's final hidden state (a designed ``feature`` draft).

The draft model is trained by the CLI's ``design build --kind feature`` (its training model is
``FeatureDraftLM`` of the design package); :class:`FeatureDrafter` runs it in the engine. Wrong
or missing features can only cost acceptance: verification is unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal, Verified, take_token
from specdraft.models.subset_head import SubsetHeadRuntime


class FeatureDraftState(DraftState):
    """The feature draft's cache, and where each row's target features are.

    Attributes:
        src: ``(B,)`` row of the last target forward's hidden states that belongs to each row
            (-1: a row that joined since, or none yet).
        prev_L: ``(B,)`` committed length when that forward ran (-1: unknown).
        start: ``(B,)`` first position of the draft's context; cache slots before it are masked
            (-1: no context yet).
    """

    def __init__(self, runtime, batch_size: int, capacity: int):
        super().__init__(batch_size)
        self.kv = runtime.new_state(batch_size, capacity)
        self.src = torch.full((batch_size,), -1, dtype=torch.int64)
        self.prev_L = torch.full((batch_size,), -1, dtype=torch.int64)
        self.start = torch.full((batch_size,), -1, dtype=torch.int64)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.kv.select_rows(rows)
        self.src, self.prev_L, self.start = self.src[rows], self.prev_L[rows], self.start[rows]

    def append(self, other: FeatureDraftState) -> None:
        super().append(other)
        self.kv.append(other.kv)
        self.src = torch.cat([self.src, torch.full_like(other.src, -1)])
        self.prev_L = torch.cat([self.prev_L, other.prev_L])
        self.start = torch.cat([self.start, other.start])


class FeatureDrafter:
    """EAGLE-style drafting from the target's final hidden state (module docstring).

    Each step it feeds the pairs ``(f_p, token p + 1)`` for the positions the target verified last
    step (their features are real), then drafts on its own predicted features. It needs the engine
    to hand it the target's final hidden state: build the engine with ``hidden_layers=(-1,)``
    (:attr:`hidden_layers`; ``Pipeline.engine`` does). Rows without features yet (the first step
    after the prompt) propose nothing that step. Wrong or missing features can only cost acceptance:
    verification is unchanged.

    Args:
        runtime: the draft's runtime (a :class:`LlamaRuntime`, maybe inside a :class:`SubsetHeadRuntime`);
            its embedding table is replaced per call by the fc outputs it should read.
        fc: ``(C, 2C)`` weight of the input projection over ``[feature, token embedding]``.
        embed: ``(V, C)`` the target's token embedding.
        name: shown in statistics.
    """

    hidden_layers = (-1,)

    def __init__(self, runtime, fc: torch.Tensor, embed: torch.Tensor, name: str):
        self.runtime = runtime
        self.core = runtime.runtime if isinstance(runtime, SubsetHeadRuntime) else runtime
        self.core.w = dataclasses.replace(self.core.w)  # its own weights record: .embed is rewritten per call
        self.fc = fc
        self.embed = embed
        self.name = name
        self.vocab_size = runtime.vocab_size

    def new_state(self, batch_size: int, capacity: int) -> FeatureDraftState:
        return FeatureDraftState(self.runtime, batch_size, capacity)

    def _forward(self, state, feats, tokens, positions, index=None):
        """Feed pairs ``(B, T)``; returns full logits at ``index`` (or the last column) and features there."""
        B, T = tokens.shape
        pairs = torch.cat([feats, self.embed[tokens].to(feats.dtype)], dim=-1)  # (B, T, 2C)
        x = torch.nn.functional.linear(pairs, self.fc)  # (B, T, C)
        self.core.w.embed = x.reshape(B * T, -1)
        S = int(positions.max()) + 1
        slots = torch.arange(S)
        mask = (slots >= state.start.view(B, 1, 1)) & (slots <= positions.unsqueeze(-1))  # (B, T, S)
        index = torch.full((B, 1), T - 1) if index is None else index
        rows = torch.arange(B * T).view(B, T)  # (B, T) rows of the embedding table set above
        out = self.runtime.forward(
            state.kv, rows, positions, hidden_layers=(-1,), attn_mask=mask, logits_index=index
        )
        f = out.hidden[-1].gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))[:, 0]  # (B, C)
        return out.logits[:, 0], f

    def propose(self, state: FeatureDraftState, ctx: DraftContext, k: int) -> Proposal:
        B = ctx.lengths.shape[0]
        L = ctx.lengths
        hid = (ctx.target_hidden or {}).get(-1)  # (B', T', C) from the last target forward, or None
        have = state.src >= 0 if hid is not None else torch.zeros(B, dtype=torch.bool)
        draft = torch.zeros(B, k, dtype=torch.int64)
        probs = None
        if bool(have.any()):
            T_prev = hid.shape[1]
            known = state.prev_L >= 0
            c = torch.where(known, L - state.prev_L, torch.full_like(L, T_prev))
            c = c.clamp(1, T_prev)  # (B,) real pairs
            c = torch.where(have, c, torch.ones_like(c))
            gap = ~known | (L - state.prev_L > T_prev) | (state.start < 0)
            state.start = torch.where(have & gap, L - 1 - c, state.start)
            C = int(c.max())
            j = torch.arange(C)
            positions = (L - 1 - c).unsqueeze(1) + j  # (B, C): pairs p = L-1-c .. L-2, padding after
            src = state.src.clamp(min=0)
            feats = hid[src][:, : min(C, T_prev)]  # (B, C, dim)
            if feats.shape[1] < C:
                feats = torch.cat([feats, feats.new_zeros(B, C - feats.shape[1], feats.shape[2])], 1)
            feats = feats * (j < c.unsqueeze(1)).unsqueeze(-1)
            tok = ctx.tokens.gather(1, (positions + 1).clamp(max=ctx.tokens.shape[1] - 1))  # token p + 1
            logits, f = self._forward(state, feats.to(self.fc.dtype), tok, positions, (c - 1).unsqueeze(1))
            for i in range(k):
                probs, _ = take_token(logits, ctx, draft, probs, i)
                if i + 1 < k:  # pair (f_hat at L-2+i+1, d_i+1) at position L-1+i
                    pos = (L - 1 + i).unsqueeze(1)
                    logits, f = self._forward(state, f.unsqueeze(1), draft[:, i : i + 1], pos)
        state.src = torch.arange(B)
        state.prev_L = L.clone()
        return Proposal(tokens=draft, probs=probs, num_valid=torch.where(have, k, 0))

    def observe(
        self, state: FeatureDraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        pass  # what was committed is read from ctx.lengths at the next proposal
