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

from specdraft.drafters.base import DraftContext, DraftState, Proposal, Verified


def ngram_matches(s: np.ndarray, n: int) -> np.ndarray:
    """Ascending starts ``i <= L - n - 1`` of the earlier occurrences of ``s``'s trailing n-gram (the
    n-gram has a successor). Candidates whose first token matches are narrowed one position at a
    time (numpy on the array's memory, without the copy of every window that an unfold makes)."""
    L = s.shape[0]
    tail = s[L - n :]
    starts = np.flatnonzero(s[: L - n] == tail[0])
    for j in range(1, n):
        if not starts.size:
            break
        starts = starts[s[starts + j] == tail[j]]
    return starts


class PromptLookupDrafter:
    """n-gram drafter over the row's own context (prompt and output so far)."""

    name = "prompt-lookup"
    vocab_size = None
    proposes_free = True  # no model, no state, no randomness: the engine may propose for rows that are off

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def new_state(self, batch_size: int, capacity: int) -> DraftState:
        return DraftState(batch_size)

    def _lookup(self, seq: torch.Tensor, k: int) -> tuple[int, torch.Tensor]:
        """The matched n (0: none) and the continuation (up to k tokens) of the latest earlier
        match of seq's trailing n-gram (:func:`ngram_matches`)."""
        s = seq.numpy()
        for n in range(min(self.max_ngram, s.shape[0] - 1), self.min_ngram - 1, -1):
            starts = ngram_matches(s, n)
            if starts.size:
                start = int(starts[-1]) + n
                return n, seq[start : start + k]
        return 0, seq[:0]

    def propose(self, state: DraftState, ctx: DraftContext, k: int) -> Proposal:
        B = ctx.tokens.shape[0]
        tokens = torch.zeros(B, k, dtype=torch.int64)
        num_valid = torch.zeros(B, dtype=torch.int64)
        matched = torch.zeros(B, dtype=torch.int64)
        for b in range(B):
            n, cont = self._lookup(ctx.tokens[b, : int(ctx.lengths[b])], k)
            tokens[b, : cont.shape[0]] = cont
            num_valid[b], matched[b] = cont.shape[0], n
        # a longer match is accepted far more often (SmolLM2 on Spec-Bench: the first token ~0.8 of
        # the time after 3 matched tokens, ~0.2 after 1): the policy learns each class's curve
        return Proposal(tokens=tokens, probs=None, num_valid=num_valid, bucket=matched)

    def observe(
        self, state: DraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        pass


def from_spec(spec, target) -> PromptLookupDrafter:
    """The ``lookup[:N]`` factory of :data:`specdraft.registry.DRAFTERS` (the target is not needed)."""
    return PromptLookupDrafter(max_ngram=int(spec.arg or 3))
