"""``specdraft attack``'s runner: attack each prompt, measure clean vs attacked, write the files.

For each prompt (its first turn; later turns are dropped from the attacked file) the runner

1. decodes the clean prompt through the real engine (:mod:`specdraft.bench.harness`): plain
   decoding, the drafter with a fixed k (undefended) and the drafter under ``--k auto`` (the
   cost-aware policy, with its per-request collapse defense; one policy serves every call, so its
   running acceptance spans the run), interleaved;
2. attacks it (:mod:`~specdraft.attack.continuous`, :mod:`~specdraft.attack.discrete`,
   :mod:`~specdraft.attack.lookup`);
3. decodes the attacked prompt the same way (discrete and lookup: a text a client can send).

Stealth: whether the target's first ``prefix_tokens`` greedy tokens are identical on the clean and
the attacked prompt, ROUGE-L (F1 of the longest common subsequence, :func:`rouge_l`) between the
clean and attacked answers, and the prompt's perplexity under the target.

The continuous attack's input is not text: its mean accepted lengths are simulated exactly for a
fixed k on the differentiable models (:func:`specdraft.attack.losses.simulated_accepted_length`;
clean and attacked alike), its stealth compares the target's greedy outputs from the clean and the
perturbed embeddings, and its speedups, defended and perplexity fields are null. Its detection is
replayed: the same simulation gives each answer's first-token outcome at every position (``hits``:
whether the draft's argmax there is the target's token, what a proposal there would get), and each
prompt's clean then attacked outcomes go through one policy's detection in turn, as the engine's
defended arm meets them, a model draft's catch-ups read back (:func:`specdraft.attack.detection.replay`
at batch 1). Its ``attacked.jsonl`` holds each perturbed token's nearest vocabulary token (labelled
``nearest_token_projection``): text that ``specdraft bench`` can read, not the attack itself.

ROUGE-L is computed here on token ids (a 20-line LCS) rather than with ``rouge-score``: that package
is not installed in this environment (it would bring nltk and absl) and it splits English words,
while these answers are compared token for token.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from specdraft import registry
from specdraft.attack.continuous import ContinuousConfig, attack_continuous, window
from specdraft.attack.detection import rates, replay
from specdraft.attack.discrete import DiscreteConfig, attack_discrete
from specdraft.attack.lookup import FILLER, attack_lookup
from specdraft.attack.losses import (
    Models,
    greedy_from_embeds,
    perplexity,
    simulated_accepted_length,
    teacher_forced,
)
from specdraft.bench.harness import Totals, engine_method, run_prompt, warm_up
from specdraft.bench.prompts import BenchPrompt
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.policy import make_policy

METHODS = ("continuous", "discrete", "lookup")


@dataclass
class AttackOptions:
    """What :func:`run_attack` does.

    Attributes:
        method: ``continuous``, ``discrete`` or ``lookup``.
        k: the fixed draft length of the undefended measurement (and of the simulations).
        max_new_tokens: generation budget per prompt.
        prefix_tokens: the identical-prefix check compares the first N greedy tokens.
        continuous: the continuous attack's settings.
        discrete: the discrete attack's settings.
        suffix_len: tokens of the discrete attack's suffix.
        max_decoys: decoys the lookup attack may add.
        min_rouge: the lookup attack keeps a decoy only if the target's answer keeps this ROUGE-L
            to the clean one.
        progress: one line per prompt on stderr.
    """

    method: str
    k: int = 5
    max_new_tokens: int = 32
    prefix_tokens: int = 32
    continuous: ContinuousConfig = field(default_factory=ContinuousConfig)
    discrete: DiscreteConfig = field(default_factory=DiscreteConfig)
    suffix_len: int = 8
    max_decoys: int = 8
    min_rouge: float = 0.5
    progress: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpecdraftError(f"unknown attack method {self.method!r}: use {', '.join(METHODS)}")
        if self.k < 1 or self.max_new_tokens < 1 or self.prefix_tokens < 1 or self.suffix_len < 1:
            raise SpecdraftError("k, max_new_tokens, prefix_tokens and suffix_len must be >= 1")


@dataclass
class AttackRun:
    """The outputs: ``rows`` for ``attacked.jsonl`` (Spec-Bench format), ``result`` for ``attack.json``."""

    rows: list[dict]
    result: dict


# ------------------------------------------------------------------------------------ models
def _fp32(model: torch.nn.Module) -> torch.nn.Module:
    if next(model.parameters()).dtype == torch.float32:
        return model
    import copy

    return copy.deepcopy(model).float().requires_grad_(False)


def layer_subset(model: torch.nn.Module, layers: list[int]) -> torch.nn.Module:
    """A transformers Llama that runs only ``layers`` of ``model`` (shared parameters, no copy)."""
    import copy

    inner = copy.copy(model.model)
    inner._modules = dict(inner._modules)
    inner.layers = torch.nn.ModuleList([model.model.layers[i] for i in layers])
    sub = copy.copy(model)
    sub._modules = dict(sub._modules)
    sub.model = inner
    return sub


def diff_models(pipe) -> Models:
    """The differentiable target and draft of a pipeline (fp32 transformers models).

    Raises:
        SpecdraftError: the draft has no differentiable model (prompt lookup, bigram, none, or a
            feature-conditioned draft, which reads target hidden states).
    """
    target = pipe.target.model
    if target is None:
        raise SpecdraftError("the attack needs the target's transformers model (not --dtype q)")
    target = _fp32(target)
    spec = registry.DraftSpec.parse(pipe.draft_spec)
    if spec.kind == "self":
        return Models(target, target)
    if spec.kind == "prune":
        n = target.config.num_hidden_layers
        if max(spec.layers) >= n:
            raise SpecdraftError(f"prune:{spec.arg}: the target has {n} layers")
        if spec.head is not None:
            raise SpecdraftError(f"prune:{spec.arg}: the attack's pruned draft has the whole head (no head=)")
        return Models(target, layer_subset(target, spec.layers))
    if spec.kind == "designed" and not isinstance(pipe.drafter, PromptLookupDrafter):
        from specdraft.design.artifact import find_draft, load_draft

        draft, meta, _ = load_draft(find_draft(spec.arg, pipe.target.model), target, torch.float32)
        if meta.kind != "layers":
            raise SpecdraftError(
                "feature-conditioned drafts are not attackable yet (they read target states)"
            )
        head = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
        return Models(target, draft.requires_grad_(False), head)
    if spec.kind == "model":
        from specdraft.models.loading import load_model

        return Models(target, load_model(spec.arg, torch.float32).model)
    raise SpecdraftError(
        f"draft {pipe.draft_spec!r} has no differentiable model: the continuous and discrete attacks "
        "need a model draft (prune:, designed:, self or a model); use --method lookup for prompt lookup"
    )


# ------------------------------------------------------------------------------------ stealth
def rouge_l(a: list[int], b: list[int]) -> float:
    """ROUGE-L F1 of two token sequences: ``2 P R / (P + R)`` with ``P = LCS / len(a)``,
    ``R = LCS / len(b)`` (Lin 2004); 1.0 for two empty sequences."""
    if not a and not b:
        return 1.0
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, z in enumerate(b):
            cur.append(prev[j] + 1 if x == z else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    return 2 * lcs / (len(a) + len(b))


def message_span(encode, text: str) -> tuple[int, int]:
    """``(head, tail)``: how many ids the chat template puts before and after a message, found as
    the common prefix and suffix of two encodings that differ only in the message; ``(0, 0)``
    when ``text``'s own encoding does not share them."""
    a, b = encode("Alpha"), encode("Zulu")
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    ids = encode(text)
    if ids[:head] != a[:head] or (tail and ids[len(ids) - tail :] != a[len(a) - tail :]):
        return 0, 0
    return head, tail


