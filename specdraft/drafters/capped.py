"""A wrapper that caps each row's proposal: ``RowCappedDrafter(inner)`` with ``caps[row]`` set per step.

Lowering a row's ``num_valid`` is exactly what an n-gram drafter with no match does, so it keeps
verification exact (``tests/test_tv_all_drafters.py``); a row with cap 0 decodes plainly. The
server sets the caps from each request's ``speculation`` settings, with
:class:`specdraft.policy.CappedPolicy` bounding the batch's k.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdraft.drafters.base import DraftContext, Drafter, DraftState, Proposal, Verified
from specdraft.tree import TokenTree


def _first_nodes(tree: TokenTree, n: int) -> TokenTree:
    """The tree of ``tree``'s first n nodes."""
    q, src = tree.draft_probs, tree.sources
    return TokenTree(
        tree.tokens[:n], tree.parents[:n], None if q is None else q[:n], None if src is None else src[:n]
    )


class RowCappedDrafter:
    """Wraps a drafter so each row keeps at most ``caps[row]`` of the proposed tokens."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name = inner.name
        self.vocab_size = inner.vocab_size
        self.proposes_trees = getattr(inner, "proposes_trees", False)
        self.caps: torch.Tensor | None = None  # (B,) set by the caller before each step; None: no caps

    def new_state(self, batch_size: int, capacity: int) -> DraftState:
        return self.inner.new_state(batch_size, capacity)

    def propose(self, state: DraftState, ctx: DraftContext, k: int) -> Proposal:
        prop = self.inner.propose(state, ctx, k)
        if self.caps is None:
            return prop
        num_valid = prop.num_valid if prop.num_valid is not None else torch.full((prop.tokens.shape[0],), k)
        caps = self.caps.clamp(max=k)
        trees = prop.trees
        if trees is not None:  # a tree keeps its first cap nodes (parents come first: still a tree)
            trees = [
                None if t is None or c == 0 else _first_nodes(t, c) for t, c in zip(trees, caps.tolist())
            ]
        return replace(prop, num_valid=torch.minimum(num_valid, caps), trees=trees)

    def observe(
        self, state: DraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        self.inner.observe(state, num_accepted, verified)
