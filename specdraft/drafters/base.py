"""The drafter protocol: propose k tokens (with q when the drafter has one), or a token tree per
row; observe what the target did with them (:class:`Verified`).

A drafter keeps per-batch state in a :class:`DraftState` (a cache, counters); the engine creates it,
compacts it when rows leave and appends to it when rows join, exactly as it does the target's cache.
New drafters are new files implementing :class:`Drafter`; the loop never special-cases them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specdraft.tree import TokenTree
from specdraft.verify import SamplingParams, greedy_tokens

if TYPE_CHECKING:
    from specdraft.models.subset_head import SubsetHeadRuntime


@dataclass
class Proposal:
    """What a drafter proposes for one step.

    Attributes:
        tokens: ``(B, k)`` draft tokens (junk past ``num_valid``).
        probs: ``(B, k, V)`` the draft distribution q each token was sampled from (processed with
            the same temperature / top-k / top-p as p), or None for drafters without one. Greedy
            runs never need it.
        num_valid: ``(B,)`` how many tokens each row really proposes (None = all k). A drafter
            with nothing to say for a row (an n-gram with no match) proposes 0 there.
        steps: ``(B,)`` draft forwards each row needed, for a drafter that stops early (a batch
            runs the most any row needs); None = k for a draft model. Cost models use it.
        bucket: ``(B,)`` int, the drafter's own class of each row's proposal where some classes
            are accepted far more often than others (prompt lookup: the length of the matched
            n-gram, 0 for none); the cost-aware policy learns acceptance per class and cuts each
            row's proposal to its class's best length. None: one class.
        trees: one :class:`~specdraft.tree.TokenTree` per row (None for a row with nothing to
            propose), at most k nodes each, hung below the last committed token: the engine then
            verifies every node in one target forward and ``tokens`` may be an empty ``(B, 0)``
            tensor. ``policy.trim`` does not cut trees. None: a chain proposal (``tokens``).
        hindsight: per row, first-draft-token outcomes read off positions the target committed
            without a proposal (rows ``DraftContext.hindsight`` asks for; ``[]`` for the others):
            whether the greedy draft token a proposal there would have made is the token committed
            (:meth:`specdraft.drafters.feature_base.FeatureDrafterBase.start`). None: not read.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    num_valid: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    bucket: torch.Tensor | None = None
    trees: list[TokenTree | None] | None = None
    hindsight: list[list[bool]] | None = None


@dataclass
class Verified:
    """What the target did in the last step, per row, for drafters that learn from it (a phrase
    pool keeps the target's own continuations, including those past a rejected draft token).

    Attributes:
        inputs: tokens fed to the target: a chain ``[last, d_1 .. d_k]``, a tree
            ``[root, node_0 .. node_{N-1}]``.
        parents: index into ``inputs`` of each fed token's parent (-1 for index 0; a chain: i - 1).
        target_next: the target's argmax after each fed token (row t of its logits); the engine's
            is computed on first read.
        committed: the tokens committed this step (accepted, then the recovered / bonus token).
    """

    inputs: list[list[int]]
    parents: list[list[int]]
    target_next: Sequence[list[int]]
    committed: list[list[int]]


@dataclass
class TargetFeatures:
    """The target's hidden states at every committed position its forwards computed, whatever the
    steps were (steps without drafts included), position-indexed like the token buffer: the engine
    keeps the prefill's (the prompt's positions) and writes each step's committed positions (a tree
    step: the accepted path's columns) after verification, so a feature drafter can feed the pairs
    it has not fed yet, exactly.

    Attributes:
        hidden: ``{layer: (B, S, C)}`` position p's hidden state at ``[:, p]``, for positions
            ``0 .. lengths - 2`` (zeros beyond).
        answer: ``(B,)`` each row's last prompt position, whose pair is the answer's first (a
            drafter that reads no prompt pairs starts there).
    """

    hidden: dict
    answer: torch.Tensor


