"""Drafting with a model: an independent small LM, or the target's own layers (layer-pruned).

The draft runs k autoregressive steps over its own cache. After verification it keeps what was
accepted: it fed the last committed token and d_1..d_{k-1}, so with n accepted its cache is valid
for ``L + min(n, k - 1)`` tokens (L = committed length before the step). Everything committed
beyond that (the recovered/bonus token, and d_k when all k were accepted) is fed at the start of
the next proposal, right-padded across rows. Rollback is that length change, never a copy.

A catch-up after steps without drafts (the policy at k = 0, a row switched off) runs the draft over
positions the target committed by itself, and its prediction at each of them but the last is the
first draft token a proposal there would have made (the same tokens in the draft's cache before
it); greedy verification accepts that token exactly when it is the committed one. So the rows the
policy asks for (``DraftContext.hindsight``, greedy ones) get those outcomes back
(``Proposal.hindsight``, at most :attr:`ModelDrafter.read_back` of them: the LM head runs on that
many more rows), as a feature drafter's catch-up does: a row that is off is then watched by what
its draft would have done over the whole stretch, not by its rare probes alone (issue 17's
detection). 31, chosen on the 200 training prompts the detection thresholds were chosen on, by the
same rule (the most room to both of issue 17's bounds): the designed draft l2's always-wrong
requests flagged 0.88 at 15, 0.96 at 31 and at 63, 0.02 of its clean ones at each
(``results/model-hindsight-2026-12-05/``). On the bf16 runtime of a CPU with native bf16 a
prediction in a longer forward may differ from a one-row one in its last bits; a read-back is a
statistic of the policy, not output.

Draft specs (factories of :data:`specdraft.registry.DRAFTERS`): ``self`` (:func:`self_from_spec`),
``prune:0,1,2,29`` (:func:`pruned_from_spec`) and a model alias or path (:func:`model_from_spec`).
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import (
    DraftContext,
    DraftState,
    Proposal,
    Verified,
    read_back_rows,
    take_token,
)
from specdraft.dtypes import QUANT
from specdraft.errors import SpecdraftError
from specdraft.kernels import cpu_has_fast_bf16
from specdraft.models.llama import LLAMA_FAMILY, LlamaRuntime
from specdraft.models.loading import load_model, load_tokenizer
from specdraft.models.quant import QuantRuntime, gguf_path
from specdraft.models.runtime import Runtime, make_runtime
from specdraft.models.subset_head import SubsetHeadRuntime
from specdraft.verify import greedy_tokens


def catch_up_positions(fed: torch.Tensor, L: torch.Tensor, P: int) -> torch.Tensor:
    """``(B, P)`` positions ``fed .. L - 1`` per row, right-padded with position ``L``.

    Padding sits at slot L: past every real token of the row (so no real query reads it), inside
    the cache (L never exceeds prompt + budget), and rewritten before any later query can read it.
    Padding at ``fed + j`` instead could run past the cache when a long prompt joins a batch whose
    other rows are near their budget.
    """
    return torch.minimum(fed.unsqueeze(1) + torch.arange(P), L.unsqueeze(1))


class ModelDraftState(DraftState):
    """The draft's cache and how many committed tokens of each row it holds (``fed``)."""

    def __init__(self, runtime: Runtime, batch_size: int, capacity: int):
        super().__init__(batch_size)
        self.kv = runtime.new_state(batch_size, capacity)
        self.fed = torch.zeros(batch_size, dtype=torch.int64)  # (B,)
        self.base = torch.zeros(batch_size, dtype=torch.int64)  # (B,) L at the last proposal
        self.k = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.kv.select_rows(rows)
        self.fed, self.base = self.fed[rows], self.base[rows]

    def append(self, other: ModelDraftState) -> None:
        super().append(other)
        self.kv.append(other.kv)
        self.fed = torch.cat([self.fed, other.fed])
        self.base = torch.cat([self.base, other.base])

    def lag(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths - self.fed


class ModelDrafter:
    """A draft model driven through the runtime protocol.

    Args:
        runtime: the draft's runtime (a small model, or a layer subset of the target).
        name: shown in statistics, e.g. ``prune:0,1,2,29``.
    """

    read_back = 31  # first-token outcomes a catch-up reads back at most (module docstring)

    def __init__(self, runtime: Runtime, name: str):
        self.runtime = runtime
        self.name = name
        self.vocab_size = runtime.vocab_size

    @property
    def head(self) -> SubsetHeadRuntime | None:
        """The runtime when its head scores a subset of the vocabulary, else None."""
        return self.runtime if isinstance(self.runtime, SubsetHeadRuntime) else None

    def head_logits(self, kv, tokens: torch.Tensor, positions: torch.Tensor, **kw) -> torch.Tensor:
        """``(B, N)`` the draft's logits at the first (or ``logits_index``) position: over the
        vocabulary (N = V), or over the rows of a subset head, which :func:`take_token` maps back
        (``self.head``; :mod:`specdraft.models.subset_head`)."""
        return self._head_rows(kv, tokens, positions, **kw)[:, 0]

    def _head_rows(self, kv, tokens: torch.Tensor, positions: torch.Tensor, **kw) -> torch.Tensor:
        """``(B, T, N)``: :meth:`head_logits` at every position (or every ``logits_index``)."""
        head = self.head
        runtime = head.runtime if head is not None else self.runtime
        return runtime.forward(kv, tokens, positions, **kw).logits

    def vocabulary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`head_logits` over the whole vocabulary (``-inf`` outside a subset head)."""
        head = self.head
        return logits if head is None else head.expand(logits)

    def new_state(self, batch_size: int, capacity: int) -> ModelDraftState:
        return ModelDraftState(self.runtime, batch_size, capacity)

    def catch_up(
        self, state: ModelDraftState, ctx: DraftContext, read: bool = False
    ) -> tuple[torch.Tensor, list[list[bool]] | None]:
        """Feed the committed tokens the draft has not seen (>= 1: the last one never is) in one
        forward: ``(B, N)`` the draft's logits after each row's last committed token
        (:meth:`head_logits`), and with ``read`` the first-token outcomes of the rows
        ``ctx.hindsight`` asks for (module docstring; None when no row is asked)."""
        L = ctx.lengths
        pending = L - state.fed  # (B,)
        P = int(pending.max())
        positions = catch_up_positions(state.fed, L, P)
        tokens = ctx.tokens.gather(1, positions.clamp(max=ctx.tokens.shape[1] - 1))
        last = (pending - 1).unsqueeze(1)  # (B, 1) index of each row's last real token
        asked = read_back_rows(ctx, [n >= 2 for n in pending.tolist()]) if read else None
        if asked is None:
            return self.head_logits(state.kv, tokens, positions, logits_index=last), None
        m = min(P, self.read_back + 1)  # each row's last m tokens: m - 1 read back, the last continues
        index = last - m + 1 + torch.arange(m)  # (B, m); negative: before the row's first pending token
        every = self._head_rows(state.kv, tokens, positions, logits_index=index.clamp(min=0))
        guess = greedy_tokens(every[:, :-1])
        guess = (guess if self.head is None else self.head.token_ids[guess]).tolist()
        after = tokens.gather(1, (index[:, :-1] + 1).clamp(min=0)).tolist()  # the committed next tokens
        seen = [
            [g == t for g, t, i in zip(guess[b], after[b], index[b].tolist()) if i >= 0] if asked[b] else []
            for b in range(len(asked))
        ]
        return every[:, -1], seen

    def propose(self, state: ModelDraftState, ctx: DraftContext, k: int) -> Proposal:
        B = ctx.lengths.shape[0]
        L = ctx.lengths
        # 1. catch up on committed tokens the draft has not seen
        logits, seen = self.catch_up(state, ctx, read=True)

        # 2. k autoregressive steps; d_i is fed at position L - 1 + i
        draft = torch.empty(B, k, dtype=torch.int64)
        probs = None
        for i in range(k):
            probs, _ = take_token(logits, ctx, draft, probs, i, self.head)
            if i + 1 < k:
                pos = (L + i).unsqueeze(1)  # (B, 1)
                logits = self.head_logits(state.kv, draft[:, i : i + 1], pos)
        state.fed = L.clone()
        state.base = L.clone()
        state.k = k
        return Proposal(tokens=draft, probs=probs, hindsight=seen)

    def observe(
        self, state: ModelDraftState, num_accepted: torch.Tensor, verified: Verified | None = None
    ) -> None:
        state.fed = state.base + torch.clamp(num_accepted, max=max(state.k - 1, 0))


# ------------------------------------------------------------------------------------ factories
def self_from_spec(spec, target) -> ModelDrafter:
    """``self``: the target drafting for itself (every draft accepted; for testing), at the draft
    dtype (a copy of its weights when that differs from the target's)."""
    rt = target.runtime
    if isinstance(rt, LlamaRuntime) and target.dtype != rt.w.dtype:
        return ModelDrafter(type(rt)(rt.w.subset(rt.layer_ids, target.dtype)), "self")
    return ModelDrafter(rt, "self")


def pruned_from_spec(spec, target) -> ModelDrafter:
    """``prune:0,1,2,29``: the target's own layers at full width, with its embedding and LM head;
    at the draft precision ``q`` the quantized target's own blocks (a :class:`QuantRuntime` over
    the same matrices, its own cache)."""
    rt = target.runtime
    if target.dtype == QUANT:
        return ModelDrafter(QuantRuntime(rt.w.with_layers(spec.layers), rt.variant), str(spec))
    if not isinstance(rt, LlamaRuntime):
        raise SpecdraftError(
            "layer-pruned drafts need a Llama-family or Gemma 3 target (compact runtime), or "
            "--draft-dtype q (or auto) beside a quantized one"
        )
    if target.dtype == rt.w.dtype:  # shares the target's tensors; owns only its cache
        return ModelDrafter(type(rt)(rt.w, spec.layers), str(spec))  # the target's runtime class
    return ModelDrafter(type(rt)(rt.w.subset(spec.layers, target.dtype)), str(spec))


def _same_tokenizer(a, b) -> bool:
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()


def model_from_spec(spec, target) -> ModelDrafter:
    """A model alias or path: an independent draft model, which must share the target's tokenizer;
    at the draft precision ``q`` a GGUF draft on its own blocks (tokenizer only, no transformers
    model)."""
    name, dtype = spec.arg, target.dtype
    if dtype == QUANT:
        draft = load_tokenizer(name)
        _check_tokenizer(draft.tokenizer, target.loaded.tokenizer, name)
        return ModelDrafter(QuantRuntime(gguf_path(name), target.runtime.variant), name)
    draft = load_model(name, torch.float32 if dtype == torch.qint8 else dtype)
    if draft.model.config.model_type not in LLAMA_FAMILY and (
        dtype == torch.qint8 or (dtype == torch.bfloat16 and not cpu_has_fast_bf16())
    ):
        dtype = torch.float32  # int8 and kernel-run bf16 need the compact runtime; torch would emulate bf16
    _check_tokenizer(draft.tokenizer, target.loaded.tokenizer, name)
    return ModelDrafter(make_runtime(draft, dtype=dtype), name)


def _check_tokenizer(draft, target, name: str) -> None:
    if not _same_tokenizer(draft, target):
        raise SpecdraftError(
            f"draft {name!r} has a different tokenizer/vocabulary than the target; "
            "speculative decoding needs the same tokenizer"
        )
