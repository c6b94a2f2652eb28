"""Context bigram drafting: the example drafter of the README's "Add a drafter" section.

Each row proposes a chain of most frequent successors: from its last committed token, the token
that most often followed it earlier in the row's own context (prompt and output so far), then
that token's most frequent successor, and so on, up to k tokens; the chain ends at a token never
followed. There is no model and no distribution (``probs=None``): verification treats the
proposal as point masses, so greedy and sampled output stay exactly the target's.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal, Verified


class BigramDrafter:
    """Proposes each row's chain of most frequent successors (module docstring)."""

    name = "bigram"
    vocab_size = None  # no distribution over the vocabulary

    def new_state(self, batch_size: int, capacity: int) -> DraftState:
        return DraftState(batch_size)  # nothing to keep: the context is read at each proposal

    def propose(self, state: DraftState, ctx: DraftContext, k: int) -> Proposal:
        B = ctx.tokens.shape[0]
        tokens = torch.zeros(B, k, dtype=torch.int64)
        num_valid = torch.zeros(B, dtype=torch.int64)
        for b in range(B):
            seq = ctx.tokens[b, : int(ctx.lengths[b])]  # (L,) the row's committed tokens
            prev, succ, cur = seq[:-1], seq[1:], seq[-1]
            for i in range(k):
                seen = succ[prev == cur]  # every token that followed cur
                if seen.numel() == 0:
                    break
                cur = torch.bincount(seen).argmax()  # the most frequent one (ties: the lowest id)
                tokens[b, i] = cur
                num_valid[b] = i + 1
        return Proposal(tokens=tokens, probs=None, num_valid=num_valid)

    def observe(
        self, state: DraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        pass


def from_spec(spec, target) -> BigramDrafter:
    """The ``bigram`` factory of :data:`specdraft.registry.DRAFTERS` (it needs nothing of the target)."""
    return BigramDrafter()