@dataclass
class DraftContext:
    """What the engine tells a drafter about the batch before it proposes.

    Attributes:
        tokens: ``(B, S)`` committed token buffer (prompt + output) per row.
        lengths: ``(B,)`` committed tokens per row; the last committed token is at ``lengths - 1``.
        params: sampling parameters per row.
        generators: one per row (the request's own randomness).
        target_hidden: hidden states the engine asked the target for at its last forward
            (``{layer: (B, T, C)}``), for feature-level drafters; empty otherwise.
        target_state: the target's cache (its keys/values up to each row's ``lengths - 2``), for a
            drafter that reads them (FlexDraft's sequential mode, :mod:`specdraft.drafters.flex`).
        features: the target's hidden states at every committed position (:class:`TargetFeatures`),
            kept by the engine for drafters that declare ``hidden_layers``; None otherwise.
        hindsight: ``(B,)`` rows whose first-token outcomes at positions committed without a
            proposal the policy would read (:meth:`specdraft.policy.CostAwareK.hindsight_rows`);
            a drafter that can tell them cheaply returns them in ``Proposal.hindsight``. None: none.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    target_hidden: dict | None = None
    target_state: object = None
    features: TargetFeatures | None = None
    hindsight: list[bool] | None = None

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


class DraftState:
    """Per-batch drafter state. Stateless drafters use this as is."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def select_rows(self, rows: torch.Tensor) -> None:
        self.batch_size = len(rows)

    def append(self, other: DraftState) -> None:
        self.batch_size += other.batch_size

    def lag(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """``(B,)`` committed tokens each row would feed its draft before drafting (its catch-up),
        of ``lengths`` committed; what a policy prices before it probes. None: a drafter that
        feeds nothing (it reads the context at each proposal)."""
        return None


class Drafter(Protocol):
    """Proposes draft tokens. ``name`` is shown in statistics and reports.

    A drafter that proposes token trees (``Proposal.trees``) sets ``proposes_trees = True``, so
    that the engine refuses a target runtime that cannot verify them when it is built. A drafter
    whose proposals cost no model forward, change no state and draw no randomness (prompt lookup)
    sets ``proposes_free = True``: the engine then also proposes for rows the policy has switched
    off, verifies none of it, and tells the policy how the first tokens fared
    (:meth:`specdraft.policy.CostAwareK.shadow`).
    """

    name: str
    vocab_size: int | None

    def new_state(self, batch_size: int, capacity: int) -> DraftState:
        """State for ``batch_size`` new rows whose positions stay below ``capacity``."""
        ...

    def propose(self, state: DraftState, ctx: DraftContext, k: int) -> Proposal:
        """Propose up to k tokens per row following ``ctx.tokens[b, : ctx.lengths[b]]``."""
        ...

    def observe(
        self, state: DraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        """Told after verification how many of the proposed tokens (tree: nodes along the accepted
        path) each row accepted, and what the target computed (:class:`Verified`)."""
        ...


def read_back_rows(ctx: DraftContext, readable: list[bool]) -> list[bool] | None:
    """Rows whose catch-up reads back first-token outcomes (``Proposal.hindsight``): asked by
    ``ctx.hindsight``, greedy (a sampled row's acceptance needs the target's probabilities there,
    which are not kept) and ``readable`` (a position to read before the last); None when no row is."""
    if ctx.hindsight is None or not any(ctx.hindsight):
        return None
    asked = [w and p.greedy and r for w, p, r in zip(ctx.hindsight, ctx.params, readable)]
    return asked if any(asked) else None


def choose_tokens(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one draft token per row from ``(B, V)`` logits: argmax when every row is greedy,
    else sample each sampling row from q (processed like p) and return q too.

    Returns:
        tokens ``(B,)`` and q ``(B, V)`` (None when all rows are greedy).
    """
    if ctx.all_greedy:
        return greedy_tokens(logits), None
    from specdraft.verify import logits_to_probs, sample

    tokens = greedy_tokens(logits)
    q = torch.zeros_like(logits, dtype=torch.float32)
    for b, (params, gen) in enumerate(zip(ctx.params, ctx.generators)):
        if params.greedy:
            q[b, tokens[b]] = 1.0
        else:
            q[b] = logits_to_probs(logits[b], params)
            tokens[b] = sample(q[b], gen)
    return tokens, q


def take_token(
    logits: torch.Tensor,
    ctx: DraftContext,
    draft: torch.Tensor,
    probs: torch.Tensor | None,
    i: int,
    head: SubsetHeadRuntime | None = None,
):
    """Draft token i of every row: ``draft[:, i]`` from :func:`choose_tokens`, and q into ``probs``
    (``(B, k, V)``, allocated on the first sampled token). Returns ``(probs, q)``; q is None when
    every row is greedy. With ``head``, ``logits`` are over its rows (``(B, N)``); the token and q
    are mapped to the full vocabulary (an exact tie between two rows goes to the one listed first
    in the head, not to the lower id)."""
    tokens, q = choose_tokens(logits, ctx)
    if head is not None:
        tokens = head.token_ids[tokens]
        q = None if q is None else head.expand(q, 0.0)
    draft[:, i] = tokens
    if q is not None:
        if probs is None:
            probs = torch.zeros(*draft.shape, q.shape[-1])
        probs[:, i] = q
    return probs, q
