"""Suffix decoding: the most frequent continuations of the context's longest repeated suffix.

As vLLM's ``suffix`` method (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975; Snowflake's
Arctic Inference), without a model: find the longest suffix of the row's context (up to ``max_n``
tokens) that occurred earlier in the request's prompt and output, and, opt-in, in the outputs of
earlier requests of this process; count the continuations that followed its occurrences (the most
recent ``max_occurrences``), and propose the most likely ones as a token tree, best first: a node's
probability is the product of ``count(child) / count(parent)`` along its path, nodes below
``min_prob`` are left out, and at most k nodes are proposed (k from the policy: "at most k nodes").

The index is a dict from each n-gram (n <= ``max_n``) to the positions where it ends, updated
incrementally as tokens are committed (:class:`~specdraft.drafters.ngram.NgramIndex`); a suffix
automaton would find longer matches, but matches past ``max_n`` tokens add little here. Drafts are
point masses (no q), so sampling verification is exact whatever the tree. The chain path of the
engine verifies the tree's first path (each node's most likely child), which is also
``Proposal.tokens``.

Draft spec: ``suffix[:N][,shared][,chain]`` (n-grams up to N, default 8; ``shared``: also match the
outputs of earlier requests in this process, which lets one request's text shape another's timing;
``chain``: propose only the tree's first path, as a chain, to compare tree and chain).
"""

from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F

from specdraft.drafters.base import DraftContext, Proposal
from specdraft.drafters.ngram import SEP, NgramIndex, NgramState
from specdraft.tree import TokenTree


def frequency_tree(conts: list[list[int]], k: int, min_prob: float, branch: bool = True) -> TokenTree:
    """The at most k most likely nodes of the continuations' trie, best first.

    A node's probability is the product of ``count(child) / count(parent)`` along its path, which
    is ``count(node) / len(conts)``; children are never likelier than their parent, so taking nodes
    from a heap in order of probability yields parents first and each node's likeliest child first.
    Ties go to the shallower node, then to the latest occurrence (``conts`` is latest first).
    ``branch=False``: only the likeliest child of each node taken (a chain of up to k tokens).
    """
    kids: list[dict[int, int]] = [{}]  # trie: node -> {token: node}; node 0 is the root
    count, token = [len(conts)], [-1]
    for cont in conts:
        node = 0
        for t in cont:
            nxt = kids[node].get(t)
            if nxt is None:
                nxt = kids[node][t] = len(kids)
                kids.append({})
                count.append(0)
                token.append(t)
            count[nxt] += 1
            node = nxt
    tokens, parents = [], []
    heap = [(-count[c], 1, c, -1) for c in kids[0].values()]  # (-count, depth, trie node, out parent)
    heapq.heapify(heap)
    while heap and len(tokens) < k:
        neg, depth, node, parent = heapq.heappop(heap)
        if -neg < min_prob * count[0]:
            break
        tokens.append(token[node])
        parents.append(parent)
        if not branch:
            heap.clear()
        for c in kids[node].values():
            heapq.heappush(heap, (-count[c], depth + 1, c, len(tokens) - 1))
    return TokenTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))


def first_path(tree: TokenTree) -> list[int]:
    """The nodes of the path that follows each node's first child from the root."""
    path, node = [], -1
    for i, parent in enumerate(tree.parents.tolist()):
        if parent == node:
            path.append(i)
            node = i
    return path


def tree_proposal(
    trees: list[TokenTree], k: int, bucket: list[int] | None = None, as_trees: bool = True
) -> Proposal:
    """A proposal carrying each row's tree (``as_trees``; else a chain proposal); ``tokens`` holds
    each tree's first path, which is what a chain step verifies, and ``probs`` its nodes' q rows
    when the trees carry them (point masses for a row whose tree does not)."""
    B = len(trees)
    tokens = torch.zeros(B, k, dtype=torch.int64)
    num_valid = torch.zeros(B, dtype=torch.int64)
    V = next((t.draft_probs.shape[-1] for t in trees if t.draft_probs is not None), None)
    probs = torch.zeros(B, k, V) if V is not None else None  # (B, k, V)
    for b, tree in enumerate(trees):
        path = first_path(tree)[:k]
        tokens[b, : len(path)] = tree.tokens[path]
        num_valid[b] = len(path)
        if probs is not None and path:
            q = tree.draft_probs
            probs[b, : len(path)] = q[path] if q is not None else F.one_hot(tree.tokens[path], V).float()
    bucket_t = torch.tensor(bucket, dtype=torch.int64) if bucket is not None else None
    kept = [t if t.num_nodes else None for t in trees] if as_trees else None
    return Proposal(tokens=tokens, probs=probs, num_valid=num_valid, bucket=bucket_t, trees=kept)


