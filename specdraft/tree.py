"""Token trees: several candidate continuations verified in one target forward.

A :class:`TokenTree` hangs candidate tokens below the *root*, the last committed token (the one a
chain step also feeds first). Node ``i`` has a token and a parent (``-1``: the root); nodes are in
topological order (a parent comes before its children), so along any root-to-node path the indices
grow. Several chains that share a prefix become one trie (:meth:`TokenTree.from_chains`).

One target forward scores the root and every node: the input is ``[root, node_0 .. node_{N-1}]``,
row 0 of the logits is the target's distribution after the root and row ``1 + i`` the one after
node ``i``. Each node sees the committed context, the root, its ancestors and itself
(:meth:`TokenTree.step_mask`), and sits at RoPE position ``root + depth`` (:meth:`TokenTree.positions`),
while its keys/values go to cache slot ``root + 1 + i`` (:meth:`TokenTree.slots`): siblings share a
position but not a slot. After verification the accepted nodes' entries are moved to the slots of
their positions (a chain's layout), so the next step continues as after a chain step.

Verification (the vocabulary of :mod:`specdraft.verify`: accepted, recovered, bonus, output):

- greedy: the accepted path is the longest root-to-node path whose every node is the target's
  argmax after its parent (children have distinct tokens, so it is unique); the output is that
  path plus the target's argmax after its last node.
- sampling, multi-candidate rejection sampling (SpecInfer, Miao et al. 2024, "multi-step
  speculative sampling"; recursive rejection sampling, Jeon et al. 2024; Sequoia): at the current
  node, with p the target's distribution there, try the children in order; child c (token x, drawn
  from q_c) is accepted with probability ``min(1, p(x) / q_c(x))``; otherwise
  ``p <- norm(max(p - q_c, 0))`` and the next child is tried. The walk moves to an accepted child
  and repeats; when every child is rejected (or there are none) one token is sampled from the
  current p (recovered, or bonus at a leaf). Each round turns a draw from q_c into a draw from p
  (the chain lemma of Leviathan et al. 2023), for any q_c that may depend on the earlier siblings,
  so the output is distributed exactly as sampling from the target.

``q_c`` is the distribution child c's token was drawn from, given its parent and its earlier
siblings (i.i.d. siblings: the same row for each; sampling without replacement: the row
renormalised without the earlier siblings). A deterministic draft (prompt lookup, a pool phrase) is
a point mass, ``q_c = one_hot(x)``: then the rule accepts c with probability p(x) and removes x
from p, which is the same as drawing one sample from p and following the child that carries it.
Nothing here calls a model, so stub logits test it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from specdraft.errors import SpecdraftError
from specdraft.verify import SamplingParams, greedy_tokens, logits_to_probs, sample


@dataclass(frozen=True)
class TokenTree:
    """Candidate tokens below the root (the last committed token).

    Attributes:
        tokens: ``(N,)`` int64 token of each node.
        parents: ``(N,)`` int64 parent node of each node, ``-1`` for the root; ``parents[i] < i``.
        draft_probs: ``(N, V)`` q_c for each node (see the module docstring), processed like p; None
            when every node is a point mass (a draft without a distribution).
        sources: where each node came from (``"lookup"``, ``"pool"``, ``"model"``...), shown per
            accepted token by ``generate --color``; None: the drafter's name.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    sources: tuple[str, ...] | None = None

    def __post_init__(self):
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.parents.shape != (n,):
            raise SpecdraftError(
                f"tree tokens {tuple(self.tokens.shape)} / parents "
                f"{tuple(self.parents.shape)}: expected two (N,) tensors"
            )
        if n and not ((self.parents >= -1) & (self.parents < torch.arange(n))).all():
            raise SpecdraftError(
                f"tree parents must satisfy -1 <= parents[i] < i, got {self.parents.tolist()}"
            )
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise SpecdraftError(f"draft_probs has {self.draft_probs.shape[0]} rows for {n} nodes")
        if self.sources is not None and len(self.sources) != n:
            raise SpecdraftError(f"{len(self.sources)} sources for {n} nodes")

    @classmethod
    def from_chains(
        cls,
        chains: list[list[int]],
        probs: list[torch.Tensor] | None = None,
        sources: list[str] | None = None,
    ) -> TokenTree:
        """The prefix trie of several candidate continuations, shared prefixes stored once.

        Merging is exact for point masses (a repeated deterministic candidate is certainly
        rejected and leaves p unchanged) and for chains a drafter extended from the same node. It is
        not for two *independent samples* that happen to agree: skipping the second draw (whose
        rejection is then certain but still updates p) biases the output. A sampling drafter
        draws siblings without replacement (renormalising q, as recursive rejection sampling
        does), or builds the tree with :class:`TokenTree` directly and keeps such duplicates apart.

        Args:
            chains: token lists, each continuing the root; their order is the order in which
                siblings are tried (put the most likely first).
            probs: optional ``(len(chain), V)`` q rows per chain; a node shared by several chains
                keeps the row of the first chain that reached it.
            sources: optional source tag per chain; a shared node keeps the first chain's.
        """
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        tokens, parents, rows, tags = [], [], [], []
        for c, chain in enumerate(chains):
            parent = -1
            for j, tok in enumerate(chain):
                node = index.get((parent, int(tok)))
                if node is None:
                    node = index[(parent, int(tok))] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(parent)
                    if probs is not None:
                        rows.append(probs[c][j])
                    if sources is not None:
                        tags.append(sources[c])
                parent = node
        q = None
        if probs is not None:
            V = next((p.shape[-1] for p in probs if p.numel()), 0)
            q = torch.stack(rows) if rows else torch.zeros(0, V)
        return cls(
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(parents, dtype=torch.int64),
            q,
            None if sources is None else tuple(tags),
        )

    @classmethod
    def from_candidates(
        cls, tokens: torch.Tensor, parents: torch.Tensor, keep: torch.Tensor, source: str | None = None
    ) -> TokenTree:
        """The tree of the kept candidates of a larger draft tree, renumbered in their order.

        Args:
            tokens: ``(M,)`` every candidate's token.
            parents: ``(M,)`` every candidate's parent candidate (-1: the root), ``parents[i] < i``.
            keep: ``(M,)`` bool, the candidates to keep; a kept candidate's parent must be kept.
            source: tag of every node (None: the drafter's name).
        """
        idx = keep.nonzero().squeeze(1)  # (N,) kept candidates, in order
        renum = torch.full((tokens.shape[0] + 1,), -1, dtype=torch.int64)  # slot 0: the root
        renum[idx + 1] = torch.arange(idx.shape[0])
        par = renum[parents[idx] + 1]  # (N,)
        if bool(((parents[idx] >= 0) & (par < 0)).any()):
            raise SpecdraftError("a kept tree candidate's parent is not kept")
        tags = None if source is None else (source,) * idx.shape[0]
        return cls(tokens[idx].clone(), par, sources=tags)

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None) -> TokenTree:
        """A single chain: what a chain step verifies."""
        return cls.from_chains([tokens], None if probs is None else [probs])

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @cached_property
    def depth(self) -> torch.Tensor:
        """``(N,)`` depth of each node; the root's children are at depth 1."""
        depth = torch.zeros(self.num_nodes, dtype=torch.int64)
        for i, parent in enumerate(self.parents.tolist()):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        return depth

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """``(N, N)`` bool: ``[i, j]`` is True when node j is node i or one of its ancestors."""
        n = self.num_nodes
        anc = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                anc[i] |= anc[parent]
        return anc

    @cached_property
    def repeats(self) -> torch.Tensor:
        """``(N,)`` bool: an earlier sibling carries the same token (only a tree built directly has
        such nodes; the rules of this module never accept them, see :func:`_follow`)."""
        same = (self.parents.unsqueeze(1) == self.parents) & (
            self.tokens.unsqueeze(1) == self.tokens
        )  # (N, N)
        return (same & torch.ones_like(same).tril(-1)).any(dim=1)

    @cached_property
    def children(self) -> dict[int, list[int]]:
        """Children of each node in try order (``-1``: the root); leaves are absent."""
        kids: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents.tolist()):
            kids.setdefault(parent, []).append(i)
        return kids

    def positions(self, root_pos: int) -> torch.Tensor:
        """``(N + 1,)`` RoPE positions of ``[root, nodes]``: ``root_pos + depth``."""
        return root_pos + torch.cat([torch.zeros(1, dtype=torch.int64), self.depth])

    def slots(self, root_pos: int) -> torch.Tensor:
        """``(N + 1,)`` cache slots of ``[root, nodes]``: ``root_pos + 1 + i`` for node i."""
        return root_pos + torch.arange(self.num_nodes + 1)

    def step_mask(self, root_pos: int, num_slots: int | None = None) -> torch.Tensor:
        """``(N + 1, S)`` bool attention mask over cache slots for the step ``[root, nodes]``.

        Every query sees the committed context (slots ``0 .. root_pos - 1``) and the root;
        node i also sees its ancestors and itself at their :meth:`slots`.

        Args:
            root_pos: position (and slot) of the root, i.e. the committed length minus one.
            num_slots: S, at least ``root_pos + N + 1`` (default: exactly that).
        """
        n = self.num_nodes
        S = root_pos + n + 1 if num_slots is None else num_slots
        if S < root_pos + n + 1:
            raise SpecdraftError(f"{S} slots cannot hold a root at {root_pos} and {n} nodes")
        mask = torch.zeros(n + 1, S, dtype=torch.bool)
        mask[:, : root_pos + 1] = True
        mask[1:, root_pos + 1 : root_pos + 1 + n] = self.ancestors
        return mask


