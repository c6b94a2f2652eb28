"""An n-gram index over a growing token list, and the per-row state of the drafters that read one.

Prompt lookup, the lookup tree and suffix decoding all ask the same question of a row's context:
where did its trailing n-gram occur before, and what followed? Scanning the whole context costs
O(L) per row at every step (prompt lookup also proposes for rows the policy switched off); the
index answers from a dict and is brought up to date with the tokens committed since.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdraft.drafters.base import DraftContext, DraftState

SEP = -1  # separates requests in a shared history; no n-gram or continuation spans it


class NgramIndex:
    """Positions where each n-gram (n <= ``max_n``) ends in a growing token list.

    Args:
        max_n: the longest n-gram indexed.
        max_tokens: keep at most this many tokens (the older half is dropped when it is exceeded);
            None: unbounded (a request's own context, bounded by the engine's capacity).
    """

    def __init__(self, max_n: int = 8, max_tokens: int | None = None):
        self.max_n, self.max_tokens = max_n, max_tokens
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    @classmethod
    def of(cls, tokens: Sequence[int], max_n: int = 8) -> NgramIndex:
        index = cls(max_n)
        index.extend(tokens)
        return index

    def extend(self, new: Sequence[int]) -> None:
        for t in new:
            self.tokens.append(int(t))
            i = len(self.tokens) - 1
            for n in range(1, min(self.max_n, i + 1) + 1):
                if self.tokens[i - n + 1] == SEP:
                    break
                self.ends.setdefault(tuple(self.tokens[i - n + 1 : i + 1]), []).append(i)
        if self.max_tokens is not None and len(self.tokens) > self.max_tokens:
            tail = self.tokens[-(self.max_tokens // 2) :]
            self.tokens, self.ends = [], {}
            self.extend(tail)

    def latest(self, gram: Sequence[int], count: int) -> list[int]:
        """The end positions of ``gram``'s latest ``count`` occurrences followed by a token,
        latest first."""
        L, out = len(self.tokens), []
        for e in reversed(self.ends.get(tuple(gram), ())):
            if e + 1 < L and self.tokens[e + 1] != SEP:
                out.append(e)
                if len(out) == count:
                    break
        return out

    def match(self, context: Sequence[int], max_occurrences: int, min_n: int = 1) -> tuple[int, list[int]]:
        """The longest n >= ``min_n`` such that ``context[-n:]`` occurs here followed by a token, and
        the end positions of its latest ``max_occurrences`` such occurrences ((0, []) if none)."""
        for n in range(min(self.max_n, len(context)), min_n - 1, -1):
            ends = self.latest(context[len(context) - n :], max_occurrences)
            if ends:
                return n, ends
        return 0, []

    def continuations(self, ends: list[int], depth: int) -> list[list[int]]:
        """The up to ``depth`` tokens after each end position (cut at a request separator)."""
        out = []
        for e in ends:
            cont = self.tokens[e + 1 : e + 1 + depth]
            out.append(cont[: cont.index(SEP)] if SEP in cont else cont)
        return out


class NgramState(DraftState):
    """Each row's :class:`NgramIndex` over its committed tokens, following the engine's rows."""

    def __init__(self, batch_size: int, max_n: int):
        super().__init__(batch_size)
        self.index = [NgramIndex(max_n) for _ in range(batch_size)]

    def synced(self, ctx: DraftContext) -> list[NgramIndex]:
        """Every row's index, brought up to ``ctx``'s committed tokens (what was committed since
        the last call; committed tokens never change)."""
        tokens = ctx.tokens.numpy()
        for b, (index, L) in enumerate(zip(self.index, ctx.lengths.tolist())):
            index.extend(tokens[b, len(index.tokens) : L].tolist())
        return self.index

    def select_rows(self, rows: torch.Tensor) -> None:
        self.index = [self.index[int(r)] for r in rows]
        super().select_rows(rows)

    def append(self, other: NgramState) -> None:
        self.index += other.index
        super().append(other)