class SuffixState(NgramState):
    """Each row's n-gram index over its committed tokens; rows that leave give their output to the
    shared history (when the drafter has one)."""

    def __init__(self, batch_size: int, max_n: int, history: NgramIndex | None):
        super().__init__(batch_size, max_n)
        self.history = history
        self.first_seen = [-1] * batch_size  # context length at the row's first proposal

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = [int(r) for r in rows]
        if self.history is not None:
            for b in sorted(set(range(self.batch_size)) - set(keep)):
                if self.first_seen[b] >= 0:
                    self.history.extend([SEP, *self.index[b].tokens[self.first_seen[b] :]])
        self.first_seen = [self.first_seen[r] for r in keep]
        super().select_rows(rows)

    def append(self, other: SuffixState) -> None:
        self.first_seen += other.first_seen
        super().append(other)


_HISTORY: dict[int, NgramIndex] = {}  # max_n -> outputs of earlier requests in this process
HISTORY_TOKENS = 20_000  # the shared history's bound: ~33 MB at max_n 8 (every n-gram distinct)


class SuffixDrafter:
    """Frequency-ranked continuations of the longest matched suffix, as a token tree.

    Args:
        max_n: the longest suffix matched.
        shared: also match the outputs of earlier requests in this process.
        max_occurrences: the latest occurrences whose continuations are counted.
        min_prob: nodes less likely than this (by continuation frequency) are not proposed.
        tree: propose the tree; False: only its first path, as a chain (to compare the two).
    """

    name = "suffix"
    vocab_size = None

    def __init__(
        self,
        max_n: int = 8,
        shared: bool = False,
        max_occurrences: int = 32,
        min_prob: float = 0.1,
        tree: bool = True,
    ):
        self.max_n, self.max_occurrences, self.min_prob, self.tree = max_n, max_occurrences, min_prob, tree
        self.proposes_trees = tree  # the engine checks that the target can verify trees
        self.history = _HISTORY.setdefault(max_n, NgramIndex(max_n, HISTORY_TOKENS)) if shared else None

    def new_state(self, batch_size: int, capacity: int) -> SuffixState:
        return SuffixState(batch_size, self.max_n, self.history)

    def candidates(self, index: NgramIndex, k: int) -> tuple[int, list[list[int]]]:
        """The matched length and the continuations (up to k tokens) of the row's context."""
        ctx = index.tokens[-self.max_n :]
        n, ends = index.match(ctx, self.max_occurrences)
        conts = index.continuations(ends, k)
        if self.history is not None:
            n_h, ends_h = self.history.match(ctx, self.max_occurrences)
            if n_h > n:
                n, conts = n_h, []
            if n_h == n and n:
                conts += self.history.continuations(ends_h, k)
        return n, conts

    def propose(self, state: SuffixState, ctx: DraftContext, k: int) -> Proposal:
        trees, matched = [], []
        for b, index in enumerate(state.synced(ctx)):
            if state.first_seen[b] < 0:
                state.first_seen[b] = len(index.tokens)
            n, conts = self.candidates(index, k)
            trees.append(frequency_tree(conts, k, self.min_prob, branch=self.tree))
            matched.append(n)
        return tree_proposal(trees, k, matched, as_trees=self.tree)

    def observe(self, state: SuffixState, num_accepted: torch.Tensor, verified=None) -> None:
        """Index the tokens committed this step now (a row that finishes leaves with them); without
        ``verified`` they are read from the context at the next proposal."""
        if verified is not None:
            for index, committed in zip(state.index, verified.committed):
                index.extend(committed)


def from_spec(spec, target) -> SuffixDrafter:
    """The ``suffix[:N][,shared][,chain]`` factory of :data:`specdraft.registry.DRAFTERS`."""
    opts = [o for o in spec.arg.split(",") if o]
    n = next((int(o) for o in opts if o.isdigit()), 8)
    return SuffixDrafter(max_n=n, shared="shared" in opts, tree="chain" not in opts)
