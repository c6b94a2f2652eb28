"""Token trees from a draft model's top-k: a static shape, and EAGLE-2's dynamic one.

A chain draft proposes the draft's most likely token at each depth; when the target disagrees at
depth j, everything below is lost, even if the target's choice was the draft's second guess. This
drafter grows a tree of the draft's top tokens instead and lets the target pick the longest
agreeing branch in one forward (:mod:`specdraft.tree`). Two shapes (``k``: the policy's node
budget, ``Proposal.trees`` holds at most k nodes):

- ``static=BxD``: the draft's greedy chain, and at each of the first D depths the draft's next
  B - 1 tokens as leaves beside the chain node (the chain gets the rest of the budget; a sibling
  depth is kept only while the chain keeps at least ``k - (B - 1) * D'`` >= 1 nodes, ``D' <= (k - 1)
  // B``). The draft runs exactly as a chain draft does (one token per forward): the siblings
  cost it nothing, the target verifies ``(B - 1) D'`` more nodes.
- ``dyn=W`` (EAGLE-2, Li et al. 2024, arXiv 2406.16858): at each depth the W candidates of
  highest cumulative draft probability (the product of q along the path, a proxy for the chance
  the target accepts the path) are expanded with their top W tokens, in one draft forward over W
  nodes with a tree attention mask; after k depths every candidate is reranked and the k most
  probable are kept (:func:`specdraft.tree.most_probable`: a node is never more probable than its
  parent, so the kept nodes form a tree).

Sampling: the tree is a function of the draft's logits only (top tokens, never a sample), so each
node is a point mass (``draft_probs = None``): the verifier draws one token from p at each node
and follows the child that carries it (:func:`specdraft.tree.verify_tree_sampling`), which emits
exactly the target's distribution (``tests/test_tv_all_drafters.py``: ``tree-dyn``, ``tree-static``).

The draft's cache: the best candidate of each depth sits at the cache slot of its position (the
slot a chain draft would use), the others past the deepest such slot. While those best candidates
form a path, they are what a chain draft would have cached, so after verification the draft keeps
their entries as far as the committed tokens agree with that path (:meth:`TopKTreeDrafter.observe`)
and feeds the rest at its next proposal, as :class:`~specdraft.drafters.model.ModelDrafter` does.

Feature drafts (EAGLE-style, :mod:`specdraft.drafters.feature_base`: ``designed`` drafts of kind
``feature`` or ``dream``, ``local:designed:...``) grow the same trees (:class:`FeatureTreeDrafter`,
EAGLE-2's own setting): the step's real pairs run first (:meth:`FeatureDrafterBase.start`), then
each fed candidate's input is the pair (its parent's predicted feature, its token) at the position
before its own (siblings share it), with the same slots and tree mask over the draft's cache; a
fused local head reads each candidate's own path. One grow loop (:class:`TreeGrowth`) serves both:
the drafters differ only in how a frontier becomes the draft's input. After verification the
feature draft's cache needs no compaction: the next step's real pairs rewrite the accepted
positions with the target's features (the engine keeps those of the accepted path's columns,
:class:`~specdraft.drafters.base.TargetFeatures`), and no query reaches the tree's other slots.

Draft spec: ``tree:[dyn[=W]|static[=BxD],]DRAFT`` (default ``dyn=2``), e.g.
``tree:designed:smollm2-135m-l2``, ``tree:static=2x2,prune:0,1,2,29`` or
``tree:dyn=3,designed:FEATURE_DRAFT`` (:func:`specdraft.registry.tree_parts`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from specdraft.drafters.base import DraftContext, Proposal, Verified
from specdraft.drafters.feature_base import FeatureDrafterBase, FeatureDraftState
from specdraft.drafters.model import ModelDrafter, ModelDraftState
from specdraft.errors import SpecdraftError
from specdraft.tree import TokenTree, most_probable


@dataclass(frozen=True)
class TreeShape:
    """How the draft's top tokens grow into a tree.

    Attributes:
        dynamic: EAGLE-2's rerank (True) or the static chain-with-siblings shape.
        branch: top tokens taken below each expanded node (static: B; dynamic: W).
        width: nodes expanded per depth (static: 1, the greedy chain; dynamic: W).
        branch_depths: static: the first D depths keep their siblings (unused when dynamic).
    """

    dynamic: bool
    branch: int
    width: int
    branch_depths: int = 0

    def __post_init__(self):
        if self.branch < 2 or self.width < 1:
            raise SpecdraftError(f"a tree needs branch >= 2 and width >= 1, got {self.branch}, {self.width}")

    @classmethod
    def parse(cls, name: str, nums: tuple[int, int]) -> TreeShape:
        """From :func:`specdraft.registry.tree_parts`' shape name and numbers."""
        if name == "dyn":
            return cls(True, nums[0], nums[0])
        return cls(False, nums[0], 1, nums[1])

    def sibling_depths(self, k: int) -> int:
        """Static: the depths whose siblings fit in a budget of k nodes beside a chain of >= 1."""
        return min(self.branch_depths, (k - 1) // self.branch)

    def depth(self, k: int) -> int:
        """Draft depth for a budget of k nodes."""
        return k if self.dynamic else k - (self.branch - 1) * self.sibling_depths(k)

    def keep(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """``(B, M)`` bool, the candidates kept from ``scores (B, M)`` (static: depth-major, B per
        depth, rank 0 the chain node)."""
        if self.dynamic:
            return most_probable(scores, k)
        rank = torch.arange(scores.shape[1]) % self.branch  # (M,)
        depth = torch.arange(scores.shape[1]) // self.branch + 1  # (M,)
        keep = (rank == 0) | (depth <= self.sibling_depths(k))
        return keep.unsqueeze(0) & torch.isfinite(scores)


@dataclass
class Grown:
    """The candidates a draft grew, per row, in topological order.

    Attributes:
        tokens: ``(B, M)`` candidate tokens.
        parents: ``(B, M)`` parent candidate (-1: the root).
        scores: ``(B, M)`` cumulative draft log-probability.
        path: ``(B, depth - 1)`` the best fed candidate's token at each depth (cached at the slot
            of its position).
        path_len: ``(B,)`` how many of them form a path from the root.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    path: torch.Tensor
    path_len: torch.Tensor


@dataclass
class Root:
    """Where a tree grows from (the last committed token), per row.

    Attributes:
        logits: ``(B, 1, V)`` the draft's logits for depth 1.
        first: ``(B,)`` position (and cache slot) of depth 1's fed candidates: a model draft feeds
            a token at its own position (L), a feature draft a pair at the position before (L - 1).
        lo: ``(B,)`` first cache slot of the context they see (slots ``lo .. first - 1``).
        have: ``(B,)`` rows that propose a tree (a feature draft: rows with the target's features).
        carry: what the draft's next feed reads of each frontier node (model: nothing; feature:
            its predicted feature), indexed ``(B, f, ...)``, the root alone at first.
    """

    logits: torch.Tensor
    first: torch.Tensor
    lo: torch.Tensor
    have: torch.Tensor
    carry: tuple = ()


@dataclass
class Placement:
    """Where a depth's fed candidates ``(B, w)`` go in the draft's cache.

    Attributes:
        positions: ``(B, w)`` RoPE positions (siblings share one).
        slots: ``(B, w)`` cache slots: the best at its position's slot, the others past the deepest
            such slot.
        mask: ``(B, w, S)`` what each sees: the context, and its fed ancestors and itself.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


class TreeGrowth:
    """The grow loop both tree drafters share: they differ in how a frontier becomes the draft's
    input (:meth:`_feed`) and in where the root comes from."""

    proposes_trees = True
    source = "model"

    def __init__(self, runtime, shape: TreeShape, name: str):
        core = getattr(runtime, "runtime", runtime)  # under a subset head
        if shape.width > 1 and "slots" not in inspect.signature(core.forward).parameters:
            raise SpecdraftError(f"{name}: a dynamic tree needs a draft on the compact runtime (tree mask)")
        self.shape, self.name, self.runtime = shape, name, runtime

    def propose(self, state, ctx: DraftContext, k: int) -> Proposal:
        B = ctx.lengths.shape[0]
        root = self.root(state, ctx)
        trees = [None] * B
        if root is not None:
            grown = self.grow(state, root, self.shape.depth(k), k if self.shape.dynamic else None)
            trees = self._trees(grown, k, root.have)
            self._grown(state, ctx, grown)
        return Proposal(tokens=torch.zeros(B, 0, dtype=torch.int64), trees=trees)

    def root(self, state, ctx: DraftContext) -> Root | None:
        """Where this step's tree grows from (None: no row proposes)."""
        raise NotImplementedError

    def _grown(self, state, ctx: DraftContext, grown: Grown) -> None:
        """Bookkeeping after a tree was grown (default: none)."""

    def _trees(self, grown: Grown, k: int, rows: torch.Tensor) -> list[TokenTree | None]:
        """The kept candidates of ``rows (B,)`` (bool) as one tree per row (None elsewhere)."""
        keep = self.shape.keep(grown.scores, k)  # (B, M)
        return [
            TokenTree.from_candidates(grown.tokens[b], grown.parents[b], keep[b], self.source)
            if rows[b]
            else None
            for b in range(keep.shape[0])
        ]

    def grow(self, state, root: Root, depth: int, budget: int | None = None) -> Grown:
        """Expand the ``width`` best candidates of each depth with their top ``branch`` tokens,
        ``depth`` levels below the root.

        ``budget`` (the dynamic shape's k): stop early once every row has ``budget`` candidates
        scoring at least its best unexpanded one. A descendant never scores above its ancestor and
        loses ties to earlier candidates, so none could enter the ``budget`` most probable
        (:func:`~specdraft.tree.most_probable`): the kept tree is the same, for fewer draft forwards."""
        B, c, w = root.first.shape[0], self.shape.branch, self.shape.width
        F = w * (depth - 1)  # fed candidates; slot first + o holds the one at offset o
        if F and hasattr(state.kv, "ensure_capacity"):
            state.kv.ensure_capacity(int(root.first.max()) + F + 1)
        anc = torch.zeros(B, 1, F, dtype=torch.bool)  # (B, f, F) fed ancestors of each frontier node
        front = torch.full((B, 1), -1)  # (B, f) candidate index of each frontier node (the root)
        score = torch.zeros(B, 1)  # (B, f)
        logits, carry = root.logits, root.carry
        tokens, parents, scores, path = [], [], [], []
        path_len = torch.zeros(B, dtype=torch.int64)
        for d in range(1, depth + 1):
            top = logits.float().log_softmax(-1).topk(c, dim=-1)  # (B, f, c)
            new_score = (score.unsqueeze(-1) + top.values).flatten(1)  # (B, f * c)
            first = sum(t.shape[1] for t in tokens)
            tokens.append(top.indices.flatten(1))
            parents.append(front.repeat_interleave(c, dim=1))
            scores.append(new_score)
            if d == depth:
                break
            pick = new_score.argsort(dim=1, descending=True, stable=True)[:, :w]  # (B, w) best first
            if budget is not None and self._settled(scores, new_score.gather(1, pick[:, :1]), budget):
                break
            if d > 1:  # the best of depth d continues the path while its parent was the best of d - 1
                path_len += (path_len == d - 1) & (pick[:, 0] // c == 0)
            else:
                path_len += 1
            front, score = first + pick, new_score.gather(1, pick)
            fed = tokens[-1].gather(1, pick)  # (B, w)
            path.append(fed[:, 0])
            anc = self._ancestors(anc, pick // c, d, depth)
            logits, carry = self._feed(state, fed, pick // c, carry, self._place(root, d, depth, anc))
        return Grown(
            torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1),
            torch.stack(path, 1) if path else torch.zeros(B, 0, dtype=torch.int64), path_len,
        )  # fmt: skip

    @staticmethod
    def _settled(scores: list[torch.Tensor], best: torch.Tensor, budget: int) -> bool:
        """Whether every row has ``budget`` candidates scoring at least ``best (B, 1)``, its best
        candidate to expand (:meth:`grow`)."""
        return bool(((torch.cat(scores, 1) >= best).sum(1) >= budget).all())

    def _offsets(self, d: int, depth: int) -> torch.Tensor:
        """``(w,)`` slot offsets of depth d's fed candidates: the best at its position's slot
        (offset d - 1), the others past the deepest such slot."""
        w = self.shape.width
        rest = depth - 1 + (d - 1) * (w - 1) + torch.arange(w - 1)
        return torch.cat([torch.tensor([d - 1]), rest])

    def _ancestors(self, anc: torch.Tensor, rows: torch.Tensor, d: int, depth: int) -> torch.Tensor:
        """``(B, w, F)`` fed ancestors (and self) of depth d's fed candidates, whose parents are
        the previous frontier's ``rows (B, w)``."""
        F = anc.shape[2]
        new = anc.gather(1, rows.unsqueeze(-1).expand(-1, -1, F)).clone()  # (B, w, F)
        new[:, torch.arange(rows.shape[1]), self._offsets(d, depth)] = True
        return new

    def _place(self, root: Root, d: int, depth: int, anc: torch.Tensor) -> Placement:
        """Positions, slots and mask of depth d's fed candidates, whose fed ancestors are ``anc``."""
        B, w, F = anc.shape
        pos = (root.first - 1 + d).unsqueeze(1).expand(B, w)  # (B, w) siblings share a position
        slots = root.first.unsqueeze(1) + self._offsets(d, depth)  # (B, w)
        slot = torch.arange(int(root.first.max()) + F)  # (S,)
        rel = slot - root.first.unsqueeze(1)  # (B, S) slot offset past the context
        seen = anc.gather(2, rel.clamp(0, F - 1).unsqueeze(1).expand(-1, w, -1))  # (B, w, S)
        inside = ((rel >= 0) & (rel < F)).unsqueeze(1)  # (B, 1, S) this row's tree slots
        context = (rel < 0) & (slot >= root.lo.unsqueeze(1))  # (B, S)
        return Placement(pos, slots, context.unsqueeze(1) | (seen & inside))

    def _feed(self, state, fed: torch.Tensor, rows: torch.Tensor, carry: tuple, where: Placement):
        """Run the draft over a depth's fed candidates ``fed (B, w)``, children of the previous
        frontier's ``rows (B, w)``; their logits ``(B, w, V)`` and their carry."""
        raise NotImplementedError


class TopKTreeState(ModelDraftState):
    """The model draft's state, plus each row's cached path (:attr:`Grown.path`)."""

    def __init__(self, runtime, batch_size: int, capacity: int):
        super().__init__(runtime, batch_size, capacity)
        self.path = [[] for _ in range(batch_size)]

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.path = [self.path[int(r)] for r in rows]

    def append(self, other: TopKTreeState) -> None:
        super().append(other)
        self.path += other.path


class TopKTreeDrafter(TreeGrowth):
    """Token trees of a model draft's top tokens (module docstring).

    Args:
        model: the model draft (its runtime drafts; its cache bookkeeping is reused).
        shape: static or dynamic.
        name: shown in statistics.
    """

    def __init__(self, model: ModelDrafter, shape: TreeShape, name: str):
        super().__init__(model.runtime, shape, name)
        self.model, self.vocab_size = model, model.vocab_size

    def new_state(self, batch_size: int, capacity: int) -> TopKTreeState:
        return TopKTreeState(self.runtime, batch_size, capacity)

    def root(self, state: TopKTreeState, ctx: DraftContext) -> Root:
        """Catch up on the committed tokens; the tree grows below the last one (at ``L - 1``)."""
        L = ctx.lengths
        logits = self.model.vocabulary_logits(self.model.catch_up(state, ctx)[0]).unsqueeze(1)  # (B, 1, V)
        return Root(logits, L, torch.zeros_like(L), torch.ones_like(L, dtype=torch.bool))

    def _grown(self, state: TopKTreeState, ctx: DraftContext, grown: Grown) -> None:
        """The draft keeps the best candidates' path as far as the target agrees (:meth:`observe`)."""
        L = ctx.lengths
        state.fed, state.base = L.clone(), L.clone()
        state.path = [grown.path[b, : int(grown.path_len[b])].tolist() for b in range(L.shape[0])]

    def _feed(self, state, fed: torch.Tensor, rows: torch.Tensor, carry: tuple, where: Placement):
        if fed.shape[1] == 1:  # a chain: at the slot of its position, causal
            return self.runtime.forward(state.kv, fed, where.positions).logits, carry
        out = self.runtime.forward(state.kv, fed, where.positions, attn_mask=where.mask, slots=where.slots)
        return out.logits, carry

    def observe(
        self, state: TopKTreeState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        """Keep the cached path as far as the committed tokens follow it (module docstring)."""
        if verified is None:
            return
        for b, (path, committed) in enumerate(zip(state.path, verified.committed)):
            same = 0  # the last committed token stays unfed: the next catch-up reads its logits
            while same < min(len(path), len(committed) - 1) and path[same] == committed[same]:
                same += 1
            state.fed[b] = state.base[b] + same


class FeatureTreeDrafter(TreeGrowth):
    """Token trees of a feature draft's top tokens (EAGLE-2; module docstring).

    Each fed candidate's input is the pair ``(its parent's predicted feature, its token)``; the root's
    feature is the one the step's real pairs predict (:meth:`FeatureDrafterBase.start`).

    Args:
        feature: the feature draft (its runtime drafts; its real pairs and cache are reused).
        shape: static or dynamic.
        name: shown in statistics.
    """

    def __init__(self, feature: FeatureDrafterBase, shape: TreeShape, name: str):
        super().__init__(feature.runtime, shape, name)
        self.feature, self.vocab_size = feature, feature.vocab_size
        self.hidden_layers = feature.hidden_layers

    def new_state(self, batch_size: int, capacity: int) -> FeatureDraftState:
        return self.feature.new_state(batch_size, capacity)

    def root(self, state: FeatureDraftState, ctx: DraftContext) -> Root | None:
        """Feed the step's real pairs; depth 1's pairs sit at ``L - 1`` and read the predicted
        feature there (None: no row has the target's features yet)."""
        begun = self.feature.start(state, ctx)
        if begun is None:
            return None
        recent = None if begun.recent is None else begun.recent.unsqueeze(1)
        carry = (begun.feature.unsqueeze(1), recent, begun.memory)
        first, lo = ctx.lengths - 1, torch.tensor([max(s, 0) for s in state.start])
        return Root(begun.logits.unsqueeze(1), first, lo, begun.have, carry)

    def _feed(self, state, fed: torch.Tensor, rows: torch.Tensor, carry: tuple, where: Placement):
        f, recent, memory = carry  # (B, f, C), (B, f, W) or None (no local head), (B, 1, M, C) or None
        (B, w), C = fed.shape, f.shape[2]
        parent = f.gather(1, rows.unsqueeze(-1).expand(-1, -1, C))  # (B, w, C)
        mem = None if memory is None else memory.expand(-1, w, *memory.shape[2:])
        x = self.feature.inputs(parent, fed, mem)  # (B, w, C)
        logits, f = self.feature._run(state, x, where.positions, where.mask, where.slots)
        if recent is not None:  # a local head's window: the tokens before each child
            recent = recent.gather(1, rows.unsqueeze(-1).expand(-1, -1, recent.shape[2]))  # (B, w, W)
            recent = torch.cat([recent[..., 1:], fed.unsqueeze(-1)], -1)
            fused = self.feature.local.fuse(logits.flatten(0, 1), recent.flatten(0, 1))
            logits = fused.view(B, w, -1)
        return logits, (f, recent, memory)

    def observe(
        self, state: FeatureDraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        """Nothing to do: the next proposal's real pairs overwrite the accepted positions, with the
        features the engine kept along the accepted path (module docstring)."""


def from_spec(spec, target) -> TopKTreeDrafter | FeatureTreeDrafter:
    """The ``tree:[SHAPE,]DRAFT`` factory of :data:`specdraft.registry.DRAFTERS`."""
    from specdraft.registry import build_drafter, tree_parts

    shape, nums, inner = tree_parts(spec.arg)
    draft = build_drafter(inner, target)
    shape = TreeShape.parse(shape, nums)
    if isinstance(draft, ModelDrafter):
        return TopKTreeDrafter(draft, shape, str(spec))
    if isinstance(draft, FeatureDrafterBase) and not getattr(draft, "proposes_trees", False):
        return FeatureTreeDrafter(draft, shape, str(spec))
    raise SpecdraftError(
        f"draft {spec}: {inner!r} gives a {type(draft).__name__}, not a model or feature draft "
        "(a CTC draft grows its own trees; designed:auto without a committed draft is prompt lookup)"
    )
