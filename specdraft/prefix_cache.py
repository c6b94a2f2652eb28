"""Prompt prefix caching: a request whose prompt begins with tokens an earlier request already ran
through the target starts from a copy of their keys and values instead of computing them again.

A multi-turn chat sends the whole conversation each turn, so without this every turn prefills
every earlier turn again (at a few hundred prompt tokens per second on a 2-core CPU, seconds per
turn); llama.cpp's server keeps a slot's last prompt for the same reason (``cache_prompt``) and
vLLM caches prompt blocks (automatic prefix caching). Here, when a request leaves the batch, the
keys and values of its committed tokens (prompt and answer, positions ``0 .. L - 2``: the last
token was never fed) are copied out with the target features a feature drafter reads there; a
new prompt takes the entry sharing its longest prefix (at least ``min_tokens``) and prefills only
the rest. Entries are kept least recently used first within ``max_bytes``.

Lossless: the runtimes compute each position's keys and values from the tokens before it alone
(the kernels are per-row deterministic: a verification step's rows equal one-token steps', bit
for bit), so a copied entry holds what recomputing it would; greedy output is the same with or
without the cache (tests/test_prefix_cache.py). Only :class:`~specdraft.models.llama.LlamaKV`
caches (the compact and quantized runtimes) are copied; the engine skips the cache for others.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from specdraft.models.llama import LlamaKV


@dataclass
class Entry:
    """One cached sequence: its tokens (positions ``0 .. n - 1``), their keys and values per layer
    ``(G, n, D)``, and the target features ``{layer: (n, C)}`` the engine kept there."""

    tokens: list[int]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    hidden: dict[int, torch.Tensor]

    @property
    def nbytes(self) -> int:
        tensors = [*self.k, *self.v, *self.hidden.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Keys and values of earlier sequences, least recently used first, within ``max_bytes``.

    Args:
        max_bytes: the most the entries may hold (keys, values and features).
        min_tokens: shorter shared prefixes are not worth a copy (and shorter sequences are not kept).
    """

    def __init__(self, max_bytes: int, min_tokens: int = 32):
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError(
                f"PrefixCache: need max_bytes >= 0 and min_tokens >= 1, got {max_bytes}, {min_tokens}"
            )
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.nbytes = 0
        self.hits = self.reused_tokens = 0  # prompts that found a prefix; positions not prefilled again
        self._next = 0

    def match(self, prompt: list[int], layers: tuple[int, ...] = ()) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` (having features of ``layers``) and
        that length; ``(None, 0)`` below ``min_tokens``."""
        best, n = None, 0
        for key, e in self.entries.items():
            if all(i in e.hidden for i in layers):
                m = common_prefix(e.tokens, prompt)
                if m > n:
                    best, n = key, m
        if best is None or n < self.min_tokens:
            return None, 0
        self.entries.move_to_end(best)
        return self.entries[best], n

    def fill(self, entry: Entry, n: int, kv: LlamaKV, row: int) -> None:
        """Row ``row`` of ``kv`` takes the entry's first ``n`` positions."""
        for cache, src in ((kv.k, entry.k), (kv.v, entry.v)):
            for t, s in zip(cache, src):
                t[row, :, :n] = s[:, :n]
        self.hits += 1
        self.reused_tokens += n

    def store(self, tokens: list[int], kv: LlamaKV, row: int, hidden: dict[int, torch.Tensor]) -> None:
        """Keep row ``row`` of ``kv`` at positions ``0 .. len(tokens) - 1`` (a copy), with its
        features ``{layer: (>= len(tokens), C)}``; entries it extends are dropped, and the least
        recently used ones while over ``max_bytes``."""
        n = len(tokens)
        if n < self.min_tokens:
            return
        k = [t[row, :, :n].clone() for t in kv.k]
        v = [t[row, :, :n].clone() for t in kv.v]
        entry = Entry(tokens, k, v, {i: h[:n].clone() for i, h in hidden.items()})
        if entry.nbytes > self.max_bytes:
            return
        for key in [
            key for key, e in self.entries.items() if common_prefix(e.tokens, tokens) == len(e.tokens)
        ]:
            self._drop(key)
        self.entries[self._next], self._next = entry, self._next + 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
