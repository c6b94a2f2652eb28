"""The shared base of drafters that read the target's hidden states (EAGLE, DREAM-style).

Such a drafter runs a few decoder layers of its own (a compact runtime, with its own position-indexed
KV cache) over *pairs* ``(f_p, token p + 1)``: ``f_p`` is the target's final hidden state at position
p (after the final norm), kept by the engine for every position its forwards committed
(``DraftContext.features``, :class:`~specdraft.drafters.base.TargetFeatures`). Its last hidden
state is a predicted ``f_{p+1}``, which the target's frozen LM head (or a subset of its rows,
:class:`~specdraft.models.subset_head.SubsetHeadRuntime`) turns into the next token; drafting
further, the drafter feeds back its own predicted features.

What the base owns, so that each drafter kind only says how a pair becomes the draft's input
(:meth:`FeatureDrafterBase.inputs`):

- which target layers it reads: :attr:`~FeatureDrafterBase.hidden_layers` is ``(-1, *layers)``; the
  engine asks the target for them (an ``Engine`` over the drafter does by default: its
  ``hidden_layers`` are the drafter's). ``memory`` below holds the extra ``layers``;
- the bookkeeping of which pairs are real: each proposal first feeds every pair it has not fed yet
  (positions ``fed .. L - 2``, in one draft forward), then drafts on its own features. Steps without
  drafts (k = 0: ``--k auto``, the policy's plain probes) never reach the drafter, but their
  features are kept by the engine all the same, so the draft's context is the same whatever steps
  ran in between: every pair from the row's first decoded position on;
- its cache: a row's pairs from its context start on, pair p at slot ``p - start`` (at RoPE position
  ``p - start`` too: scores depend on position differences only), so a causal draft step needs no
  mask and runs on the native kernels as a decode step does (:meth:`FeatureDrafterBase._run`);
- rollback: the draft's cache is indexed by position, so rolling back to the accepted length is a length
  change. The next proposal writes the first pair after the committed prefix over whatever rejected
  drafts left there, and the attention mask never reaches past the current position, so
  :meth:`~FeatureDrafterBase.observe` has nothing to do (the committed length is read from
  ``ctx.lengths``);
- an optional *local head* fused into every draft position's logits (a product of experts,
  :mod:`specdraft.drafters.local`).

The draft's context starts ``prompt_pairs`` pairs before the last prompt position (the engine keeps
the prefill's features): 0 for a draft trained on the answer's pairs only, more for one trained to
read the prompt too (it can copy from it, as EAGLE does). Rows without features yet propose nothing.
After a stretch of more than ``max_lag`` steps without drafts, a row's context starts over at its
last ``max_lag`` pairs instead of feeding them all (:attr:`FeatureDrafterBase.max_lag`); so does a row
whose first proposal comes that late (it feeds its ``prompt_pairs`` when they are more).
Wrong or missing features can only cost acceptance: verification is unchanged, so every drafter
built on this base is lossless.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal, Verified, read_back_rows, take_token
from specdraft.models.subset_head import SubsetHeadRuntime
from specdraft.verify import greedy_tokens


class FeatureDraftState(DraftState):
    """The feature draft's cache, and which pairs it holds.

    Attributes:
        fed: per row, the first position whose real pair the cache does not hold yet (-1: a row
            that has not proposed yet); pairs ``start .. fed - 1`` are in it.
        start: per row, the first position of the draft's context (the row's first with target
            features); cache slots before it are masked (-1: no context yet).
        answer: each row's last prompt position as :meth:`lag` first saw it (at the row's first
            step its length is its prompt's); -1 before.
    """

    def __init__(self, runtime, batch_size: int, capacity: int, prompt_pairs: int = 0, max_lag: int = 16):
        super().__init__(batch_size)
        self.prompt_pairs, self.max_lag = prompt_pairs, max_lag
        self.kv = runtime.new_state(batch_size, capacity)
        # lists, not tensors: read and written at every proposal, right after a forward
        # (results/step-overhead-2026-12-05)
        self.fed, self.start = [-1] * batch_size, [-1] * batch_size
        self.answer = [-1] * batch_size

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.kv.select_rows(rows)
        keep = rows.tolist()
        self.fed, self.start = [self.fed[r] for r in keep], [self.start[r] for r in keep]
        self.answer = [self.answer[r] for r in keep]

    def append(self, other: FeatureDraftState) -> None:
        super().append(other)
        self.kv.append(other.kv)
        self.fed, self.start = self.fed + other.fed, self.start + other.start
        self.answer = self.answer + other.answer

    @property
    def first_bound(self) -> int:
        """The most pairs a row's first proposal feeds: its ``prompt_pairs``, or ``max_lag`` answer
        pairs when its first proposal comes after a longer stretch without drafts."""
        return max(self.max_lag, self.prompt_pairs)

    def lag(self, lengths: torch.Tensor) -> torch.Tensor:
        """Pairs ``fed .. L - 2`` not fed yet, at most ``max_lag`` (the context starts over beyond);
        a row that has not proposed counts the pairs its first proposal will feed, from
        ``prompt_pairs`` before its last prompt position on, at most :attr:`first_bound`."""
        # lists, not tensor operations: the engine asks at every step, right after a forward
        # (results/step-overhead-2026-12-05)
        lag = []
        for b, (L, f) in enumerate(zip(lengths.tolist(), self.fed)):
            if f >= 0:
                lag.append(min(L - 1 - f, self.max_lag))
                continue
            if self.answer[b] < 0:  # the row's first step
                self.answer[b] = L - 1
            lag.append(min(L - 1 - max(self.answer[b] - self.prompt_pairs, 0), self.first_bound))
        return torch.tensor(lag, dtype=torch.int64)


@dataclass
class RealPairs:
    """The pairs with real target features a proposal feeds first (right-padded per row).

    Attributes:
        have: ``(B,)`` rows with pairs to feed (the others propose nothing).
        last: ``(B, 1)`` each row's last real pair's column (0 for rows without: a padding pair).
        positions: ``(B, P)`` their positions ``fed .. L - 2``, padding continuing after.
        tokens: ``(B, P)`` each pair's token, the one at position p + 1.
        feats: ``(B, P, C)`` the target's final hidden state at each (zeros at padding).
        memory: ``(B, P, M, C)`` the target's :attr:`~FeatureDrafterBase.layers` at each (None
            without layers).
    """

    have: torch.Tensor
    last: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    feats: torch.Tensor
    memory: torch.Tensor | None


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
        recent: ``(B, W)`` the tokens before the first draft token (a local head's window; None
            without a local head).
        hindsight: first-token outcomes read back at the real pairs (``Proposal.hindsight``), None
            when none were asked for.
    """

    have: torch.Tensor
    logits: torch.Tensor
    feature: torch.Tensor
    memory: torch.Tensor | None
    recent: torch.Tensor | None
    hindsight: list[list[bool]] | None = None


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
        prompt_pairs: prompt pairs read before the last prompt position (module docstring).

    Attributes:
        subset: the runtime when it is a :class:`SubsetHeadRuntime` (a head over some of the
            vocabulary, whose own rows :meth:`propose` drafts over), else None.
        max_lag: the most pairs a row feeds at once (a first proposal: its ``prompt_pairs`` when
            they are more: :attr:`FeatureDraftState.first_bound`). After a longer
            stretch of steps without drafts (``--k auto`` at k = 0, a row switched off) its context
            starts over at its last ``max_lag`` pairs: the target's features carry the context,
            and the draft's attention over its older pairs adds little. A catch-up forward over P
            pairs costs about what P tokens of the draft do (the committed SmolLM2 feature draft
            at bf16, 2 threads: 1.15 ms at 1, 2.73 ms at 16, 14.18 ms at 128,
            ``results/policy-cusum-2026-12-05/catchup.txt``); without the bound, a probe after a
            long plain stretch priced its catch-up so high that the policy waited longer, and the
            catch-up grew.
    """

    max_lag: int = 16

    @property
    def read_back(self) -> int:
        """First-token outcomes a catch-up reads back at most (:meth:`start`): its pairs but the last."""
        return self.max_lag - 1

    def __init__(self, runtime, embed: torch.Tensor, name: str, layers=(), local=None, prompt_pairs: int = 0):
        self.runtime = runtime
        self.subset = runtime if isinstance(runtime, SubsetHeadRuntime) else None  # a head over some tokens
        self.core = runtime if self.subset is None else runtime.runtime
        self.core.w = dataclasses.replace(self.core.w)  # its own weights record: .embed is rewritten per call
        self.embed = embed
        self.name = name
        self.vocab_size = runtime.vocab_size
        self.layers = tuple(layers)
        self.local = local
        self.prompt_pairs = prompt_pairs

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target hidden states the engine must hand out: the final one, then :attr:`layers`."""
        return (-1, *self.layers)

    def inputs(self, feats: torch.Tensor, tokens: torch.Tensor, memory: torch.Tensor | None) -> torch.Tensor:
        """The draft's input ``(B, T, C)`` for pairs ``(feats (B, T, C), tokens (B, T))``; ``memory``
        ``(B, T, M, C)`` holds the target's :attr:`layers` at each pair (None when there are none)."""
        raise NotImplementedError

    def new_state(self, batch_size: int, capacity: int) -> FeatureDraftState:
        return FeatureDraftState(self.runtime, batch_size, capacity, self.prompt_pairs, self.max_lag)

    def observe(
        self, state: FeatureDraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        pass  # rollback is a length change: the next proposal reads the committed length (module docstring)

    def _run(
        self, state, x: torch.Tensor, positions: torch.Tensor, mask=None, slots=None, index=None, rows=False
    ):
        """Run the draft over inputs ``x (B, T, C)`` at ``positions (B, T)``; its logits and features
        at columns ``index (B, I)`` (None: every column), ``(B, I, V)`` and ``(B, I, C)``; with
        ``rows``, the logits over a subset head's own rows ``(B, I, N)`` (:attr:`subset`: not expanded
        to the vocabulary: filling and scanning its V columns at every draft token is work the chain's
        greedy and sampled tokens do not need, results/feature-draft-cost-2026-12-05/).

        Positions, cache ``slots`` (default: the positions) and ``mask (B, T, S)`` (None: causal from
        the row's ``state.start``) are the row's own. The cache holds the row's context from
        ``state.start`` on, pair p at slot ``p - start`` and rotated at that relative position (RoPE
        scores depend on position differences only, so this is the draft trained at absolute
        positions): a causal step needs no mask and runs on the native kernels like a decode step.
        """
        B, T, C = x.shape
        base = torch.tensor([[max(s, 0)] for s in state.start])  # (B, 1)
        kw = {}
        if mask is not None:  # slot s of the row's mask is slot s - start of its cache
            S = mask.shape[-1]
            shifted = torch.arange(S).view(1, 1, S) + base.view(B, 1, 1)  # (B, 1, S)
            mask = mask.gather(-1, shifted.clamp(max=S - 1).expand(B, T, S)) & (shifted < S)
            kw = {"attn_mask": mask, "slots": (positions if slots is None else slots) - base}
        self.core.w.embed = x.reshape(B * T, C)  # the tokens fed are its rows 0 .. B T - 1
        model = self.core if rows else self.runtime
        out = model.forward(
            state.kv,
            torch.arange(B * T).view(B, T),
            positions - base,
            hidden_layers=(-1,),
            logits_index=index,
            **kw,
        )
        f = (
            out.hidden[-1]
            if index is None
            else out.hidden[-1].gather(1, index.unsqueeze(-1).expand(-1, -1, C))
        )
        return out.logits, f

    def _forward(self, state, x: torch.Tensor, positions: torch.Tensor, index=None, rows=False):
        """Run the draft causally over inputs ``x (B, T, C)`` (each query sees the row's context from
        ``state.start`` up to its position); logits at ``index`` (or the last column; over the vocabulary,
        or a subset head's ``rows``: :meth:`_run`) and the draft's feature there ``(B, C)``."""
        B, T, _ = x.shape
        index = torch.full((B, 1), T - 1) if index is None else index
        logits, f = self._run(state, x, positions, index=index, rows=rows)
        return logits[:, 0], f[:, 0]

    def _real_pairs(self, state: FeatureDraftState, ctx: DraftContext) -> RealPairs | None:
        """The pairs the draft's cache lacks: positions ``state.fed .. L - 2`` (from ``prompt_pairs``
        before the row's last prompt position at its first proposal), however many steps ran since
        (the last ``max_lag`` of them after a longer stretch: its context starts over there), marked
        fed; None when the engine keeps none of the target layers this drafter reads, or no row has a
        pair to feed. Per-row arithmetic in Python lists, a few tensors built at the end: this runs
        at every proposal, right after a forward (``results/step-overhead-2026-12-05``)."""
        kept = ctx.features
        if kept is None or not all(i in kept.hidden for i in self.hidden_layers):
            return None
        lengths, fed, start = ctx.lengths.tolist(), list(state.fed), list(state.start)
        for b, (L, f, answer) in enumerate(zip(lengths, fed, kept.answer.tolist())):
            if f < 0:  # a first proposal: prompt_pairs before the answer, at most first_bound back
                start[b] = fed[b] = max(answer - self.prompt_pairs, 0, L - 1 - state.first_bound)
            elif L - 1 - f > self.max_lag:  # the context starts over
                start[b] = fed[b] = L - 1 - self.max_lag
        count = [L - 1 - f for L, f in zip(lengths, fed)]
        if max(count) <= 0:
            state.fed, state.start = fed, start
            return None
        P, top = max(count), min(kept.hidden[-1].shape[1], state.kv.capacity) - 1  # padding stays inside
        positions = [[min(f + j, top) for j in range(P)] for f in fed]
        cols = ctx.tokens.shape[1] - 1
        tokens = ctx.tokens.gather(1, torch.tensor([[min(p + 1, cols) for p in row] for row in positions]))
        state.start = start
        state.fed = [L - 1 if c > 0 else f for L, f, c in zip(lengths, fed, count)]
        where = torch.tensor(positions).unsqueeze(-1)  # (B, P, 1)
        n = [max(c, 1) for c in count]  # a row without pairs feeds one padding pair
        valid = None if min(n) == P else torch.tensor([[j < c for j in range(P)] for c in n])

        def at(i: int) -> torch.Tensor:  # (B, P, C) layer i at the pairs' positions, zeros at padding
            h = kept.hidden[i]
            h = h.gather(1, where.expand(-1, -1, h.shape[2]))
            return h if valid is None else h * valid.unsqueeze(-1)

        memory = torch.stack([at(i) for i in self.layers], 2) if self.layers else None
        last = torch.tensor([[c - 1] for c in n])
        have = torch.tensor([c > 0 for c in count])
        return RealPairs(have, last, where.squeeze(-1), tokens, at(-1), memory)

    def start(
        self, state: FeatureDraftState, ctx: DraftContext, hindsight: bool = False, rows: bool = False
    ) -> Start | None:
        """Feed the pairs not fed yet (:meth:`_real_pairs`) in one forward: where drafting continues
        (None when no row has a pair to feed). With ``hindsight``, the rows ``ctx.hindsight`` asks
        for also get their first-token outcomes at the pairs before their last (:meth:`_asked`).
        With ``rows`` (no local head), ``Start.logits`` are over a subset head's own rows (:meth:`_run`).

        Why they are free to read: the pair at position p predicts the token at p + 2, so each real
        pair but the last predicts a token the target has committed already; the draft token a
        proposal at that length would have made is that prediction (same pairs in the cache
        before it), and greedy verification accepts it exactly when it is the committed token. A
        catch-up after steps without drafts thus tells what proposals there would have got, for
        the head's rows over the extra pairs (results/hindsight-2026-12-05/)."""
        pairs = self._real_pairs(state, ctx)
        if pairs is None:
            return None
        B, L = ctx.lengths.shape[0], ctx.lengths
        x = self.inputs(pairs.feats, pairs.tokens, pairs.memory)
        asked = self._asked(pairs, ctx) if hindsight else None
        if asked is None:
            logits, f, seen = *self._forward(state, x, pairs.positions, pairs.last, rows), None
        else:  # logits at every pair: the last real one continues, the others are read back
            P = x.shape[1]
            every, feats = self._run(state, x, pairs.positions, index=torch.arange(P).expand(B, P), rows=rows)
            logits, f = (
                t.gather(1, pairs.last.view(B, 1, 1).expand(-1, 1, t.shape[-1]))[:, 0] for t in (every, feats)
            )
            seen = self._read_back(every, pairs, asked, rows)
        memory = pairs.memory
        if memory is not None:  # drafted pairs read the last real pair's target layers
            memory = memory.gather(1, pairs.last.view(B, 1, 1, 1).expand(-1, 1, *memory.shape[2:]))
        recent = None
        if self.local is not None:  # its window: the tokens before the first draft token
            W = self.local.window
            recent = ctx.tokens.gather(1, (L.unsqueeze(1) - W + torch.arange(W)).clamp(min=0))  # (B, W)
            logits = self.local.fuse(logits, recent)
        return Start(pairs.have, logits, f, memory, recent, seen)

    def _asked(self, pairs: RealPairs, ctx: DraftContext) -> list[bool] | None:
        """Rows to read back (:meth:`start`): :func:`read_back_rows` with a real pair before their
        last; None also when a local head is fused into the logits (its window differs per pair)."""
        if self.local is not None:
            return None
        return read_back_rows(ctx, [n >= 1 for n in pairs.last.view(-1).tolist()])

    def _read_back(
        self, logits: torch.Tensor, pairs: RealPairs, asked: list[bool], rows: bool
    ) -> list[list[bool]]:
        """Per asked row, whether the greedy token at each real pair j but the last (``logits``
        ``(B, P, V)``, or over a subset head's ``rows``) is pair j + 1's token, the one committed at
        ``positions[j] + 2``."""
        guess = greedy_tokens(logits[:, :-1])
        guess = (self.subset.token_ids[guess] if rows and self.subset is not None else guess).tolist()
        tokens, last = pairs.tokens.tolist(), pairs.last.view(-1).tolist()
        return [
            [guess[b][j] == tokens[b][j + 1] for j in range(last[b])] if asked[b] else []
            for b in range(len(asked))
        ]

    def propose(self, state: FeatureDraftState, ctx: DraftContext, k: int) -> Proposal:
        B, L = ctx.lengths.shape[0], ctx.lengths
        draft = torch.zeros(B, k, dtype=torch.int64)
        head = self.subset if self.local is None else None  # a local head fuses over the vocabulary
        begun = self.start(state, ctx, hindsight=True, rows=head is not None)
        if begun is None:
            return Proposal(tokens=draft, num_valid=torch.zeros(B, dtype=torch.int64))
        logits, f, recent, probs = begun.logits, begun.feature, begun.recent, None
        for i in range(k):
            probs, _ = take_token(logits, ctx, draft, probs, i, head)
            if i + 1 < k:  # pair (f_hat at L-2+i+1, d_i) at position L-1+i
                x = self.inputs(f.unsqueeze(1), draft[:, i : i + 1], begun.memory)
                logits, f = self._forward(state, x, (L - 1 + i).unsqueeze(1), rows=head is not None)
                if self.local is not None:  # the tokens before draft i + 1
                    recent = torch.cat([recent[:, 1:], draft[:, i : i + 1]], 1)
                    logits = self.local.fuse(logits, recent)
        valid = torch.where(begun.have, k, 0)
        return Proposal(tokens=draft, probs=probs, num_valid=valid, hindsight=begun.hindsight)
