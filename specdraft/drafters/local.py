"""A DeLS-Spec local head fused into a long-context drafter (``--draft local:designed:NAME``).

After DeLS-Spec (arXiv 2607.07409): a short-context *local* head, here a Markov bigram table over
the target's own answers (trivially "trained": counted), is fused with a long-context drafter as a
product of experts, at every draft position::

    logits = l_long + a * log P_local(x | previous token) - b * log P_prior(x)

``P_prior`` is the unigram frequency: subtracting it keeps the product from counting the frequency of
common tokens twice (both experts already carry it). ``a`` and ``b`` are tuned on held-out data
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
the ablation is one flag apart.

The paper's other local head, a GRU, is :class:`GRULocalHead`: a 1-layer GRU over the frozen target
embeddings of the last ``window`` tokens, its last state through a rank-R bottleneck (R = 256) to
the vocabulary, trained with plain next-token cross-entropy (``specdraft design local --local gru``).
Its output layer is the frozen target embedding (tied, as SmolLM2's head): the bottleneck maps to
the embedding width and the embedding scores it, which keeps the head small (a separate V x R
output would be 25 MB for SmolLM2's 49k tokens). Both heads take the recent tokens as ``(B, W)``
(the bigram reads the last column); :func:`load_local` reads either from ``FILE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from specdraft.errors import SpecdraftError
from specdraft.models.llama import widened

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
    window: ClassVar[int] = 1  # recent tokens read

    @property
    def vocab_size(self) -> int:
        return self.succ_ids.shape[0]

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
        """``(B,)`` previous tokens (or ``(B, W)`` recent ones, the last read) -> ``(B, V)``
        log P_local(x | prev)."""
        prev = prev[:, -1] if prev.dim() == 2 else prev
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

        tensors = {
            "succ_ids": self.succ_ids.to(torch.int32),
            "succ_counts": self.succ_counts,
            "row_counts": self.row_counts,
            "prior": self.prior,
        }
        meta = {"a": repr(self.a), "b": repr(self.b), "beta": repr(self.beta), "info": json.dumps(info or {})}
        return _write(directory, tensors, meta)

    @classmethod
    def load(cls, directory: str | Path) -> LocalHead:
        meta, t = _read(directory, ("succ_ids", "succ_counts", "row_counts", "prior"), ("a", "b", "beta"))
        a, b, beta = (float(meta[k]) for k in ("a", "b", "beta"))
        return cls(t["succ_ids"].long(), t["succ_counts"], t["row_counts"], t["prior"], a, b, beta)


GRU_KEYS = (
    "gru.weight_ih_l0",
    "gru.weight_hh_l0",
    "gru.bias_ih_l0",
    "gru.bias_hh_l0",
    "down.weight",
    "up.weight",
)


class GRULocalHead(torch.nn.Module):
    """DeLS-Spec's GRU local head (module docstring).

    Args:
        embed: ``(V, C)`` the target's token embedding (frozen; input and tied output).
        prior: ``(V,)`` unigram probabilities (the fusion's subtracted prior).
        hidden: the GRU's width.
        rank: the bottleneck's rank.
        window: recent tokens the GRU reads.
        a, b: the fusion weights.
    """

    def __init__(self, embed, prior, hidden: int = 256, rank: int = 256, window: int = 8, a=0.0, b=0.0):
        super().__init__()
        if window < 1 or hidden < 1 or rank < 1:
            raise SpecdraftError(
                f"GRU local head: window {window}, hidden {hidden}, rank {rank} must be >= 1"
            )
        C = embed.shape[1]
        # not a parameter: frozen, and not saved; in the runtime's arithmetic (bf16 products of a batch
        # of 256 with SmolLM2's embedding made a training step ~20 s on a Zen 3 core, fp32 0.6 s)
        self.embed = widened(embed)
        self.gru = torch.nn.GRU(C, hidden, batch_first=True)
        self.down = torch.nn.Linear(hidden, rank, bias=False)
        self.up = torch.nn.Linear(rank, C, bias=False)
        self.register_buffer("prior", prior.float(), persistent=False)
        self.window, self.a, self.b = window, a, b
        self.rows: torch.Tensor | None = None  # restrict(): the only tokens fuse() scores

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    def restrict(self, token_ids: torch.Tensor) -> None:
        """Score only ``token_ids`` in :meth:`fuse`: a draft whose head is a subset of the vocabulary
        (:class:`~specdraft.models.subset_head.SubsetHeadRuntime`) has ``-inf`` logits elsewhere, and
        the output product over SmolLM2's 8,192 head rows costs a sixth of the 49,152-row one."""
        self.rows = token_ids.long()
        self._rows_embed = self.embed[self.rows]

    def _state(self, recent: torch.Tensor) -> torch.Tensor:
        """``(B, W)`` recent tokens (the last ``window`` are read) -> ``(B, C)`` the bottleneck's output."""
        x = self.embed[recent[:, -self.window :]].float()  # (B, W, C)
        _, h = self.gru(x)  # (1, B, hidden): the state after the last token
        return self.up(self.down(h[0]))

    def logits(self, recent: torch.Tensor) -> torch.Tensor:
        """``(B, W)`` recent tokens -> ``(B, V)`` next-token logits."""
        return F.linear(self._state(recent).to(self.embed.dtype), self.embed).float()

    def log_local(self, recent: torch.Tensor) -> torch.Tensor:
        """``(B, W)`` recent tokens -> ``(B, V)`` log P_local(x | recent)."""
        return torch.log_softmax(self.logits(recent if recent.dim() == 2 else recent.unsqueeze(1)), -1)

    @torch.no_grad()
    def fuse(self, logits: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
        """The product of experts (module docstring) over ``(B, V)`` logits of the long drafter.
        Restricted (:meth:`restrict`): the local logits at those tokens without log-softmax's
        normaliser, which shifts a row's fused logits by a constant and so changes neither the
        draft's argmax nor its softmax (elsewhere the long drafter's ``-inf`` stays)."""
        if self.rows is None:
            return logits + self.a * self.log_local(recent) - self.b * torch.log(self.prior)
        z = self._state(recent if recent.dim() == 2 else recent.unsqueeze(1))
        local = torch.zeros_like(logits)
        local[:, self.rows] = F.linear(z.to(self.embed.dtype), self._rows_embed).float()
        return logits + self.a * local - self.b * torch.log(self.prior)

    def save(self, directory: str | Path, info: dict | None = None) -> Path:
        import json

        state = self.state_dict()
        tensors = {k: state[k].contiguous() for k in GRU_KEYS} | {"prior": self.prior}
        meta = {"type": "gru", "a": repr(self.a), "b": repr(self.b), "window": str(self.window)}
        return _write(directory, tensors, meta | {"info": json.dumps(info or {})})

    @classmethod
    def load(cls, directory: str | Path, embed: torch.Tensor) -> GRULocalHead:
        meta, t = _read(directory, (*GRU_KEYS, "prior"), ("a", "b", "window"))
        hidden, rank = t["gru.weight_hh_l0"].shape[1], t["down.weight"].shape[0]
        head = cls(
            embed, t.pop("prior"), hidden, rank, int(meta["window"]), float(meta["a"]), float(meta["b"])
        )
        if t["up.weight"].shape[0] != embed.shape[1]:
            raise SpecdraftError(f"local head in {directory} is for another embedding width")
        head.load_state_dict(t)
        return head.eval().requires_grad_(False)


def load_local(directory: str | Path, embed: torch.Tensor):
    """The local head in ``directory`` (a bigram table or a GRU, by its file's ``type``)."""
    meta, _ = _read(directory, (), ())
    return GRULocalHead.load(directory, embed) if meta.get("type") == "gru" else LocalHead.load(directory)


def _write(directory: str | Path, tensors: dict, meta: dict) -> Path:
    """Write ``FILE`` into ``directory`` atomically."""
    from safetensors.torch import save_file

    from specdraft import durable

    path = Path(directory) / FILE
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    durable.replace_file(tmp, path)
    return path


def _read(directory: str | Path, keys: tuple[str, ...], fields: tuple[str, ...]) -> tuple[dict, dict]:
    """``FILE``'s metadata (``fields`` checked present) and tensors ``keys``; one clear line when it is
    missing or corrupted."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / FILE
    if not path.is_file():
        raise SpecdraftError(
            f"draft {Path(directory).name} has no local head ({FILE}): make one with "
            f"specdraft design local {directory}"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in keys}
        for k in fields:
            float(meta[k])
    except (SafetensorError, KeyError, ValueError, TypeError, OSError) as e:
        raise SpecdraftError(f"local head {path} is corrupted ({type(e).__name__}: {e})") from None
    return meta, t
