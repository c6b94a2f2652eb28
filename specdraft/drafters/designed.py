"""Designed drafts (``specdraft design``) in the engine: a small Llama, often with a smaller LM head.

A designed draft's head may cover only a subset of the vocabulary (the tokens the target emits
most often, :mod:`specdraft.design.vocab`). :class:`SubsetHeadRuntime` computes logits for those
N rows only and hands the loop full-vocabulary logits with ``-inf`` elsewhere, so

- greedy: the draft proposes ``argmax`` over the subset; the target accepts a token only if it is
  the target's own argmax, so output equals plain decoding whatever the draft proposes;
- sampling: q (softmax of those logits, after the same temperature / top-k / top-p as p) is a
  full-vocabulary distribution that is exactly zero outside the subset. Every proposed token has
  q > 0, and rejection sampling (accept with ``min(1, p/q)``, else sample ``norm(max(p - q, 0))``)
  emits tokens distributed exactly as p for *any* q: the subset only lowers acceptance.

The target verifies over its whole vocabulary in both cases; ``tests/design`` checks both.

Spec strings (``--draft``):

- ``designed:PATH``: a draft directory (``specdraft design ... --out PATH``);
- ``designed:NAME``: ``drafts/NAME`` of this repository;
- ``designed:auto`` (what ``default`` means): the committed draft designed for this target when
  there is one, else prompt lookup (so ``--draft default`` works with every target).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.drafters.model import ModelDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime, LlamaWeights

DRAFTS_DIR = Path(__file__).resolve().parents[2] / "drafts"


class SubsetHeadRuntime:
    """A runtime whose head scores only ``token_ids``; returns full-vocabulary logits (``-inf`` elsewhere).

    Args:
        runtime: the draft's runtime; its logits are over ``token_ids`` in that order ``(B, T, N)``.
        token_ids: ``(N,)`` full-vocabulary id of each head row.
        vocab_size: the full vocabulary size V.
    """

    def __init__(self, runtime, token_ids: torch.Tensor, vocab_size: int):
        if token_ids.numel() != runtime.vocab_size:
            raise SpecdraftError(f"head has {runtime.vocab_size} rows but {token_ids.numel()} token ids")
        if int(token_ids.max()) >= vocab_size or int(token_ids.min()) < 0 or token_ids.unique().numel() != token_ids.numel():
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
        sub = out.logits  # (B, T, N)
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))  # (B, T, V)
        full.index_copy_(-1, self.token_ids, sub)
        out.logits = full
        return out


def draft_weights(draft, target_weights: LlamaWeights | None, head_tokens: torch.Tensor | None, dtype: torch.dtype) -> LlamaWeights:
    """Compact-runtime weights of a transformers draft.

    The embedding is the target's tensor when given (no copy); the head is the embedding's
    ``head_tokens`` rows (or the whole tied embedding). ``torch.qint8`` packs the draft's matmuls
    and its (smaller) head for the int8 runtime.
    """
    dense = torch.float32 if dtype == torch.qint8 else dtype
    w = LlamaWeights.from_hf(draft, dense)
    if target_weights is not None and target_weights.embed.shape == w.embed.shape and target_weights.dtype == dense:
        w.embed = target_weights.embed
        w.lm_head = target_weights.lm_head
    if head_tokens is not None:
        w.lm_head = w.lm_head[head_tokens].contiguous()  # (N, C)
    return w.quantize_int8() if dtype == torch.qint8 else w


def resolve_draft_dir(name: str) -> Path:
    """``designed:`` argument -> directory: an existing path, else ``drafts/<name>``."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    q = DRAFTS_DIR / name
    if q.is_dir():
        return q
    have = sorted(x.name for x in DRAFTS_DIR.iterdir() if (x / "specdraft.json").is_file()) if DRAFTS_DIR.is_dir() else []
    raise SpecdraftError(f"designed draft {name!r} not found: give a draft directory or one of {', '.join(have) or '(none committed)'}")


def find_default(target_model) -> Path | None:
    """The committed draft (``drafts/*``) designed for this target, or None."""
    from specdraft.design.artifact import check_compatible, read_meta

    if not DRAFTS_DIR.is_dir():
        return None
    for d in sorted(DRAFTS_DIR.iterdir()):
        if not (d / "specdraft.json").is_file():
            continue
        try:
            check_compatible(read_meta(d), target_model, str(d))
        except SpecdraftError:
            continue
        return d
    return None


def designed_drafter(spec: str, target, runtime, dtype: torch.dtype):
    """Build the drafter for a ``designed[:...]`` spec (see the module docstring).

    Args:
        spec: ``designed``, ``designed:auto``, ``designed:NAME`` or ``designed:PATH``.
        target: the target's :class:`~specdraft.models.loading.LoadedModel`.
        runtime: the target's runtime (its embedding tensor is shared when it is a compact runtime).
        dtype: compute dtype.
    """
    from specdraft.design.artifact import load_draft

    name = spec.split(":", 1)[1] if ":" in spec else "auto"
    if name == "auto":
        path = find_default(target.model)
        if path is None:
            from specdraft.drafters.prompt_lookup import PromptLookupDrafter

            return PromptLookupDrafter()
    else:
        path = resolve_draft_dir(name)
    draft, meta, extra = load_draft(path, target.model, torch.float32 if dtype == torch.qint8 else dtype)
    head = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
    tw = runtime.w if isinstance(runtime, LlamaRuntime) else None
    w = draft_weights(draft, tw, head, dtype)
    rt = LlamaRuntime(w)
    if head is not None:
        rt = SubsetHeadRuntime(rt, head, meta.vocab_size)
    if meta.kind == "feature":
        from specdraft.drafters.feature import FeatureDrafter

        return FeatureDrafter(rt, extra["fc.weight"], f"designed:{path.name}")
    return ModelDrafter(rt, f"designed:{path.name}")
