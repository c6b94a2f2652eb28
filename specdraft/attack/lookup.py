"""The prompt-lookup attack: misleading repeated phrases seeded in the prompt.

Prompt lookup proposes what followed the latest earlier occurrence of the context's trailing
n-gram (:class:`~specdraft.drafters.prompt_lookup.PromptLookupDrafter`). A *decoy* is an n-gram of
the target's own continuation ``y`` followed by tokens that differ from what the target writes
after it: once the target writes that n-gram, the decoy (later in the context than the user's
text) is the match, and its wrong continuation is rejected.

The search is greedy against the drafter's own matcher: :func:`simulated_lookup_length` replays
prompt lookup over ``prompt + y`` with a fixed k (exact for greedy decoding as long as the target
still writes ``y``), each candidate decoy is appended to the message when it lowers that figure,
up to ``max_decoys``. Whether the target still writes ``y`` on the result is measured afterwards,
through the engine (:mod:`specdraft.attack.run`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdraft.drafters.prompt_lookup import PromptLookupDrafter

FILLER = " however, the other one was not"  # the wrong continuations are taken from this text


@dataclass
class LookupResult:
    """What :func:`attack_lookup` found.

    Attributes:
        text: the attacked message (the original one followed by the decoys).
        decoys: the decoy phrases kept, in order.
        simulated: the simulated mean accepted length after each kept decoy (the clean one first).
    """

    text: str
    decoys: list[str] = field(default_factory=list)
    simulated: list[float] = field(default_factory=list)


def simulated_lookup_length(drafter: PromptLookupDrafter, prompt: list[int], y: list[int], k: int) -> float:
    """Mean accepted length (bonus included) of greedy prompt lookup with fixed ``k`` decoding
    ``y`` after ``prompt``: each step proposes the drafter's match and accepts its prefix that
    agrees with ``y``."""
    seq = torch.tensor(prompt + y)
    P, n = len(prompt), len(y)
    i, steps, accepted = 0, 0, 0
    while i < n:
        _, cont = drafter._lookup(seq[: P + i], k)
        m = 0
        while m < min(cont.shape[0], n - i - 1) and int(cont[m]) == y[i + m]:
            m += 1
        accepted, steps, i = accepted + m, steps + 1, i + m + 1
    return (accepted + steps) / steps if steps else 0.0


def decoy_candidates(y: list[int], n: int, wrong: list[int], k: int) -> list[list[int]]:
    """Decoys: each distinct m-gram of ``y`` (m = n down to 1, first occurrence order) followed by
    ``k`` tokens of ``wrong`` whose first differs from the token after the m-gram in ``y``. Prompt
    lookup tries its longest n first, so a longer decoy takes over a match that a shorter n-gram of
    the user's text would make."""
    seen, out = set(), []
    for m in range(n, 0, -1):
        for i in range(len(y) - m):
            gram = tuple(y[i : i + m])
            if gram in seen:
                continue
            seen.add(gram)
            follow = [t for t in wrong if t != y[i + m]]
            start = wrong.index(follow[0]) if follow else 0
            out.append([*gram, *wrong[start : start + k]])
    return out


def attack_lookup(
    drafter: PromptLookupDrafter,
    text: str,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    y: list[int],
    k: int,
    wrong: list[int],
    max_decoys: int = 8,
) -> LookupResult:
    """Append decoys to the message ``text`` while they lower the simulated mean accepted length.

    Args:
        drafter: the prompt-lookup drafter attacked (its n-gram length is used).
        text: the user's message.
        encode: message -> prompt ids (chat template applied).
        decode: ids -> text.
        y: the target's greedy continuation of the clean prompt.
        k: the fixed draft length of the simulation.
        wrong: the tokens the decoys' wrong continuations are taken from (e.g. :data:`FILLER`'s).
        max_decoys: at most this many decoys are kept.
    """
    result = LookupResult(text, simulated=[simulated_lookup_length(drafter, encode(text), y, k)])
    for cand in decoy_candidates(y, drafter.max_ngram, wrong, k):
        if len(result.decoys) >= max_decoys:
            break
        phrase = decode(cand)  # kept as decoded: a leading space is part of the first token
        if not phrase.strip():
            continue
        trial = f"{result.text}\n{phrase}" if not result.decoys else result.text + phrase
        score = simulated_lookup_length(drafter, encode(trial), y, k)
        if score < result.simulated[-1]:
            result.text = trial
            result.decoys.append(phrase)
            result.simulated.append(score)
    return result
