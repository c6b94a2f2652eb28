"""Ouroboros phrase drafting without a model: prompt lookup lengthened with pool phrases, and pool
phrases for the last token verified beside it as branches of one token tree.

Ouroboros (Zhao et al. 2024, arXiv 2402.13720; thunlp/Ouroboros) drafts phrase by phrase from a
pool of candidate phrases keyed by the token before them (:class:`specdraft.pool.PhrasePool`),
filled from the committed text and from the target's own predictions past the first rejected
draft token, which verification computes anyway. Each step, for each row:

1. the base draft is prompt lookup's continuation of the context's trailing n-gram;
2. it is lengthened, while shorter than k, with the most recent pool phrase of its last token
   (of the context's last token when lookup found nothing);
3. the other pool phrases of the context's last token become further branches (up to
   ``branches`` of them), tried after the base draft;
4. the branches are merged into a trie of at most k nodes (the policy's k reads "at most k
   nodes"), in that order: the base draft is the tree's first path, which is also what a chain
   step verifies (``Proposal.tokens``).

Every node is a point mass (no q), so verification keeps the output exactly the target's, greedy or
sampled. Node sources are ``"lookup"`` (the base draft) and ``"pool"``.

The pool is per request by default. ``shared`` makes every request of the process read and fill
one pool (warm start from earlier requests; it lets one request's text shape another's timing, so
it is opt-in); ``warm=PATH`` first loads phrases saved by :meth:`PhrasePool.save`.

Draft spec: ``ouroboros:lookup[,shared][,warm=PATH][,chain]`` (``chain``: propose only the
lengthened base draft, as a chain, to compare tree and chain; a model-drafted base is not built yet).
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.drafters.suffix import tree_proposal
from specdraft.pool import PhrasePool, shared_pool
from specdraft.tree import TokenTree


class OuroborosState(DraftState):
    """Each row's phrase pool (one object for every row when shared) and how much of its context
    the pool has seen."""

    def __init__(self, pools: list[PhrasePool]):
        super().__init__(len(pools))
        self.pools = pools
        self.synced = [0] * len(pools)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.pools = [self.pools[int(r)] for r in rows]
        self.synced = [self.synced[int(r)] for r in rows]
        super().select_rows(rows)

    def append(self, other: OuroborosState) -> None:
        self.pools += other.pools
        self.synced += other.synced
        super().append(other)


def budget_tree(chains: list[tuple[list[int], list[str]]], k: int) -> TokenTree:
    """The trie of ``chains`` (tokens with a source per token), in order, cut to at most k nodes:
    a chain that would pass the budget is cut where it does."""
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    tokens, parents, sources = [], [], []
    for chain, srcs in chains:
        parent = -1
        for tok, src in zip(chain, srcs):
            node = index.get((parent, tok))
            if node is None:
                if len(tokens) == k:
                    break
                node = index[(parent, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                sources.append(src)
            parent = node
    return TokenTree(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(parents, dtype=torch.int64),
        sources=tuple(sources),
    )


class OuroborosDrafter:
    """Prompt lookup lengthened with pool phrases, pool phrases as extra branches.

    Args:
        max_ngram: prompt lookup's longest n-gram.
        shared: one process-wide pool for every request (see the module docstring).
        warm: a pool file to start from (:meth:`PhrasePool.save`).
        branches: pool phrases of the last token tried beside the base draft.
        phrase_len, max_phrases, max_keys: the pool's bounds (:class:`PhrasePool`).
        tree: propose the tree; False: only the lengthened base draft, as a chain.
    """

    name = "ouroboros"
    vocab_size = None

    def __init__(
        self,
        max_ngram: int = 3,
        shared: bool = False,
        warm: str | None = None,
        branches: int = 3,
        phrase_len: int = 8,
        max_phrases: int = 8,
        max_keys: int = 8192,
        tree: bool = True,
    ):
        self.tree = tree
        self.proposes_trees = tree  # the engine checks that the target can verify trees
        self.lookup = PromptLookupDrafter(max_ngram=max_ngram)
        self.branches = branches
        bounds = {"phrase_len": phrase_len, "max_phrases": max_phrases, "max_keys": max_keys}
        self.shared = shared_pool("ouroboros", warm, **bounds) if shared else None
        self.start = PhrasePool(**bounds)  # what a per-request pool starts from
        if warm is not None and not shared:
            self.start.load(warm)

    def new_pool(self) -> PhrasePool:
        return self.shared if self.shared is not None else self.start.copy()

    def new_state(self, batch_size: int, capacity: int) -> OuroborosState:
        return OuroborosState([self.new_pool() for _ in range(batch_size)])

    def chains(
        self, pool: PhrasePool, last: int, base: list[int], k: int
    ) -> list[tuple[list[int], list[str]]]:
        """The base draft lengthened with pool phrases, then the other phrases after ``last``; in a
        tree the lengthening leaves one node for the head of each other phrase."""
        phrases = pool.get(last)
        main, srcs = list(base), ["lookup"] * len(base)
        while len(main) < k:
            more = pool.get(main[-1])[:1] if main else phrases[:1]
            if not more:
                break
            main += more[0]
            srcs += ["pool"] * len(more[0])
        others = [list(p[:k]) for p in phrases[: self.branches] if not main or p[0] != main[0]]
        keep = max(len(base), k - len(others)) if self.tree else k
        out = [(main[:keep], srcs[:keep])] if main else []
        return out + [(p, ["pool"] * len(p)) for p in others]

    def propose(self, state: OuroborosState, ctx: DraftContext, k: int) -> Proposal:
        trees, matched = [], []
        for b, pool in enumerate(state.pools):
            L = int(ctx.lengths[b])
            seq = ctx.tokens[b, :L]  # (L,) the row's committed tokens
            pool.add_text(seq, start=state.synced[b])
            state.synced[b] = L
            n, base = self.lookup._lookup(seq, k)
            trees.append(budget_tree(self.chains(pool, int(seq[-1]), base.tolist(), k), k))
            matched.append(n)
        # the policy learns acceptance per matched n, as for prompt lookup (0: pool phrases only)
        return tree_proposal(trees, k, matched, as_trees=self.tree)

    def observe(self, state: OuroborosState, num_accepted: torch.Tensor, verified=None) -> None:
        """Add the target's corrected phrase past each row's rejection to the row's pool."""
        if verified is None:
            return
        for b, pool in enumerate(state.pools):
            pool.add_verified(
                verified.inputs[b], verified.parents[b], verified.target_next[b], verified.committed[b]
            )


def from_spec(spec, target) -> OuroborosDrafter:
    """The ``ouroboros:lookup[,shared][,warm=PATH][,chain]`` factory of
    :data:`specdraft.registry.DRAFTERS`."""
    opts = spec.arg.split(",")
    warm = next((o.partition("=")[2] for o in opts if o.startswith("warm=")), None)
    return OuroborosDrafter(shared="shared" in opts, warm=warm, tree="chain" not in opts)
