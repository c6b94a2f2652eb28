"""A draft runtime whose LM head covers only a subset of the vocabulary (a designed draft's head).

A designed draft's head may cover only the tokens the target emits most often
(:mod:`specdraft.design.vocab`). :class:`SubsetHeadRuntime` computes logits for those N rows only
and hands the loop full-vocabulary logits with ``-inf`` elsewhere, so

- greedy: the draft proposes ``argmax`` over the subset; the target accepts a token only if it is
  the target's own argmax, so output equals plain decoding whatever the draft proposes;
- sampling: q (softmax of those logits, after the same temperature / top-k / top-p as p) is a
  full-vocabulary distribution that is exactly zero outside the subset. Every proposed token has
  q > 0, and rejection sampling (accept with ``min(1, p/q)``, else sample ``norm(max(p - q, 0))``)
  emits tokens distributed exactly as p for *any* q: the subset only lowers acceptance.

The target verifies over its whole vocabulary in both cases; ``tests/drafters/test_gated.py``
checks both. A model drafter works on the N head columns themselves
(:meth:`~specdraft.drafters.model.ModelDrafter.head_logits`) and maps only its chosen tokens (and a
sampling row's q) to the vocabulary: at Gemma 3's 262k vocabulary and a 16k head, filling and
scanning the full row would be 16 times the work of the head's own row, every draft token.
:func:`draft_weights` builds the compact-runtime weights of a transformers draft.
"""

from __future__ import annotations

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaWeights
from specdraft.models.runtime import compact_weights


class SubsetHeadRuntime:
    """A runtime whose head scores only ``token_ids``; returns full-vocabulary logits (``-inf``
    elsewhere).

    Args:
        runtime: the draft's runtime; its logits are over ``token_ids`` in that order ``(B, T, N)``.
        token_ids: ``(N,)`` full-vocabulary id of each head row.
        vocab_size: the full vocabulary size V.
    """

    def __init__(self, runtime, token_ids: torch.Tensor, vocab_size: int):
        if token_ids.numel() != runtime.vocab_size:
            raise SpecdraftError(f"head has {runtime.vocab_size} rows but {token_ids.numel()} token ids")
        distinct = token_ids.unique().numel() == token_ids.numel()
        if int(token_ids.max()) >= vocab_size or int(token_ids.min()) < 0 or not distinct:
            raise SpecdraftError(f"head token ids must be distinct ids in 0..{vocab_size - 1}")
        self.runtime = runtime
        self.token_ids = token_ids.long()
        self.vocab_size = vocab_size
        self.max_context = runtime.max_context
        self.dtype = runtime.dtype

    def __repr__(self) -> str:
        return f"SubsetHeadRuntime({self.runtime!r}, head={self.token_ids.numel()}/{self.vocab_size})"

    def new_state(self, batch_size: int, capacity: int):
        return self.runtime.new_state(batch_size, capacity)

    def forward(self, state, tokens, positions, **kw):
        out = self.runtime.forward(state, tokens, positions, **kw)
        out.logits = self.expand(out.logits)  # (B, T, N) -> (B, T, V)
        return out

    def expand(self, x: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """``(..., N)`` values over the head's rows as ``(..., V)`` over the vocabulary, ``fill``
        elsewhere (-inf for logits, 0 for probabilities)."""
        full = x.new_full((*x.shape[:-1], self.vocab_size), fill)
        return full.index_copy_(-1, self.token_ids, x)


def draft_weights(
    draft, target_weights: LlamaWeights | None, head_tokens: torch.Tensor | None, dtype: torch.dtype
) -> LlamaWeights:
    """Compact-runtime weights of a transformers draft.

    The embedding is the target's tensor when given (no copy); the head is the embedding's
    ``head_tokens`` rows (or the whole tied embedding). ``torch.qint8`` packs the draft's matmuls
    and its (smaller) head for the int8 runtime.
    """
    dense = torch.float32 if dtype == torch.qint8 else dtype
    w = compact_weights(draft, dense)
    tw = target_weights
    if tw is not None and tw.embed.shape == w.embed.shape and tw.dtype == dense:
        w.embed = tw.embed
        w.lm_head = tw.lm_head
    if head_tokens is not None:
        w.lm_head = w.lm_head[head_tokens].contiguous()  # (N, C)
    return w.quantize_int8() if dtype == torch.qint8 else w