def _allowed_tokens(tokenizer, vocab_size: int) -> torch.Tensor:
    """``(V,)`` bool: tokens whose text is printable ASCII (what a client would type)."""
    special = set(tokenizer.all_special_ids)
    ok = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(min(vocab_size, len(tokenizer))):
        s = tokenizer.decode([i])
        ok[i] = i not in special and bool(s.strip()) and s.isascii() and s.isprintable()
    return ok


# ------------------------------------------------------------------------------------ measure
def _side(runs: dict, totals: dict[str, Totals]) -> dict:
    for name, r in runs.items():
        totals[name].add(r)
    spec, defended = runs["spec"], runs["defended"]
    return {
        "tokens": runs["plain"].tokens,
        "mean_accepted": round(spec.stats.mean_accepted_length, 4),
        "plain_s": round(runs["plain"].seconds, 4),
        "spec_s": round(spec.seconds, 4),
        "defended_s": round(defended.seconds, 4),
        "defended_mean_accepted": round(defended.stats.mean_accepted_length, 4),
        "collapsed": getattr(defended.stats, "collapsed", None),
    }


def _speedup(totals: dict[str, Totals], name: str) -> float | None:
    plain = totals["plain"].tokens_per_s
    return round(totals[name].tokens_per_s / plain, 4) if plain > 0 and totals[name].tokens else None


