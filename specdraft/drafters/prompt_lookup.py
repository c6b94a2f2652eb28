"""Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

Find the most recent earlier occurrence of the context's trailing n-gram (n from ``max_ngram``
down to ``min_ngram``) and propose the tokens that followed it. No model, no distribution: q is a
point mass, so sampling verification checks the draft against a sample from p. Each proposal is
classed by the matched n (``Proposal.bucket``), for the cost-aware policy.

Draft spec: ``lookup`` or ``lookup:N`` (n-grams up to N, default 3), built by :func:`from_spec`.
"""

from __future__ import annotations

import numpy as np
import torch

from specdraft.drafters.base import DraftContext, Proposal, Verified
from specdraft.drafters.ngram import NgramIndex, NgramState


class PromptLookupDrafter:
    """n-gram drafter over the row's own context (prompt and output so far), read from each row's
    :class:`~specdraft.drafters.ngram.NgramIndex`."""

    name = "prompt-lookup"
    vocab_size = None
    proposes_free = True  # no model, no randomness: the engine may propose for rows that are off

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def new_state(self, batch_size: int, capacity: int) -> NgramState:
        return NgramState(batch_size, self.max_ngram)

    def matched(self, index: NgramIndex) -> tuple[int, int]:
        """The matched n (0: none) and where the match ends in the indexed sequence (-1: none): the
        latest earlier occurrence of its trailing n-gram, the longest n first."""
        n, ends = index.match(index.tokens[-self.max_ngram :], 1, self.min_ngram)
        return n, (ends[0] if n else -1)

    def lookup(
        self, index: NgramIndex, k: int, match: tuple[int, int] | None = None
    ) -> tuple[int, list[int]]:
        """The matched n (0: none) and the continuation (up to k tokens) of the match
        (:meth:`matched`, or ``match`` when the caller has it already)."""
        n, end = match or self.matched(index)
        return n, (index.continuations([end], k)[0] if n else [])

    def propose(self, state: NgramState, ctx: DraftContext, k: int) -> Proposal:
        found = [self.lookup(index, k) for index in state.synced(ctx)]
        # a longer match is accepted far more often (SmolLM2 on Spec-Bench: the first token ~0.8 of
        # the time after 3 matched tokens, ~0.2 after 1): the policy learns each class's curve
        padded = [cont + [0] * (k - len(cont)) for _, cont in found]
        # numpy first: torch.tensor(list) is several times dearer after a forward (bench_step_overhead --cold)
        return Proposal(
            tokens=torch.from_numpy(np.array(padded, dtype=np.int64).reshape(len(found), k)),
            probs=None,
            num_valid=torch.from_numpy(np.array([len(cont) for _, cont in found], dtype=np.int64)),
            bucket=torch.from_numpy(np.array([n for n, _ in found], dtype=np.int64)),
        )

    def observe(
        self, state: NgramState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        pass


def from_spec(spec, target) -> PromptLookupDrafter:
    """The ``lookup[:N]`` factory of :data:`specdraft.registry.DRAFTERS` (the target is not needed)."""
    return PromptLookupDrafter(max_ngram=int(spec.arg or 3))
