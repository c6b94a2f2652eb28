"""A smaller LM head for the draft: only the N tokens the target emits most often.

On this CPU the SmolLM2 head (49,152 x 576) is most of a shallow draft's step; a head over the
8,192 most frequent output tokens costs a sixth of it. Speculative decoding stays lossless: the
draft's q is a full-vocabulary distribution with zeros outside the subset (its logits there are
-inf), and the target verifies over its whole vocabulary. A token the draft cannot propose just
costs acceptance, never correctness (see :mod:`specdraft.models.subset_head` and the tests).

Counts come from the target's own responses to training prompts (:mod:`specdraft.design.data`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError


@dataclass
class VocabSubset:
    """The draft head's tokens.

    Attributes:
        token_ids: ``(N,)`` int64 full-vocabulary ids, most frequent first (ids the draft can propose).
        coverage: fraction of the counted target tokens that fall in the subset (the ceiling on
            acceptance that the subset imposes), measured on the counting data.
    """

    token_ids: torch.Tensor
    coverage: float

    def __len__(self) -> int:
        return int(self.token_ids.numel())


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(V,)`` how often each id occurs in ``tokens`` (any shape)."""
    return torch.bincount(tokens.reshape(-1).long(), minlength=vocab_size)[:vocab_size]


def top_tokens(
    counts: torch.Tensor, n: int, always: tuple[int, ...] = (), secondary: torch.Tensor | None = None
) -> VocabSubset:
    """The ``n`` most frequent ids, plus ``always`` (e.g. EOS) if missing.

    Ties (above all the many ids never seen in the answers) are broken by ``secondary`` counts
    (e.g. how often the id occurs in training prompts, which answers often quote), then by lower
    id (in BPE vocabularies, earlier merges are the more frequent pieces).

    Args:
        counts: ``(V,)`` occurrences per id in the target's answers.
        n: subset size, ``1 <= n <= V``. The result may hold up to ``n + len(always)`` ids.
        always: ids that must be in the subset whatever their count.
        secondary: ``(V,)`` tie-breaking counts, or None.
    """
    V = counts.numel()
    if not 1 <= n <= V:
        raise SpecdraftError(f"head size must be in 1..{V}, got {n}")
    ids = torch.arange(V)
    order = ids
    for key in (secondary, counts):  # stable sorts: the last key is the primary one
        if key is not None:
            order = order[torch.sort(-key.long()[order], stable=True).indices]
    keep = order[:n].tolist()
    have = set(keep)
    keep += [t for t in always if 0 <= t < V and t not in have]
    ids = torch.tensor(keep, dtype=torch.int64)
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    return VocabSubset(ids, coverage)