def _flagged(records: list[dict], side: str) -> float | None:
    """Share of prompts the defense flagged on ``side``; None when the engine reports no flags."""
    flags = [r[side]["collapsed"] for r in records]
    return None if any(f is None for f in flags) else _mean([float(f > 0) for f in flags])


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def run_attack(pipe, prompts: list[BenchPrompt], options: AttackOptions) -> AttackRun:
    """Attack every prompt and measure it (module docstring)."""
    o = options
    lookup = o.method == "lookup"
    if lookup and not isinstance(pipe.drafter, PromptLookupDrafter):
        raise SpecdraftError("--method lookup attacks prompt lookup: use --draft lookup (or lookup:N)")
    if pipe.drafter is None:
        raise SpecdraftError("--draft none: there is no drafter to attack")
    models = None if lookup else diff_models(pipe)
    tok, eos = pipe.tokenizer, pipe.eos_ids
    methods = [
        engine_method("plain", pipe.runtime, None, eos_ids=eos),
        engine_method("spec", pipe.runtime, pipe.drafter, make_policy(o.k), eos),
        engine_method("defended", pipe.runtime, pipe.drafter, make_policy("auto"), eos),
    ]
    clean_tot = {m.name: Totals() for m in methods}
    att_tot = {m.name: Totals() for m in methods}
    allowed = None
    if o.method == "discrete":
        allowed = _allowed_tokens(tok, models.target_embedding.shape[0])
    n_prefix = min(o.prefix_tokens, o.max_new_tokens)
    rows, records = [], []
    for i, p in enumerate(prompts):
        text = p.turns[0]
        ids = pipe.encode(text)
        if i == 0:
            warm_up(methods, ids, o.max_new_tokens)
        clean = _side(run_prompt(methods, ids, i, o.max_new_tokens), clean_tot)
        y = clean["tokens"]
        rec = {"id": p.id, "category": p.category, "clean": clean}
        t0 = time.perf_counter()
        if o.method == "continuous":
            attacked_text, detail = _continuous(pipe, models, ids, text, o, n_prefix, rec)
        elif o.method == "discrete":
            attacked_text, detail = _discrete(pipe, models, ids, text, y, o, allowed)
        else:
            attacked_text, detail = _lookup(pipe, methods[0], text, y, o)
        rec["attack_seconds"] = round(time.perf_counter() - t0, 3)
        rec["attack"] = detail
        if o.method != "continuous":
            att_ids = pipe.encode(attacked_text)
            attacked = _side(run_prompt(methods, att_ids, i, o.max_new_tokens), att_tot)
            rec["attacked"] = attacked
            rec["identical_prefix"] = attacked["tokens"][:n_prefix] == y[:n_prefix]
            rec["rouge_l"] = round(rouge_l(y, attacked["tokens"]), 4)
            if pipe.target.model is not None:
                rec["perplexity"] = {
                    "clean": round(perplexity(pipe.target.model, ids), 3),
                    "attacked": round(perplexity(pipe.target.model, att_ids), 3),
                }
        rows.append(
            {"question_id": p.id, "category": p.category, "turns": [attacked_text], "attack": o.method}
        )
        if o.method == "continuous":
            rows[-1]["nearest_token_projection"] = True
        records.append(rec)
        if o.progress:
            sim = rec.get("simulated")
            before = sim["mean_accepted"] if sim else clean["mean_accepted"]
            after = sim["attacked_mean_accepted"] if sim else rec["attacked"]["mean_accepted"]
            print(
                f"[{i + 1}/{len(prompts)}] {p.id}: mean accepted {before} -> {after}, identical prefix "
                f"{rec['identical_prefix']}, attack {rec['attack_seconds']} s",
                file=sys.stderr,
            )
    catch_up = getattr(pipe.drafter, "read_back", -1) + 1  # replay's read-backs (0: none)
    return AttackRun(rows, _result(records, clean_tot, att_tot, o, catch_up))


