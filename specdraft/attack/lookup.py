"""The prompt-lookup attack: misleading repeated phrases seeded in the prompt.

Prompt lookup proposes what followed the latest earlier occurrence of the context's trailing
n-gram (:class:`~specdraft.drafters.prompt_lookup.PromptLookupDrafter`). A *decoy* is an n-gram
that the target writes followed by tokens that differ from what it writes next: appended to the
user's message, it is a later occurrence than any in the user's text, so once the target writes
that n-gram, the decoy is the match, and its wrong continuation is rejected.

The search is greedy and aimed: it replays prompt lookup over the prompt and the answer the target
writes now (:func:`lookup_steps`, exact for greedy decoding with a fixed k), takes the steps whose
proposals were accepted, the longest first, and tries one decoy for each: the longest n-gram the
drafter tries, ending where that step drafted (:func:`aimed_decoys`). The target reads the decoys
too, so each trial decodes the attacked prompt (``generate``) and is kept only when prompt lookup's
mean accepted length on the answer the target then writes is lower and ``keeps`` accepts that
answer (the runner: ROUGE-L to the clean answer at least ``--min-rouge``). An earlier version scored
decoys on the clean answer alone; on SmolLM2-135M the decoys changed the answer and lookup's
acceptance went up on 4 of the first 12 prompts of a run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specdraft.drafters.ngram import NgramIndex
from specdraft.drafters.prompt_lookup import PromptLookupDrafter

FILLER = " however, the other one was not"  # the wrong continuations are taken from this text


@dataclass
class LookupResult:
    """What :func:`attack_lookup` found.

    Attributes:
        text: the attacked message (the original one followed by the decoys).
        decoys: the decoy phrases kept, in order.
        simulated: the simulated mean accepted length on the answer the target writes, clean
            first, then after each kept decoy.
    """

    text: str
    decoys: list[str] = field(default_factory=list)
    simulated: list[float] = field(default_factory=list)


def lookup_steps(drafter: PromptLookupDrafter, prompt: list[int], y: list[int], k: int) -> list[tuple]:
    """Greedy prompt lookup with fixed ``k`` decoding ``y`` after ``prompt``, step by step:
    ``(i, m, n, end)`` per step, ``y[i]`` the first token it drafted for, ``m`` the drafts accepted
    (the prefix of its match's continuation that agrees with ``y``), ``n`` the matched n-gram's
    length and ``end`` where the match it copied ends in ``prompt + y`` (0 and -1: no match)."""
    index = NgramIndex.of(prompt, drafter.max_ngram)
    total = len(y)
    i, steps = 0, []
    while i < total:
        n, end = drafter.matched(index)
        _, cont = drafter.lookup(index, k, (n, end))
        m = 0
        while m < min(len(cont), total - i - 1) and cont[m] == y[i + m]:
            m += 1
        steps.append((i, m, n, end))
        index.extend(y[i : i + m + 1])
        i += m + 1
    return steps


def out_of_reach(
    drafter: PromptLookupDrafter, prompt: list[int], y: list[int], k: int
) -> tuple[int, int, int]:
    """How far decoys in the prompt can lower prompt lookup's acceptance on the answer ``y``
    (:func:`lookup_steps`): ``(steps, accepted, fixed)``, ``fixed`` the accepted draft tokens copied
    from a match inside the answer at the longest n-gram the drafter tries. No decoy changes those
    steps' proposals while the answer stays ``y``: lookup takes the longest n first, then the latest
    occurrence, and an occurrence inside the answer is later than any in the prompt. Every other
    accepted token (copied from the prompt, or from the answer at a shorter n that a decoy's longer
    match would take over) is within reach."""
    steps = lookup_steps(drafter, prompt, y, k)
    fixed = sum(m for _, m, n, end in steps if n == drafter.max_ngram and end >= len(prompt))
    return len(steps), sum(m for _, m, _, _ in steps), fixed


def least_accepted_length(steps: int, accepted: int, fixed: int) -> float:
    """The lowest mean accepted length (bonus included) decoys could leave on the same answer
    (:func:`out_of_reach`): every accepted token within reach rejected, each then a step of its own."""
    return 1 + fixed / (steps + accepted - fixed)


def simulated_lookup_length(drafter: PromptLookupDrafter, prompt: list[int], y: list[int], k: int) -> float:
    """Mean accepted length (bonus included) of greedy prompt lookup with fixed ``k`` decoding
    ``y`` after ``prompt`` (:func:`lookup_steps`)."""
    steps = lookup_steps(drafter, prompt, y, k)
    return sum(m + 1 for _, m, _, _ in steps) / len(steps) if steps else 0.0


def aimed_decoys(
    drafter: PromptLookupDrafter, prompt: list[int], y: list[int], k: int, wrong: list[int]
) -> list[list[int]]:
    """One decoy per step whose drafts were accepted, most accepted first: the ``max_ngram``
    tokens before ``y[i]`` followed by ``k`` tokens of ``wrong`` from the first that is not
    ``y[i]`` (the longest n-gram is tried first, so the decoy takes over a shorter match too)."""
    seq = prompt + y
    out = []
    for i, m, _, _ in sorted(lookup_steps(drafter, prompt, y, k), key=lambda s: -s[1]):
        if m == 0:
            break
        at = len(prompt) + i
        follow = [t for t in wrong if t != y[i]]
        start = wrong.index(follow[0]) if follow else 0
        out.append([*seq[max(0, at - drafter.max_ngram) : at], *wrong[start : start + k]])
    return out


def attack_lookup(
    drafter: PromptLookupDrafter,
    text: str,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    generate: Callable[[list[int]], list[int]],
    keeps: Callable[[list[int]], bool],
    y: list[int],
    k: int,
    wrong: list[int],
    max_decoys: int = 8,
    max_trials: int = 24,
) -> LookupResult:
    """Append decoys to the message ``text`` while they lower prompt lookup's mean accepted length
    on the answer the target writes (module docstring).

    Args:
        drafter: the prompt-lookup drafter attacked (its n-gram length is used).
        text: the user's message.
        encode: message -> prompt ids (chat template applied).
        decode: ids -> text.
        generate: prompt ids -> the target's greedy answer (as long as ``y``).
        keeps: whether an attacked answer is close enough to the clean one to keep the decoy.
        y: the target's greedy answer to the clean prompt.
        k: the fixed draft length of the simulation.
        wrong: the tokens the decoys' wrong continuations are taken from (e.g. :data:`FILLER`'s).
        max_decoys: at most this many decoys are kept.
        max_trials: at most this many decoys are tried (each decodes the attacked prompt once).
    """
    result = LookupResult(text, simulated=[simulated_lookup_length(drafter, encode(text), y, k)])
    answer, tried = y, set()
    for _ in range(max_trials):
        aimed = aimed_decoys(drafter, encode(result.text), answer, k, wrong)
        fresh = [d for d in aimed if tuple(d) not in tried and decode(d).strip()]
        if not fresh or len(result.decoys) >= max_decoys:
            break
        tried.add(tuple(fresh[0]))
        phrase = decode(fresh[0])  # kept as decoded: a leading space is part of the first token
        trial = f"{result.text}\n{phrase}" if not result.decoys else result.text + phrase
        ids = encode(trial)
        new = generate(ids)
        score = simulated_lookup_length(drafter, ids, new, k)
        if score < result.simulated[-1] and keeps(new):
            result.text, answer = trial, new
            result.decoys.append(phrase)
            result.simulated.append(score)
    return result
