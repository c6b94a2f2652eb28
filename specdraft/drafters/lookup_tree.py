"""Prompt lookup as a token tree: several earlier matches verified in one target forward.

Prompt lookup (:mod:`specdraft.drafters.prompt_lookup`) proposes what followed the *latest*
occurrence of the context's trailing n-gram. When the context repeats itself with variations (code,
lists, a question's wording reused in the answer) the latest match is often not the right one: this
drafter gathers the continuations of the ``per_ngram`` most recent matches of every n-gram length
from ``max_ngram`` down to ``min_ngram``, merges them into a trie (:meth:`TokenTree.from_chains`:
shared prefixes once) and lets the target pick the longest agreeing branch (:mod:`specdraft.tree`).

Node budget: at most k nodes (k from the policy, ``policy.choose``). Candidates are ranked as
prompt lookup ranks matches (longer n first, then the more recent). The others than the best take
at most half the budget, shallow (the i-th at most ``max(1, k >> (i + 1))`` deep): alternatives
are worth the most near the root; the best candidate takes the rest, so alone it gets prompt
lookup's full depth k. Every node is a point mass (no q) tagged
``"lookup"``.

Draft spec: ``lookup-tree`` or ``lookup-tree:N`` (n-grams up to N, default 3), built by
:func:`from_spec`.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal, Verified
from specdraft.drafters.prompt_lookup import ngram_matches
from specdraft.tree import TokenTree


class LookupTreeDrafter:
    """Token trees from several prompt-lookup matches over the row's own context."""

    name = "lookup-tree"
    vocab_size = None
    proposes_trees = True
    source = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, per_ngram: int = 3):
        if not 1 <= min_ngram <= max_ngram or per_ngram < 1:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram and per_ngram >= 1, got {min_ngram}, {max_ngram}"
            )
        self.max_ngram, self.min_ngram, self.per_ngram = max_ngram, min_ngram, per_ngram

    def new_state(self, batch_size: int, capacity: int) -> DraftState:
        return DraftState(batch_size)

    def candidates(self, seq: torch.Tensor, k: int) -> list[list[int]]:
        """Distinct continuations (up to k tokens) of the ``per_ngram`` latest matches of each
        n-gram length, longest n first, then the most recent."""
        s = seq.numpy()
        L = s.shape[0]
        out: list[list[int]] = []
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            for start in ngram_matches(s, n)[::-1][: self.per_ngram].tolist():
                cont = s[start + n : start + n + k].tolist()
                if cont not in out:
                    out.append(cont)
        return out

    def tree(self, seq: torch.Tensor, k: int) -> TokenTree | None:
        """The candidates' trie within k nodes (None when nothing matches): the other candidates
        first take up to ``k // 2`` nodes (the i-th at most ``max(1, k >> (i + 1))`` deep), then the
        best one takes the rest."""
        cands = self.candidates(seq, k)
        if not cands:
            return None
        seen: set[tuple[int, ...]] = set()
        others = [_add(c[: max(1, k >> (i + 1))], seen, k // 2) for i, c in enumerate(cands[1:], 1)]
        others = [c for c in others if c]
        best = cands[0][: k - len(seen)]
        chains = [best, *others]  # siblings are tried in this order
        return TokenTree.from_chains(chains, sources=[self.source] * len(chains))

    def propose(self, state: DraftState, ctx: DraftContext, k: int) -> Proposal:
        B = ctx.tokens.shape[0]
        trees = [self.tree(ctx.tokens[b, : int(ctx.lengths[b])], k) for b in range(B)]
        return Proposal(tokens=torch.zeros(B, 0, dtype=torch.int64), trees=trees)

    def observe(
        self, state: DraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        pass


def _add(chain: list[int], seen: set[tuple[int, ...]], budget: int) -> list[int]:
    """``chain`` cut so that the trie of ``seen`` (its nodes as token prefixes) stays within
    ``budget`` nodes, its nodes added to ``seen``; empty when it adds nothing."""
    new = [j for j in range(len(chain)) if tuple(chain[: j + 1]) not in seen]
    room = budget - len(seen)
    if not new or room <= 0:
        return []
    chain = chain[: new[min(room, len(new)) - 1] + 1]  # a chain's new nodes are its last ones
    seen.update(tuple(chain[: j + 1]) for j in range(len(chain)))
    return chain


def from_spec(spec, target) -> LookupTreeDrafter:
    """The ``lookup-tree[:N]`` factory of :data:`specdraft.registry.DRAFTERS`."""
    return LookupTreeDrafter(max_ngram=int(spec.arg or 3))
