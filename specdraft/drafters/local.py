"""A DeLS-Spec local head fused into a long-context drafter (``--draft local:designed:NAME``).

After DeLS-Spec (arXiv 2607.07409): a short-context *local* head, here a Markov bigram table over
the target's own answers (trivially "trained": counted), is fused with a long-context drafter as a
product of experts, at every draft position::

    logits = l_long + a * log P_local(x | previous token) - b * log P_prior(x)

``P_prior`` is the unigram frequency: subtracting it keeps the product from counting the frequency of
common tokens twice (both experts already carry it). ``a`` and ``b`` are tuned on held-in data
(``specdraft design local``, :mod:`specdraft.design.local`). Smoothing: ``P_local(x | t) =
(n(t, x) + beta * P_prior(x)) / (n(t) + beta)`` with the ``M`` most frequent successors of each token
kept (the rest of a row is the prior's share).

The fused logits are the draft's distribution q: greedy drafting takes their argmax and sampled
drafting samples from them, and verification checks tokens against that q, so the fusion is
lossless like any drafter. Only drafters on the feature base (``feature``, ``dream``:
:class:`~specdraft.drafters.feature_base.FeatureDrafterBase`) host a local head: the fusion happens
inside their drafting loop, where the previous token is known.

Where it lives: ``local_head.safetensors`` in the long draft's directory (its ``a``, ``b``, ``beta`` in
the file's metadata); ``designed:NAME`` is the draft alone, ``local:designed:NAME`` the fused one, so
the ablation is one flag apart. The GRU variant of the paper (rank-256 output over frozen target
embeddings) is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError

FILE = "local_head.safetensors"


@dataclass
class LocalHead:
    """A bigram table with a unigram prior, and its fusion weights.

    Attributes:
        succ_ids: ``(V, M)`` int64, the M most frequent successors of each token (0 where fewer).
        succ_counts: ``(V, M)`` their counts (0 where fewer).
        row_counts: ``(V,)`` how often each token was followed by any token.
        prior: ``(V,)`` unigram probabilities (add-one smoothed).
        a: weight of the local head's log-probabilities.
        b: weight of the subtracted log prior.
        beta: smoothing mass of the prior in each row.
    """

    succ_ids: torch.Tensor
    succ_counts: torch.Tensor
    row_counts: torch.Tensor
    prior: torch.Tensor
    a: float = 0.0
    b: float = 0.0
    beta: float = 1.0

    @classmethod
    def count(cls, seqs: list[torch.Tensor], vocab_size: int, M: int = 16, beta: float = 1.0) -> LocalHead:
        """Count the bigrams of ``seqs`` (each a ``(S,)`` id tensor); keep M successors per token."""
        V = vocab_size
        prev = torch.cat([s[:-1] for s in seqs]).long()
        nxt = torch.cat([s[1:] for s in seqs]).long()
        keys, cnt = torch.unique(prev * V + nxt, return_counts=True)
        p = keys // V
        order = torch.argsort(cnt, descending=True, stable=True)
        order = order[torch.argsort(p[order], stable=True)]  # by token, most frequent successor first
        p, keys, cnt = p[order], keys[order], cnt[order]
        _, group = torch.unique_consecutive(p, return_counts=True)
        rank = torch.arange(p.numel()) - torch.repeat_interleave(torch.cumsum(group, 0) - group, group)
        keep = rank < M
        ids = torch.zeros(V, M, dtype=torch.int64)
        counts = torch.zeros(V, M)
        ids[p[keep], rank[keep]] = keys[keep] % V
        counts[p[keep], rank[keep]] = cnt[keep].float()
        rows = torch.bincount(prev, minlength=V).float()
        uni = torch.bincount(torch.cat(seqs).long(), minlength=V).float() + 1.0
        return cls(ids, counts, rows, uni / uni.sum(), beta=beta)

    def log_local(self, prev: torch.Tensor) -> torch.Tensor:
        """``(B,)`` previous tokens -> ``(B, V)`` log P_local(x | prev)."""
        num = (self.beta * self.prior).expand(prev.shape[0], -1).clone()  # (B, V)
        num.scatter_add_(1, self.succ_ids[prev], self.succ_counts[prev])
        return torch.log(num / (self.row_counts[prev] + self.beta).unsqueeze(1))

    def fuse(self, logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The product of experts (module docstring) over ``(B, V)`` logits of the long drafter."""
        return logits + self.a * self.log_local(prev) - self.b * torch.log(self.prior)

    def save(self, directory: str | Path, info: dict | None = None) -> Path:
        """Write ``FILE`` into ``directory`` atomically; ``info`` (how it was tuned) goes into the
        metadata as JSON."""
        import json

        from safetensors.torch import save_file

        from specdraft import durable

        path = Path(directory) / FILE
        tensors = {
            "succ_ids": self.succ_ids.to(torch.int32),
            "succ_counts": self.succ_counts,
            "row_counts": self.row_counts,
            "prior": self.prior,
        }
        meta = {"a": repr(self.a), "b": repr(self.b), "beta": repr(self.beta), "info": json.dumps(info or {})}
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata=meta)
        durable.replace_file(tmp, path)
        return path

    @classmethod
    def load(cls, directory: str | Path) -> LocalHead:
        from safetensors import SafetensorError, safe_open

        path = Path(directory) / FILE
        if not path.is_file():
            raise SpecdraftError(
                f"draft {Path(directory).name} has no local head ({FILE}): make one with "
                f"specdraft design local {directory}"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
                t = {k: f.get_tensor(k) for k in ("succ_ids", "succ_counts", "row_counts", "prior")}
            a, b, beta = float(meta["a"]), float(meta["b"]), float(meta["beta"])
        except (SafetensorError, KeyError, ValueError, TypeError, OSError) as e:
            raise SpecdraftError(f"local head {path} is corrupted ({type(e).__name__}: {e})") from None
        return cls(t["succ_ids"].long(), t["succ_counts"], t["row_counts"], t["prior"], a, b, beta)
