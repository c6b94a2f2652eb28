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

from specdraft.drafters.base import DraftContext, Proposal, Verified
from specdraft.drafters.ngram import NgramIndex, NgramState
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

    def new_state(self, batch_size: int, capacity: int) -> NgramState:
        return NgramState(batch_size, self.max_ngram)

    def candidates(self, index: NgramIndex, k: int) -> list[list[int]]:
        """Distinct continuations (up to k tokens) of the ``per_ngram`` latest matches of each
        n-gram length of the indexed sequence's tail, longest n first, then the most recent."""
        s = index.tokens
        out: list[list[int]] = []
        for n in range(min(self.max_ngram, len(s) - 1), self.min_ngram - 1, -1):
            for cont in index.continuations(index.latest(s[len(s) - n :], self.per_ngram), k):
                if cont not in out:
                    out.append(cont)
        return out

    def tree(self, index: NgramIndex, k: int) -> TokenTree | None:
        """The candidates' trie within k nodes (None when nothing matches): the other candidates
        first take up to ``k // 2`` nodes (the i-th at most ``max(1, k >> (i + 1))`` deep), then the
        best one takes the rest."""
        cands = self.candidates(index, k)
        if not cands:
            return None
        seen: set[tuple[int, ...]] = set()
        others = [_add(c[: max(1, k >> (i + 1))], seen, k // 2) for i, c in enumerate(cands[1:], 1)]
        others = [c for c in others if c]
        best = cands[0][: k - len(seen)]
        chains = [best, *others]  # siblings are tried in this order
        return TokenTree.from_chains(chains, sources=[self.source] * len(chains))

    def propose(self, state: NgramState, ctx: DraftContext, k: int) -> Proposal:
        trees = [self.tree(index, k) for index in state.synced(ctx)]
        return Proposal(tokens=torch.zeros(len(trees), 0, dtype=torch.int64), trees=trees)

    def observe(
        self, state: NgramState, num_accepted: torch.Tensor, verified: Verified | None = None
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
