"""A drafter whose proposals are spoiled for chosen rows: the collapse defense's test drafter.

:class:`WrongRows` wraps any drafter and, for the rows whose prompt is one of the given prompts,
shifts every proposed token by one (``x -> (x + 1) mod V``), and the draft distribution
with it (``q'(x + 1) = q(x)``), so each proposal is still distributed as the q it is verified
against (sampling stays lossless) but a draft that was right is now wrong: such a row's drafts
are (almost) always rejected, as under an acceleration-collapse input (issue 17). Setting
:attr:`WrongRows.enabled` to False makes it the inner drafter again (recovery).

Outcomes a drafter reads back in hindsight (``Proposal.hindsight``) are the shifted draft's too: a
spoiled row's are all misses. Exact where the inner draft's token was the committed one (the shifted
one is not); where it was not, the shifted token could be (when the inner one was the committed token
minus one), which the outcome does not tell: counting it a miss understates such a row's acceptance,
as the attack this drafter stands for would have it. Passed through unchanged, the read-backs told
the policy that a spoiled row's draft would have been right.

Which rows are spoiled is decided once per row, at its first proposal (:class:`_SpoiledState`):
comparing every row with the prompts at every proposal was drafting time that a benchmark charged
to the defense it measured (results/step-overhead-2026-12-05/README.md).
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
        return _SpoiledState(self.inner.new_state(batch_size, capacity), batch_size)

    def propose(self, state: _SpoiledState, ctx: DraftContext, k: int) -> Proposal:
        prop = self.inner.propose(state.inner, ctx, k)
        if not self.enabled or not any(state.spoiled(ctx, self.prompts)):
            return prop
        V, bad = self.vocab, state.bad
        rows = prop.tokens.tolist()  # (B, k) as lists: fewer tensor operations in every step
        tokens = torch.tensor([[(t + 1) % V for t in row] if b else row for row, b in zip(rows, bad)])
        probs = prop.probs
        if probs is not None:  # (B, k, V): q'(x + 1) = q(x)
            probs = torch.where(torch.tensor(bad).view(-1, 1, 1), probs.roll(1, dims=-1), probs)
        seen = prop.hindsight
        if seen is not None:  # read-backs of the shifted draft (module docstring)
            seen = [[False] * len(hits) if b else hits for hits, b in zip(seen, bad)]
        return replace(prop, tokens=tokens, probs=probs, hindsight=seen)

    def observe(
        self, state: DraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        self.inner.observe(state.inner, num_accepted, verified)


class _SpoiledState(DraftState):
    """The inner drafter's state, and whether each row is spoiled (``bad``; None: not seen yet)."""

    def __init__(self, inner: DraftState, batch_size: int):
        super().__init__(batch_size)
        self.inner = inner
        self.bad: list[bool | None] = [None] * batch_size

    def spoiled(self, ctx: DraftContext, prompts: list[torch.Tensor]) -> list[bool]:
        """Whether each row's committed tokens start with one of ``prompts`` (checked at a row's
        first proposal: its prompt is committed from the start and never changes)."""
        for b in (b for b, bad in enumerate(self.bad) if bad is None):
            row, n = ctx.tokens[b], int(ctx.lengths[b])
            self.bad[b] = any(len(p) <= n and bool((row[: len(p)] == p).all()) for p in prompts)
        return self.bad

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)
        self.bad = [self.bad[int(r)] for r in rows]
        super().select_rows(rows)

    def append(self, other: _SpoiledState) -> None:
        self.inner.append(other.inner)
        self.bad += other.bad
        super().append(other)

    def lag(self, lengths: torch.Tensor) -> torch.Tensor | None:
        return self.inner.lag(lengths)
