"""The shared base of drafters that read the target's hidden states (EAGLE, DREAM-style).

Such a drafter runs a few decoder layers of its own (a compact runtime, with its own position-indexed
KV cache) over *pairs* ``(f_p, token p + 1)``: ``f_p`` is the target's final hidden state at position
p (after the final norm), handed out by the engine from the target's last forward
(``DraftContext.target_hidden``). Its last hidden state is a predicted ``f_{p+1}``, which the target's
frozen LM head (or a subset of its rows, :class:`~specdraft.models.subset_head.SubsetHeadRuntime`)
turns into the next token; drafting further, the drafter feeds back its own predicted features.

What the base owns, so that each drafter kind only says how a pair becomes the draft's input
(:meth:`FeatureDrafterBase.inputs`):

- which target layers it reads: :attr:`~FeatureDrafterBase.hidden_layers` is ``(-1, *layers)``; the
  engine asks the target for them (``Engine(..., hidden_layers=drafter.hidden_layers)``;
  ``Pipeline.engine`` and the bench harness do it). ``memory`` below holds the extra ``layers``;
- the bookkeeping of which pairs are real: each step it feeds the pairs whose features the target
  computed at its last forward (the positions it verified), then drafts on its own features;
- rollback: the draft's cache is position-indexed, so rolling back to the accepted length is a length
  change. The next proposal writes the first pair after the committed prefix over whatever rejected
  drafts left there, and the attention mask never reaches past the current position, so
  :meth:`~FeatureDrafterBase.observe` has nothing to do (the committed length is read from
  ``ctx.lengths``);
- an optional *local head* fused into every draft position's logits (a product of experts,
  :mod:`specdraft.drafters.local`).

Rows without features yet (the first step after the prompt: the engine's prefill hands none out)
propose nothing that step. Wrong or missing features can only cost acceptance: verification is
unchanged, so every drafter built on this base is lossless.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal, Verified, take_token
from specdraft.models.subset_head import SubsetHeadRuntime


class FeatureDraftState(DraftState):
    """The feature draft's cache, and where each row's target features are.

    Attributes:
        src: ``(B,)`` row of the last target forward's hidden states that belongs to each row
            (-1: a row that joined since, or none yet).
        prev_L: ``(B,)`` committed length when that forward ran (-1: unknown).
        start: ``(B,)`` first position of the draft's context; cache slots before it are masked
            (-1: no context yet).
        paths: per row, the columns of the last target forward's hidden states along the accepted
            path (root first) after a token-tree step, or None where they are a chain's ``0, 1, ..``
            (:func:`accepted_columns`).
    """

    def __init__(self, runtime, batch_size: int, capacity: int):
        super().__init__(batch_size)
        self.kv = runtime.new_state(batch_size, capacity)
        self.src = torch.full((batch_size,), -1, dtype=torch.int64)
        self.prev_L = torch.full((batch_size,), -1, dtype=torch.int64)
        self.start = torch.full((batch_size,), -1, dtype=torch.int64)
        self.paths: list[list[int] | None] = [None] * batch_size

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.kv.select_rows(rows)
        self.src, self.prev_L, self.start = self.src[rows], self.prev_L[rows], self.start[rows]
        self.paths = [self.paths[i] for i in rows.tolist()]

    def append(self, other: FeatureDraftState) -> None:
        super().append(other)
        self.kv.append(other.kv)
        self.src = torch.cat([self.src, torch.full_like(other.src, -1)])
        self.prev_L = torch.cat([self.prev_L, other.prev_L])
        self.start = torch.cat([self.start, other.start])
        self.paths = self.paths + [None] * other.batch_size


@dataclass
class RealPairs:
    """The pairs with real target features a step feeds first (right-padded per row).

    Attributes:
        have: ``(B,)`` rows that have features (the others propose nothing).
        count: ``(B,)`` real pairs per row (1 for rows without features: a padding pair).
        positions: ``(B, C)`` their positions ``L-1-count .. L-2``, padding continuing after.
        valid: ``(B, C)`` which columns are real pairs.
    """

    have: torch.Tensor
    count: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


@dataclass
class Start:
    """Where drafting continues after a step's real pairs (:meth:`FeatureDrafterBase.start`).

    Attributes:
        have: ``(B,)`` rows with features (the others propose nothing).
        logits: ``(B, V)`` the draft's logits for the first draft token (a local head fused in).
        feature: ``(B, C)`` the draft's predicted feature at position ``L - 1``, which the first
            draft token's pair reads.
        memory: ``(B, 1, M, C)`` the target's :attr:`~FeatureDrafterBase.layers` at the last real
            pair, which drafted pairs read (None without layers).
        recent: ``(B, W)`` the tokens before the first draft token (a local head's window).
    """

    have: torch.Tensor
    logits: torch.Tensor
    feature: torch.Tensor
    memory: torch.Tensor | None
    recent: torch.Tensor


class FeatureDrafterBase:
    """A drafter over the target's hidden states (module docstring).

    Args:
        runtime: the draft's runtime (a :class:`LlamaRuntime`, maybe inside a
            :class:`SubsetHeadRuntime`); its embedding table is replaced per call by the inputs it
            should read.
        embed: ``(V, C)`` the target's token embedding.
        name: shown in statistics.
        layers: target layers read besides the final hidden state (compact-runtime indices: layer
            i's output), handed to :meth:`inputs` as ``memory``.
        local: a local head fused into the draft's logits (:class:`~specdraft.drafters.local.LocalHead`),
            or None.
    """

    def __init__(self, runtime, embed: torch.Tensor, name: str, layers=(), local=None):
        self.runtime = runtime
        self.core = runtime.runtime if isinstance(runtime, SubsetHeadRuntime) else runtime
        self.core.w = dataclasses.replace(self.core.w)  # its own weights record: .embed is rewritten per call
        self.embed = embed
        self.name = name
        self.vocab_size = runtime.vocab_size
        self.layers = tuple(layers)
        self.local = local

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target hidden states the engine must hand out: the final one, then :attr:`layers`."""
        return (-1, *self.layers)

    def inputs(self, feats: torch.Tensor, tokens: torch.Tensor, memory: torch.Tensor | None) -> torch.Tensor:
        """The draft's input ``(B, T, C)`` for pairs ``(feats (B, T, C), tokens (B, T))``; ``memory``
        ``(B, T, M, C)`` holds the target's :attr:`layers` at each pair (None when there are none)."""
        raise NotImplementedError

    def new_state(self, batch_size: int, capacity: int) -> FeatureDraftState:
        return FeatureDraftState(self.runtime, batch_size, capacity)

    def observe(
        self, state: FeatureDraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        pass  # rollback is a length change: the next proposal reads the committed length (module docstring)

    def _run(
        self, state, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, slots=None, index=None
    ):
        """Run the draft over inputs ``x (B, T, C)`` at ``positions (B, T)`` (cache ``slots``, default
        the positions) under ``mask (B, T, S)``; its logits and features at columns ``index (B, I)``
        (None: every column), ``(B, I, V)`` and ``(B, I, C)``."""
        B, T, C = x.shape
        self.core.w.embed = x.reshape(B * T, C)
        rows = torch.arange(B * T).view(B, T)  # (B, T) rows of the embedding table set above
        kw = {} if slots is None else {"slots": slots}
        out = self.runtime.forward(
            state.kv, rows, positions, hidden_layers=(-1,), attn_mask=mask, logits_index=index, **kw
        )
        f = (
            out.hidden[-1]
            if index is None
            else out.hidden[-1].gather(1, index.unsqueeze(-1).expand(-1, -1, C))
        )
        return out.logits, f

    def _forward(self, state, x: torch.Tensor, positions: torch.Tensor, index=None):
        """Run the draft causally over inputs ``x (B, T, C)`` (each query sees the row's context from
        ``state.start`` up to its position); full logits at ``index`` (or the last column) and the
        draft's feature there ``(B, C)``."""
        B, T, _ = x.shape
        slots = torch.arange(int(positions.max()) + 1)
        mask = (slots >= state.start.view(B, 1, 1)) & (slots <= positions.unsqueeze(-1))  # (B, T, S)
        index = torch.full((B, 1), T - 1) if index is None else index
        logits, f = self._run(state, x, positions, mask, index=index)
        return logits[:, 0], f[:, 0]

    def _real_pairs(self, state: FeatureDraftState, L: torch.Tensor, T_prev: int, have) -> RealPairs:
        """Which pairs have real features this step; moves ``state.start`` where the context restarts."""
        known = state.prev_L >= 0
        c = torch.where(known, L - state.prev_L, torch.full_like(L, T_prev)).clamp(1, T_prev)
        c = torch.where(have, c, torch.ones_like(c))
        gap = ~known | (L - state.prev_L > T_prev) | (state.start < 0)
        state.start = torch.where(have & gap, L - 1 - c, state.start)
        j = torch.arange(int(c.max()))
        return RealPairs(have, c, (L - 1 - c).unsqueeze(1) + j, j < c.unsqueeze(1))

    @staticmethod
    def _chain_hidden(state: FeatureDraftState, hid: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
        """The last target forward's ``hid (B', T', C)`` -> ``(B, T', C)`` per row (via ``state.src``),
        the accepted path's columns first (chain order) after a token-tree step (``state.paths``).

        A path describes the last target forward only while the row committed exactly its tokens
        since (``L - prev_L``): a step without drafts (k = 0, which the drafter never observes) ran
        another forward, a chain one, whose columns are already in order."""
        rows = hid[state.src.clamp(min=0)]
        fresh = [
            p if p is not None and len(p) == n else None
            for p, n in zip(state.paths, (L - state.prev_L).tolist())
        ]
        if all(path is None for path in fresh):
            return rows
        cols = torch.arange(hid.shape[1]).repeat(len(fresh), 1)  # (B, T')
        for b, path in enumerate(fresh):
            if path is not None:
                cols[b, : len(path)] = torch.tensor(path)
        return rows.gather(1, cols.unsqueeze(-1).expand(-1, -1, hid.shape[2]))

    @staticmethod
    def _gather(hid: torch.Tensor, src: torch.Tensor, pairs: RealPairs) -> torch.Tensor:
        """``(B', T', C)`` hidden states of the last target forward -> ``(B, C_max, C)`` per pair (zeros
        at padding)."""
        C = pairs.positions.shape[1]
        feats = hid[src.clamp(min=0)][:, :C]
        if feats.shape[1] < C:
            feats = torch.cat([feats, feats.new_zeros(feats.shape[0], C - feats.shape[1], feats.shape[2])], 1)
        return feats * pairs.valid.unsqueeze(-1)

    def start(self, state: FeatureDraftState, ctx: DraftContext) -> Start | None:
        """Feed the step's real pairs (the target's features at the positions it verified last) in
        one forward: where drafting continues (None when no row has features yet). Records this
        step's target forward as the next step's source of features."""
        B, L = ctx.lengths.shape[0], ctx.lengths
        hidden = ctx.target_hidden or {}
        ok = all(i in hidden for i in self.hidden_layers)
        if ok:  # a source row past the last forward's rows: plain steps ran after rows left the
            # batch, and the row starts over as a new one (instead of an IndexError)
            rows = hidden[self.hidden_layers[0]].shape[0]
            state.src = torch.where(state.src < rows, state.src, -1)
        have = state.src >= 0 if ok else torch.zeros(B, dtype=torch.bool)
        begun = self._real_forward(state, ctx, hidden, have) if bool(have.any()) else None
        state.src, state.prev_L, state.paths = torch.arange(B), L.clone(), [None] * B
        return begun

    def _real_forward(self, state: FeatureDraftState, ctx: DraftContext, hidden: dict, have) -> Start:
        B, L = ctx.lengths.shape[0], ctx.lengths
        hid = {i: self._chain_hidden(state, hidden[i], L) for i in self.hidden_layers}  # (B, T', C) each
        pairs = self._real_pairs(state, L, hid[-1].shape[1], have)
        rows = torch.arange(B)
        feats = self._gather(hid[-1], rows, pairs)  # (B, C_max, dim)
        memory = None
        if self.layers:  # (B, C_max, M, dim)
            memory = torch.stack([self._gather(hid[i], rows, pairs) for i in self.layers], 2)
        tok = ctx.tokens.gather(1, (pairs.positions + 1).clamp(max=ctx.tokens.shape[1] - 1))  # p + 1
        last = (pairs.count - 1).unsqueeze(1)  # (B, 1) the last real pair
        logits, f = self._forward(state, self.inputs(feats, tok, memory), pairs.positions, last)
        if memory is not None:  # drafted pairs read the last real pair's target layers
            memory = memory.gather(1, last.view(B, 1, 1, 1).expand(-1, 1, *memory.shape[2:]))
        W = self.local.window if self.local is not None else 1
        recent = ctx.tokens.gather(1, (L.unsqueeze(1) - W + torch.arange(W)).clamp(min=0))  # (B, W)
        if self.local is not None:
            logits = self.local.fuse(logits, recent)
        return Start(have, logits, f, memory, recent)

    def propose(self, state: FeatureDraftState, ctx: DraftContext, k: int) -> Proposal:
        B, L = ctx.lengths.shape[0], ctx.lengths
        draft = torch.zeros(B, k, dtype=torch.int64)
        begun = self.start(state, ctx)
        if begun is None:
            return Proposal(tokens=draft, num_valid=torch.zeros(B, dtype=torch.int64))
        logits, f, recent, probs = begun.logits, begun.feature, begun.recent, None
        for i in range(k):
            probs, _ = take_token(logits, ctx, draft, probs, i)
            if i + 1 < k:  # pair (f_hat at L-2+i+1, d_i) at position L-1+i
                x = self.inputs(f.unsqueeze(1), draft[:, i : i + 1], begun.memory)
                logits, f = self._forward(state, x, (L - 1 + i).unsqueeze(1))
                if self.local is not None:  # the tokens before draft i + 1
                    recent = torch.cat([recent[:, 1:], draft[:, i : i + 1]], 1)
                    logits = self.local.fuse(logits, recent)
        return Proposal(tokens=draft, probs=probs, num_valid=torch.where(begun.have, k, 0))


def accepted_columns(verified: Verified, num_accepted: torch.Tensor) -> list[list[int]]:
    """Per row, the columns of a token-tree step's target forward ``[root, nodes]`` along the
    accepted path, root first: from the root, the first child carrying each accepted token (the
    rule of :mod:`specdraft.tree` never follows a repeated sibling)."""
    paths = []
    for b, (fed, parents, committed) in enumerate(zip(verified.inputs, verified.parents, verified.committed)):
        path = [0]
        for tok in committed[: int(num_accepted[b])]:
            nxt = [i for i, (t, p) in enumerate(zip(fed, parents)) if p == path[-1] and t == tok]
            if not nxt:
                break
            path.append(nxt[0])
        paths.append(path)
    return paths
