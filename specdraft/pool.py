"""A bounded pool of candidate phrases, keyed by the token they follow (Ouroboros).

Ouroboros (Zhao et al. 2024, "Generating Longer Drafts Phrase by Phrase for Faster Speculative
Decoding", arXiv 2402.13720) keeps a pool of phrases keyed by a token: ``pool[t]`` holds short
token sequences that followed ``t`` somewhere. Drafts are lengthened with the phrases of their last
token, and several phrases for the current last token are verified together as branches of a
token tree. The pool is filled from what the target itself produced:

- the committed text (prompt and output: :meth:`PhrasePool.add_text`);
- the target's predictions past the first rejected draft token (:meth:`PhrasePool.add_verified`).
  Verification computes the target's argmax after every fed token; after the rejected one these
  predictions are not committed, but as in Ouroboros (where ``refined`` is the target's argmax
  from the last accepted position to the end of the draft) they read as a corrected phrase:
  ``[recovered, argmax after the rejected token, argmax after the next draft token, ...]``.

Memory is bounded: at most ``max_phrases`` phrases per key (the least recently added or used is
dropped first) and ``max_keys`` keys (least recently used dropped first), each phrase at most
``phrase_len`` tokens. A phrase that is a prefix of a stored one only refreshes it; a stored phrase
that is a prefix of a new one is replaced by it, so text arriving token by token grows one phrase.

A pool is per request by default; :func:`shared_pool` returns a process-wide pool by name (a shared
pool lets one request's text shape another's timing, so it is opt-in), which may be warmed from a
file written by :meth:`PhrasePool.save`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from specdraft.errors import SpecdraftError

Phrase = tuple[int, ...]


class PhrasePool:
    """Phrases keyed by the token before them, with LRU bounds on keys and phrases per key.

    Args:
        phrase_len: the longest phrase kept (tokens after the key).
        max_phrases: phrases kept per key.
        max_keys: keys kept.
    """

    def __init__(self, phrase_len: int = 8, max_phrases: int = 8, max_keys: int = 8192):
        if min(phrase_len, max_phrases, max_keys) < 1:
            raise SpecdraftError(
                f"phrase pool bounds must be >= 1, got phrase_len={phrase_len}, "
                f"max_phrases={max_phrases}, max_keys={max_keys}"
            )
        self.phrase_len, self.max_phrases, self.max_keys = phrase_len, max_phrases, max_keys
        self._pool: OrderedDict[int, OrderedDict[Phrase, None]] = OrderedDict()

    def __len__(self) -> int:
        """The number of keys."""
        return len(self._pool)

    @property
    def num_phrases(self) -> int:
        return sum(len(p) for p in self._pool.values())

    def add(self, key: int, phrase: Sequence[int]) -> None:
        """Store ``phrase`` (cut to ``phrase_len``) as following ``key``; it becomes the most recent."""
        phrase = tuple(int(t) for t in phrase[: self.phrase_len])
        if not phrase:
            return
        key = int(key)
        phrases = self._pool.get(key)
        if phrases is None:
            phrases = self._pool[key] = OrderedDict()
            if len(self._pool) > self.max_keys:
                self._pool.popitem(last=False)
        self._pool.move_to_end(key)
        for old in list(phrases):
            if old[: len(phrase)] == phrase:  # already known (as it or a longer one)
                phrases.move_to_end(old)
                return
            if phrase[: len(old)] == old:  # the new phrase extends a stored one
                del phrases[old]
        phrases[phrase] = None
        if len(phrases) > self.max_phrases:
            phrases.popitem(last=False)

    def get(self, key: int) -> list[Phrase]:
        """The phrases after ``key``, most recent first (the key counts as used)."""
        phrases = self._pool.get(int(key))
        if phrases is None:
            return []
        self._pool.move_to_end(int(key))
        return list(reversed(phrases))

    def add_text(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add the phrases of ``tokens`` that tokens from index ``start`` on complete or lengthen:
        for each key position i whose phrase window reaches ``start``, ``tokens[i + 1 : i + 1 +
        phrase_len]`` after ``tokens[i]``. Call it with the previous length as ``start`` when text
        grows (each new token lengthens the ``phrase_len`` phrases before it)."""
        lo = max(0, start - self.phrase_len)
        toks = [int(t) for t in tokens[lo:]]  # only the window the new tokens reach
        for i in range(len(toks) - 1):
            self.add(toks[i], toks[i + 1 : i + 1 + self.phrase_len])

    def add_verified(
        self, inputs: list[int], parents: list[int], target_next: list[int], committed: list[int]
    ) -> list[int]:
        """Add the target's corrected phrase from one row of a verification (the fields of
        :class:`specdraft.drafters.base.Verified`).

        The accepted path is followed from the root by the committed tokens; below its last node,
        the first-tried child (the drafter's best guess) and its first children are the rejected
        branch. The refined phrase is the committed last token (recovered or bonus) followed by the
        target's argmax after each node of that branch; each of its tokens keys the rest.

        Returns:
            the refined phrase (for tests and callers that also want it).
        """
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            if p >= 0:
                children.setdefault(p, []).append(i)
        node = 0
        for tok in committed[:-1]:  # the accepted tokens; the last one is recovered / bonus
            node = next((c for c in children.get(node, []) if inputs[c] == tok), -1)
            if node < 0:
                return []  # committed text that is not a path of this tree: nothing to learn
        refined = committed[-1:]
        branch = children.get(node, [])
        while branch and len(refined) <= self.phrase_len:
            node = branch[0]
            refined.append(int(target_next[node]))
            branch = children.get(node, [])
        for i in range(len(refined) - 1):
            self.add(refined[i], refined[i + 1 :])
        return refined

    def copy(self) -> PhrasePool:
        """An independent pool with the same bounds and phrases (a per-request pool from a warm one)."""
        new = PhrasePool(self.phrase_len, self.max_phrases, self.max_keys)
        new._pool = OrderedDict((k, OrderedDict(v)) for k, v in self._pool.items())
        return new

    def save(self, path: str | Path) -> None:
        """Write the pool as JSON (``{"key": [[tokens], ...]}``, oldest first) for a warm start."""
        data = {str(k): [list(p) for p in v] for k, v in self._pool.items()}
        Path(path).write_text(json.dumps({"phrase_len": self.phrase_len, "pool": data}))

    def load(self, path: str | Path) -> PhrasePool:
        """Add the phrases of a file written by :meth:`save` (this pool's bounds apply); returns self."""
        try:
            data = json.loads(Path(path).read_text())
            items = [(int(k), [list(map(int, p)) for p in v]) for k, v in data["pool"].items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpecdraftError(f"cannot read phrase pool {path}: {e}") from None
        for key, phrases in items:
            for phrase in phrases:
                self.add(key, phrase)
        return self


_SHARED: dict[str, PhrasePool] = {}


def shared_pool(name: str = "default", warm: str | Path | None = None, **bounds) -> PhrasePool:
    """The process-wide pool ``name`` (created on first use, warmed from ``warm`` if given then):
    requests that opt in read and fill it, so later requests start warm."""
    if name not in _SHARED:
        pool = PhrasePool(**bounds)
        if warm is not None:
            pool.load(warm)
        _SHARED[name] = pool
    return _SHARED[name]
