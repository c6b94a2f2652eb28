"""Ouroboros phrase drafting: a base draft (prompt lookup or a draft model) lengthened with pool
phrases, and pool phrases for the last token verified beside it as branches of one token tree.

Ouroboros (Zhao et al. 2024, arXiv 2402.13720; thunlp/Ouroboros) drafts phrase by phrase from a
pool of candidate phrases keyed by the token before them (:class:`specdraft.pool.PhrasePool`),
filled from the committed text and from the target's own predictions past the first rejected
draft token, which verification computes anyway. Each step, for each row:

1. the base draft: prompt lookup's continuation of the context's trailing n-gram
   (``ouroboros:lookup``), or k tokens of a draft model (``ouroboros``: the draft designed for the
   target, ``designed:auto``; ``ouroboros:draft=NAME``: the designed draft NAME, a feature draft too);
2. it is lengthened, while shorter than k, with the most recent pool phrase of its last token
   (of the context's last token when the base proposes nothing);
3. the other pool phrases of the context's last token become further branches (up to
   ``branches`` of them), tried after the base draft, which leaves them a node each;
4. the branches are merged into a trie of at most k nodes (the policy's k reads "at most k
   nodes"), in that order: the base draft is the tree's first path, which is also what a chain
   step verifies (``Proposal.tokens``).

Lookup and pool nodes are point masses; a model's tokens keep the q they were sampled from (a node
a pool phrase shares with the model's chain keeps the model's q: the pool's tokens are a function
of the tokens above them, so the tree stays exact for recursive rejection sampling, see
:mod:`specdraft.tree`). The model's cache is told how many of *its* tokens were accepted (the
accepted path may leave its chain for a pool branch). Node sources: ``"lookup"`` or ``"model"``
(the base draft) and ``"pool"``.

The pool is per request by default. ``shared`` makes every request of the process read and fill
one pool (warm start from earlier requests; it lets one request's text shape another's timing, so
it is opt-in); ``warm=PATH`` first loads phrases saved by :meth:`PhrasePool.save`.

Draft spec: ``ouroboros[:lookup|draft=NAME][,shared][,warm=PATH][,chain]`` (``chain``: propose only the
lengthened base draft, as a chain, to compare tree and chain).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.drafters.suffix import first_path, tree_proposal
from specdraft.pool import PhrasePool, shared_pool
from specdraft.tree import TokenTree


class OuroborosState(DraftState):
    """Each row's phrase pool (one object for every row when shared), how much of its context the
    pool has seen, the base drafter's state and the base tokens each row's last proposal kept."""

    def __init__(self, pools: list[PhrasePool], base_state: DraftState):
        super().__init__(len(pools))
        self.pools, self.base_state = pools, base_state
        self.synced = [0] * len(pools)
        self.drafted: list[list[int]] = [[] for _ in pools]

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = [int(r) for r in rows]
        self.pools = [self.pools[r] for r in keep]
        self.synced = [self.synced[r] for r in keep]
        self.drafted = [self.drafted[r] for r in keep]
        self.base_state.select_rows(rows)
        super().select_rows(rows)

    def append(self, other: OuroborosState) -> None:
        self.pools += other.pools
        self.synced += other.synced
        self.drafted += other.drafted
        self.base_state.append(other.base_state)
        super().append(other)

    def lag(self, lengths: torch.Tensor) -> torch.Tensor | None:
        return self.base_state.lag(lengths)


@dataclass
class Chain:
    """One candidate continuation: tokens, a source per token, and q rows ``(m, V)`` for its first
    m tokens (a model draft's; the rest, and a chain without q, are point masses)."""

    tokens: list[int]
    sources: list[str]
    q: torch.Tensor | None = None


def budget_tree(chains: list[Chain], k: int, vocab_size: int | None = None) -> TokenTree:
    """The trie of ``chains``, in order, cut to at most k nodes (a chain that would pass the budget
    is cut where it does). A node shared by several chains keeps the first one's source and q. With
    ``vocab_size``, every node gets a q row (a point mass where its chain has none)."""
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    tokens, parents, sources, rows = [], [], [], []
    for chain in chains:
        parent = -1
        for j, (tok, src) in enumerate(zip(chain.tokens, chain.sources)):
            node = index.get((parent, tok))
            if node is None:
                if len(tokens) == k:
                    break
                node = index[(parent, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                sources.append(src)
                rows.append(chain.q[j] if chain.q is not None and j < len(chain.q) else None)
            parent = node
    q = None
    if vocab_size is not None:
        q = torch.zeros(len(tokens), vocab_size)
        for i, row in enumerate(rows):
            q[i] = (
                row if row is not None else torch.nn.functional.one_hot(torch.tensor(tokens[i]), vocab_size)
            )
    t = torch.tensor(tokens, dtype=torch.int64)
    return TokenTree(t, torch.tensor(parents, dtype=torch.int64), q, tuple(sources))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class OuroborosDrafter:
    """A base draft (prompt lookup or a model) lengthened with pool phrases, pool phrases as extra
    branches.

    Args:
        base: the base drafter (default: prompt lookup); a model draft's q rows go with its tokens.
        shared: one process-wide pool for every request (see the module docstring).
        warm: a pool file to start from (:meth:`PhrasePool.save`).
        branches: pool phrases of the last token tried beside the base draft.
        phrase_len, max_phrases, max_keys: the pool's bounds (:class:`PhrasePool`).
        tree: propose the tree; False: only the lengthened base draft, as a chain.
    """

    name = "ouroboros"

    def __init__(
        self,
        base=None,
        shared: bool = False,
        warm: str | None = None,
        branches: int = 3,
        phrase_len: int = 8,
        max_phrases: int = 8,
        max_keys: int = 8192,
        tree: bool = True,
    ):
        self.base = base if base is not None else PromptLookupDrafter()
        self.source = "lookup" if isinstance(self.base, PromptLookupDrafter) else "model"
        self.vocab_size = self.base.vocab_size
        self.hidden_layers = getattr(self.base, "hidden_layers", ())
        self.tree = tree
        self.proposes_trees = tree  # the engine checks that the target can verify trees
        self.branches = branches
        bounds = {"phrase_len": phrase_len, "max_phrases": max_phrases, "max_keys": max_keys}
        self.shared = shared_pool("ouroboros", warm, **bounds) if shared else None
        self.start = PhrasePool(**bounds)  # what a per-request pool starts from
        if warm is not None and not shared:
            self.start.load(warm)

    def new_pool(self) -> PhrasePool:
        return self.shared if self.shared is not None else self.start.copy()

    def new_state(self, batch_size: int, capacity: int) -> OuroborosState:
        pools = [self.new_pool() for _ in range(batch_size)]
        return OuroborosState(pools, self.base.new_state(batch_size, capacity))

    def chains(self, pool: PhrasePool, last: int, base: Chain, k: int) -> list[Chain]:
        """The base draft lengthened with pool phrases, then the other phrases after ``last``; in a
        tree the main chain leaves one node for the head of each other phrase."""
        phrases = pool.get(last)
        main, srcs = list(base.tokens), list(base.sources)
        while len(main) < k:
            more = pool.get(main[-1])[:1] if main else phrases[:1]
            if not more:
                break
            main += more[0]
            srcs += ["pool"] * len(more[0])
        others = [list(p[:k]) for p in phrases[: self.branches] if not main or p[0] != main[0]]
        keep = max(1, k - len(others)) if self.tree else k
        out = [Chain(main[:keep], srcs[:keep], base.q)] if main else []
        return out + [Chain(p, ["pool"] * len(p)) for p in others]

    def propose(self, state: OuroborosState, ctx: DraftContext, k: int) -> Proposal:
        prop = self.base.propose(state.base_state, ctx, k)
        B = ctx.lengths.shape[0]
        nv = prop.num_valid if prop.num_valid is not None else torch.full((B,), k)
        V = prop.probs.shape[-1] if prop.probs is not None else None
        trees = []
        for b, pool in enumerate(state.pools):
            L = int(ctx.lengths[b])
            seq = ctx.tokens[b, :L]  # (L,) the row's committed tokens
            pool.add_text(seq, start=state.synced[b])
            state.synced[b] = L
            n = int(nv[b])
            q = prop.probs[b, :n] if prop.probs is not None else None
            base = Chain(prop.tokens[b, :n].tolist(), [self.source] * n, q)
            tree = budget_tree(self.chains(pool, int(seq[-1]), base, k), k, V)
            state.drafted[b] = base.tokens[
                : _common_prefix(base.tokens, tree.tokens[first_path(tree)].tolist())
            ]
            trees.append(tree)
        # prompt lookup's classes (the matched n) stay: the policy learns acceptance per class
        bucket = prop.bucket.tolist() if prop.bucket is not None else None
        return tree_proposal(trees, k, bucket, as_trees=self.tree)

    def observe(self, state: OuroborosState, num_accepted: torch.Tensor, verified=None) -> None:
        """Add the target's corrected phrase past each row's rejection to the row's pool; tell the
        base drafter how many of its own tokens were accepted (the path may leave them for a pool
        branch)."""
        if verified is None:
            own = torch.tensor([len(d) for d in state.drafted])
            self.base.observe(state.base_state, torch.minimum(num_accepted, own))
            return
        for b, pool in enumerate(state.pools):
            pool.add_verified(
                verified.inputs[b], verified.parents[b], verified.target_next[b], verified.committed[b]
            )
        own = [_common_prefix(d, c[:-1]) for d, c in zip(state.drafted, verified.committed)]
        self.base.observe(state.base_state, torch.tensor(own, dtype=torch.int64), verified)


def _with_model(target):
    """``target`` with its transformers model loaded (a designed draft shares its embedding): a
    quantized target's runtime loads only the tokenizer (as :func:`specdraft.api.load` does for a
    ``designed`` spec)."""
    if target.loaded.model is not None:
        return target
    from specdraft.models.loading import load_model

    return replace(target, loaded=load_model(target.loaded.name, torch.float32))


def from_spec(spec, target) -> OuroborosDrafter:
    """The ``ouroboros[:lookup|draft=NAME][,shared][,warm=PATH][,chain]`` factory of
    :data:`specdraft.registry.DRAFTERS`: the base is prompt lookup with ``lookup``, the designed draft
    NAME with ``draft=NAME`` (any kind, a feature draft too), else the draft designed for the target
    (``designed:auto``, itself prompt lookup when there is none)."""
    from specdraft.registry import build_drafter

    opts = spec.arg.split(",")
    value = {o.partition("=")[0]: o.partition("=")[2] for o in opts if "=" in o}
    warm = value.get("warm")
    designed = f"designed:{value.get('draft', 'auto')}"
    base = PromptLookupDrafter() if "lookup" in opts else build_drafter(designed, _with_model(target))
    return OuroborosDrafter(base, shared="shared" in opts, warm=warm, tree="chain" not in opts)