def _continuous(pipe, models: Models, ids, text, o: AttackOptions, n_prefix: int, rec: dict):
    """The continuous attack on one prompt: its nearest-token text and details; fills
    ``rec["simulated"]`` (fixed-k mean accepted lengths), the stealth fields."""
    Et = models.target_embedding
    head, tail = message_span(pipe.encode, text)
    positions = torch.zeros(len(ids), dtype=torch.bool)
    positions[head : len(ids) - tail] = True
    positions = window(positions, o.continuous)
    x = Et[torch.tensor(ids)].detach().unsqueeze(0)
    y = greedy_from_embeds(models.target, x, o.max_new_tokens)
    found = attack_continuous(models, ids, y, o.continuous, positions)
    xa = x + found.delta.unsqueeze(0)
    y_att = greedy_from_embeds(models.target, xa, o.max_new_tokens)
    hits, attacked_hits = _matches(models, ids, None, y), _matches(models, ids, found.delta, y_att)
    rec["simulated"] = {
        "mean_accepted": round(simulated_accepted_length(hits, o.k), 4),
        "attacked_mean_accepted": round(simulated_accepted_length(attacked_hits, o.k), 4),
        "hits": "".join("01"[h] for h in hits),
        "attacked_hits": "".join("01"[h] for h in attacked_hits),
    }
    rec["identical_prefix"] = y_att[:n_prefix] == y[:n_prefix]
    rec["rouge_l"] = round(rouge_l(y, y_att), 4)
    nearest = torch.cdist(xa[0], Et.detach()).argmin(1).tolist()  # (Tp,)
    text_ids = nearest[head : len(ids) - tail]
    detail = {
        "degradation": found.degradation,
        "preservation": found.preservation,
        "delta_norm_mean": round(float(found.delta.norm(dim=1)[positions].mean()), 4),
        "tokens_changed_by_projection": sum(a != b for a, b in zip(nearest, ids)),
        "history": found.history,
    }
    return pipe.tokenizer.decode(text_ids, skip_special_tokens=True), detail


@torch.no_grad()
def _matches(models: Models, ids: list[int], delta, y: list[int]) -> list[bool]:
    """Per position of ``y``, whether the draft's argmax after ``prompt (+ delta) + y[:i]`` is ``y_i``."""
    ids_t, ys = torch.tensor(ids), torch.tensor(y)
    xd = models.draft_embedding[ids_t]
    if delta is not None:
        xd = xd + delta
    x = teacher_forced(xd.unsqueeze(0), models.draft_embedding[ys].unsqueeze(0))
    logq = models.draft_logprobs(x, keep=len(y))[0]  # (n, V)
    return (logq.argmax(-1) == ys).tolist()


def _replayed(records: list[dict], catch_up: int) -> dict:
    """The continuous attack's detection (module docstring): each prompt's clean then attacked
    first-token outcomes replayed through one policy; :func:`specdraft.attack.detection.rates`."""
    requests, adversarial = [], []
    for r in records:
        for key, attacked in (("hits", False), ("attacked_hits", True)):
            requests.append([int(c) for c in r["simulated"][key]])
            adversarial.append(attacked)
    return rates(replay(requests, catch_up=catch_up), adversarial)