def most_probable(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """EAGLE-2's rerank (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
    Draft Trees", arXiv 2406.16858): the ``budget`` candidates of highest ``score`` per row.

    ``scores`` are cumulative draft log-probabilities (a node's is its parent's plus its own
    log q, so never above its parent's) over candidates in topological order; ties go to the
    earlier candidate, so a kept node's ancestors are always kept. ``-inf`` (a token outside a
    subset head) is never kept.

    Args:
        scores: ``(B, M)`` float.
        budget: nodes per row.

    Returns:
        ``(B, M)`` bool, the kept candidates.
    """
    order = scores.argsort(dim=1, descending=True, stable=True)[:, :budget]  # (B, <= budget)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(1, order, True)
    return keep & torch.isfinite(scores)


@dataclass
class TreeVerdict:
    """The result of verifying one tree.

    Attributes:
        nodes: ``(n,)`` accepted node indices, root to leaf (their cache entries are kept).
        tokens: ``(n + 1,)`` output tokens: the accepted nodes' tokens, then the recovered or bonus token.
    """

    nodes: torch.Tensor
    tokens: torch.Tensor

    @property
    def num_accepted(self) -> int:
        return self.nodes.shape[0]


def _follow(tree: TokenTree, target_tokens: torch.Tensor) -> TreeVerdict:
    """The path along which each node equals ``target_tokens`` at its parent's row, plus the target's
    token after it. ``target_tokens``: ``(N + 1,)``, row 0 after the root, row 1 + i after node i."""
    if tree.num_nodes == 0:
        return TreeVerdict(nodes=torch.zeros(0, dtype=torch.int64), tokens=target_tokens[:1])
    # a repeated sibling is never followed: with point masses the first one carrying the token is
    # accepted exactly when the sample is that token, and the rule then rejects the repeat for sure
    # (choosing between repeats by how deep they go would bias a sampled output)
    match = (tree.tokens == target_tokens[tree.parents + 1]) & ~tree.repeats  # (N,)
    ok = ~(tree.ancestors & ~match).any(dim=1)  # (N,) the node and all its ancestors match
    if not ok.any():
        return TreeVerdict(nodes=torch.zeros(0, dtype=torch.int64), tokens=target_tokens[:1])
    best = int(torch.where(ok, tree.depth, -1).argmax())  # the deepest; one path matches at most
    path = tree.ancestors[best].nonzero().squeeze(1)  # ascending index = root-to-leaf order
    return TreeVerdict(nodes=path, tokens=torch.cat([tree.tokens[path], target_tokens[best + 1 : best + 2]]))


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> TreeVerdict:
    """Accept the longest path of the target's argmax choices.

    Args:
        tree: the candidates.
        target_logits: ``(N + 1, V)``; row 0 scores the token after the root, row 1 + i the token
            after node i.
    """
    return _follow(tree, greedy_tokens(target_logits))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))``: what p still owes after a rejected draw from q (``p`` if nothing)."""
    r = (p - q).clamp_min(0)
    mass = r.sum()
    # p <= q everywhere means p == q: a draw from q was then never rejected (or only by rounding)
    return r / mass if mass > 0 else p


def verify_tree_sampling(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> TreeVerdict:
    """Multi-candidate rejection sampling over a tree (module docstring): the output tokens are
    distributed exactly as tokens sampled from the target one at a time.

    A tree without ``draft_probs`` (all point masses) draws one sample per row from p and follows
    the child that carries it, which is the rejection rule with one-hot q (and, for a chain,
    :func:`specdraft.verify.verify_sampling` without q, draw for draw). With ``draft_probs``, one
    uniform is drawn per node up front and the walk tries children in order, as
    :func:`~specdraft.verify.verify_sampling` does along a chain (draw for draw, too).

    Args:
        tree: the candidates and their q.
        target_probs: ``(N + 1, V)`` p after temperature / top-k / top-p, rows as in
            :func:`verify_tree_greedy`.
        generator: the request's own randomness.
    """
    if tree.draft_probs is None:
        return _follow(tree, sample(target_probs, generator))
    q, tokens = tree.draft_probs, tree.tokens.tolist()
    u = torch.rand(tree.num_nodes, generator=generator)  # (N,) one uniform per node, used when it is tried
    path: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1]  # (V,) the target after the current node
        for c in tree.children.get(node, []):
            x = tokens[c]
            # accept with min(1, p(x) / q_c(x)): u < p/q  <=>  u * q < p (no division)
            if u[c] * q[c, x] < p[x]:
                break
            p = _residual(p, q[c])
        else:  # every child rejected, or a leaf: recovered / bonus token from what p still owes
            nodes = torch.tensor(path, dtype=torch.int64)
            return TreeVerdict(
                nodes=nodes, tokens=torch.cat([tree.tokens[nodes], sample(p, generator).view(1)])
            )
        path.append(c)
        node = c


def verify_tree(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> TreeVerdict:
    """Verify one tree: :func:`verify_tree_greedy` for greedy params, else :func:`verify_tree_sampling`
    with p processed by ``params`` (the tree's q must be processed the same way).

    Args:
        tree: the candidates.
        target_logits: ``(N + 1, V)`` raw target logits over ``[root, nodes]``.
        params: the request's sampling parameters.
        generator: the request's own randomness (not drawn from when greedy).
    """
    if target_logits.shape[0] != tree.num_nodes + 1:
        raise SpecdraftError(f"{target_logits.shape[0]} logit rows for a tree of {tree.num_nodes} nodes")
    if params.greedy:
        return verify_tree_greedy(tree, target_logits)
    return verify_tree_sampling(tree, logits_to_probs(target_logits, params), generator)
