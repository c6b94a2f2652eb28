"""A drafter whose proposals are spoiled for chosen rows: the collapse defense's test drafter.

:class:`WrongRows` wraps any drafter and, for the rows whose prompt is one of the given prompts,
shifts every proposed token by one (``x -> (x + 1) mod V``), and the draft distribution
with it (``q'(x + 1) = q(x)``), so each proposal is still distributed as the q it is verified
against (sampling stays lossless) but a draft that was right is now wrong: such a row's drafts
are (almost) always rejected, as under an acceleration-collapse input (issue 17). Setting
:attr:`WrongRows.enabled` to False makes it the inner drafter again (recovery).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdraft.drafters.base import DraftContext, Drafter, DraftState, Proposal, Verified


class WrongRows:
    """``inner``'s proposals, shifted by one token for the rows of the given prompts.

    Args:
        inner: the drafter to spoil.
        prompts: rows whose committed tokens start with one of these (token ids) are spoiled.
        vocab: vocabulary size (the shift wraps around it).
    """

    def __init__(self, inner: Drafter, prompts: list[list[int]], vocab: int):
        self.inner = inner
        self.prompts = [torch.tensor(p, dtype=torch.int64) for p in prompts]
        self.vocab = vocab
        self.enabled = True
        self.name = f"wrong-rows({inner.name})"
        self.vocab_size = inner.vocab_size
        self.hidden_layers = getattr(inner, "hidden_layers", ())
        self.proposes_free = getattr(inner, "proposes_free", False)  # the shift is free too

    def new_state(self, batch_size: int, capacity: int) -> DraftState:
        return self.inner.new_state(batch_size, capacity)

    def propose(self, state: DraftState, ctx: DraftContext, k: int) -> Proposal:
        prop = self.inner.propose(state, ctx, k)
        if not self.enabled:
            return prop
        bad = torch.zeros(ctx.tokens.shape[0], dtype=torch.bool)  # (B,)
        for p in self.prompts:
            n = len(p)
            if n <= ctx.tokens.shape[1]:
                bad |= (ctx.lengths >= n) & (ctx.tokens[:, :n] == p).all(1)
        tokens = torch.where(bad.unsqueeze(1), (prop.tokens + 1) % self.vocab, prop.tokens)  # (B, k)
        probs = prop.probs
        if probs is not None:  # (B, k, V): q'(x + 1) = q(x)
            probs = torch.where(bad.view(-1, 1, 1), probs.roll(1, dims=-1), probs)
        return replace(prop, tokens=tokens, probs=probs)

    def observe(
        self, state: DraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        self.inner.observe(state, num_accepted, verified)