def _lookup(pipe, plain, text: str, y: list[int], o: AttackOptions):
    """The lookup attack on one prompt: the attacked message and details (decoys kept, the
    simulated mean accepted length after each); ``plain`` decodes each trial."""
    wrong = pipe.tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    found = attack_lookup(
        pipe.drafter,
        text,
        pipe.encode,
        pipe.tokenizer.decode,
        lambda ids: plain.run(ids, o.max_new_tokens).tokens,
        lambda answer: rouge_l(y, answer) >= o.min_rouge,
        y,
        o.k,
        wrong,
        o.max_decoys,
    )
    return found.text, {"decoys": found.decoys, "simulated": found.simulated}


NEUTRAL = (
    " Please answer briefly and clearly.",
    " Thank you for your help with this.",
    " Answer in a few sentences, please.",
    " I would appreciate a clear answer.",
)
"""Initial suffixes of the discrete attack: polite closings that rarely change the target's answer
(the search starts from the best of these and the " ! ! !" suffix that keeps the argmax)."""


def _cycle(ids: list[int], m: int) -> list[int]:
    """``ids`` repeated and cut to ``m`` tokens."""
    return (ids * (m // max(len(ids), 1) + 1))[:m]


def _discrete(pipe, models: Models, ids, text, y, o: AttackOptions, allowed):
    """The discrete attack on one prompt: the attacked message and details."""
    tok = pipe.tokenizer
    _, tail_n = message_span(pipe.encode, text)
    head, tail = ids[: len(ids) - tail_n], ids[len(ids) - tail_n :]
    bang = tok(" !" * o.suffix_len, add_special_tokens=False)["input_ids"][: o.suffix_len]

    def valid(s: list[int]) -> bool:
        return pipe.encode(text + tok.decode(s)) == head + s + tail

    starts = [_cycle(tok(p, add_special_tokens=False)["input_ids"], o.suffix_len) for p in NEUTRAL]
    starts = [s for s in starts if valid(s)]
    found = attack_discrete(
        models,
        head,
        tail,
        y,
        _cycle(bang, o.suffix_len),
        o.discrete,
        allowed,
        valid,
        clean=ids,
        starts=starts,
    )
    detail = {
        "suffix": tok.decode(found.suffix),
        "suffix_ids": found.suffix,
        "start": tok.decode(found.start),
        "loss": found.loss,
        "degradation": found.degradation,
        "keeps_argmax": found.keeps_argmax,
        "history": found.history,
    }
    return text + tok.decode(found.suffix), detail


def _halving(clean_acc: list[float], att_acc: list[float]) -> dict:
    """``halved_rate`` and ``draft_halved_rate`` (the notes in :func:`_result` define them)."""
    pairs = list(zip(clean_acc, att_acc))
    drafts = [(c - 1, a - 1) for c, a in pairs if c - 1 > 0.05]
    return {
        "halved_rate": _mean([float(a <= 0.5 * c) for c, a in pairs if c]),
        "draft_halved_rate": _mean([float(a <= 0.5 * c) for c, a in drafts]),
    }


def _by_category(records: list[dict]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        out.setdefault(r["category"], []).append(i)
    return out


def _result(records: list[dict], clean_tot, att_tot, o: AttackOptions, catch_up: int = 0) -> dict:
    continuous = o.method == "continuous"
    side = "simulated" if continuous else None
    clean_acc = [r[side]["mean_accepted"] if side else r["clean"]["mean_accepted"] for r in records]
    att_acc = [r[side]["attacked_mean_accepted"] if side else r["attacked"]["mean_accepted"] for r in records]
    overall = {
        "clean_mean_accepted": _mean(clean_acc),
        "attacked_mean_accepted": _mean(att_acc),
        **_halving(clean_acc, att_acc),
        "identical_prefix_rate": _mean([float(r["identical_prefix"]) for r in records]),
        "rouge_l": _mean([r["rouge_l"] for r in records]),
        "clean_speedup": _speedup(clean_tot, "spec"),
        "attacked_speedup": None if continuous else _speedup(att_tot, "spec"),
        "defended_speedup": None if continuous else _speedup(att_tot, "defended"),
        "detected_rate": None,
        "false_positive_rate": _flagged(records, "clean"),
        "defended_mean_accepted": None
        if continuous
        else _mean([r["attacked"]["defended_mean_accepted"] for r in records]),
        "clean_defended_mean_accepted": _mean([r["clean"]["defended_mean_accepted"] for r in records]),
        "clean_defended_speedup": _speedup(clean_tot, "defended"),
        "attack_seconds_mean": _mean([r["attack_seconds"] for r in records]),
        "prompts": len(records),
    }
    if continuous:
        overall.update(_replayed(records, catch_up))
    else:
        overall["detected_rate"] = _flagged(records, "attacked")
        overall["perplexity_clean"] = _mean([r.get("perplexity", {}).get("clean") for r in records])
        overall["perplexity_attacked"] = _mean([r.get("perplexity", {}).get("attacked") for r in records])
    overall["by_category"] = {}
    for cat, idx in _by_category(records).items():
        clean, attacked = [clean_acc[i] for i in idx], [att_acc[i] for i in idx]
        overall["by_category"][cat] = {
            "prompts": len(idx),
            "clean_mean_accepted": _mean(clean),
            "attacked_mean_accepted": _mean(attacked),
            **_halving(clean, attacked),
        }
    notes = {
        "mean_accepted": f"fixed k = {o.k} (undefended), bonus token included, mean over prompts",
        "speedup": "tokens/s (prefill included) over plain decoding's on the same prompts, interleaved",
        "defended": "--k auto: the cost-aware policy with its per-request collapse flag (issue 17 "
        "defense); detected_rate / false_positive_rate: share of attacked / clean prompts it flagged "
        "(clean = the clean versions of these prompts, not the whole Spec-Bench)"
        + (
            "; continuous: replayed from the simulated first-token outcomes (notes.continuous)"
            if continuous
            else ""
        ),
        "rouge_l": "F1 of the token LCS between the clean and attacked greedy answers",
        "halved_rate": "share of prompts whose attacked mean accepted length (bonus included) is <= 50% "
        "of the clean one: out of reach where the clean one is below 2.0, as the attacked one is >= 1.0",
        "draft_halved_rate": "share of prompts whose accepted draft tokens per step (mean accepted "
        "length - 1) are <= 50% of the clean ones, over prompts that had some (> 0.05) to remove",
    }
    if continuous:
        notes["continuous"] = (
            "input embeddings are not text: mean accepted lengths simulated exactly (greedy, fixed k) on "
            "the fp32 differentiable models, stealth from their greedy outputs; attacked_speedup and "
            "defended_speedup are null (the engine takes tokens); detected_rate, false_positive_rate and "
            "median_steps_to_flag replay each prompt's clean then attacked first-token outcomes (hits, "
            "attacked_hits: one per position) through one policy's detection at batch 1, "
            f"{max(catch_up - 1, 0)} outcomes read back per catch-up at most "
            "(specdraft.attack.detection.replay); attacked.jsonl holds the nearest-token projection, not "
            "the attack"
        )
    config = {
        "method": o.method,
        "k": o.k,
        "max_new_tokens": o.max_new_tokens,
        "prefix_tokens": min(o.prefix_tokens, o.max_new_tokens),
        "turns": "first turn of each prompt only",
    }
    if continuous:
        config["continuous"] = vars(o.continuous)
    elif o.method == "discrete":
        config["discrete"] = vars(o.discrete) | {"suffix_len": o.suffix_len}
    else:
        config["max_decoys"], config["min_rouge"] = o.max_decoys, o.min_rouge
    return {"config": config, "overall": overall, "notes": notes, "prompts": records}
