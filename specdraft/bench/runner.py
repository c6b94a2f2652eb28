"""Spec-Bench-style evaluation: speculative vs plain decoding of the same target, interleaved.

For every prompt, in one process: plain decoding with the engine (k = 0), speculative decoding
with the drafter and (with ``--baselines hf``) transformers ``generate`` plain, assisted and prompt
lookup, in the order :func:`specdraft.bench.harness.interleave` gives prompt i (A B, then B A; with
more methods a rotation). Running the methods back to back on each prompt, after one warm-up of
each, means a slow phase of a shared machine hits all of them, and rotating the order keeps a drift
within a prompt from always favouring the same method, so their ratios hold even when absolute
times drift. The methods, the timing and the equality check are :mod:`specdraft.bench.harness`'s.

Conventions
-----------
- tokens/s: generated tokens / wall seconds of the call that produced them, prefill included
  (what a user waits for). Totals are sums of tokens over sums of seconds, never a mean of rates.
- speedup: speculative tokens/s / plain tokens/s over the same prompts.
- mean accepted tokens: output tokens per target forward with the bonus token (plain = 1.0), as
  :class:`specdraft.stats.SpecStats` defines it; acceptance: accepted / drafted tokens.
- equality (greedy only): each prompt's speculative output against the plain run with
  :func:`specdraft.bench.harness.equality`: ``identical``, ``tie-divergent`` (first difference at a
  near-tie of the plain run; bf16 only) or ``divergent``. fp32 uses tolerance 0: any difference is
  divergent (int8 and bf16 use :data:`specdraft.lossless.DEFAULT_TOLERANCE`). When outputs differ
  the plain turn is re-run once recording its logit margins. Sampling runs are not classified (the
  counts are None).
- multi-turn questions: the second turn is asked after the method's *own* first answer, through the
  chat template; a prompt's tokens and seconds add up over its turns. If the first turns differ, the
  prompt's class is the first turn's (the second turns had different contexts).
- prompt budget: the context window less ``max_new_tokens`` and the cache room the speculative
  engine reserves (:attr:`specdraft.engine.Engine.reserve`), at most ``--max-prompt-tokens``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from specdraft import lossless
from specdraft.api import Pipeline
from specdraft.bench import harness
from specdraft.bench.harness import Method, Run
from specdraft.bench.llamacpp_baselines import LLAMACPP_METHODS, agreement
from specdraft.bench.prompts import BenchPrompt, fit_context
from specdraft.errors import SpecdraftError
from specdraft.policy import make_policy
from specdraft.stats import SpecStats
from specdraft.verify import SamplingParams

CLASSES = (lossless.IDENTICAL, lossless.TIE_DIVERGENT, lossless.DIVERGENT)
HF_METHODS = ("hf_plain", "hf_assisted", "hf_prompt_lookup")
BF16_METHODS = ("bf16_plain",)  # the target's bf16 compact runtime beside a quantized one
BASELINE_METHODS = HF_METHODS + LLAMACPP_METHODS + BF16_METHODS
AGREEMENT_METHODS = LLAMACPP_METHODS + BF16_METHODS  # other runtimes: greedy agreement, not equality
BASELINES = ("hf", "llamacpp", "bf16")
WARMUP_TOKENS = 8


@dataclass
class BenchOptions:
    """How to run a benchmark.

    Attributes:
        k: draft length: an integer >= 1, ``auto`` (cost-aware) or ``heuristic``.
        max_new_tokens: generation budget per turn.
        params: sampling parameters (temperature 0 = greedy); a sampling run seeds prompt i with
            ``seed + i`` (seed 0 when unset), the same for every method.
        baselines: ``"hf"`` adds the transformers baselines, ``"llamacpp"`` llama.cpp's
            (:mod:`specdraft.bench.llamacpp_baselines`; needs llama-cpp-python, ``make peers``),
            ``"bf16"`` the target's bf16 compact runtime, plain (``bf16_plain``: how far a
            quantized runtime's greedy output is from it).
        long_prompts: ``truncate`` (cut the middle) or ``skip`` prompts longer than the budget.
        max_prompt_tokens: cap on prompt tokens (None: the context window allows).
        tolerance: near-tie margin for the equality check; None: 0 in fp32, else
            :data:`specdraft.lossless.DEFAULT_TOLERANCE`.
        progress: show a progress bar on stderr.
        warmup: run every method once before measuring.
        time_budget_s: start a prompt only if the run (warm-up included) is expected to end within
            this many seconds, expecting the mean duration of the prompts so far (None: no limit;
            the first prompt always runs); prompts left out are listed in ``skipped``.
    """

    k: str | int = 5
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)
    baselines: tuple[str, ...] = ()
    long_prompts: str = "truncate"
    max_prompt_tokens: int | None = None
    tolerance: float | None = None
    progress: bool = True
    warmup: bool = True
    time_budget_s: float | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise SpecdraftError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.long_prompts not in ("truncate", "skip"):
            raise SpecdraftError(f"unknown long-prompt mode {self.long_prompts!r}: use truncate or skip")
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise SpecdraftError(
                f"unknown baseline {', '.join(unknown)}: use --baselines hf, llamacpp, bf16 or a list"
            )
        if "llamacpp" in self.baselines:
            from specdraft.bench.llamacpp_baselines import require

            require()  # before any model loads: one line saying how to install it
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise SpecdraftError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")

    @property
    def fixed_k(self) -> int | None:
        s = str(self.k).strip()
        return int(s) if s.isdigit() else None


@dataclass
class MethodRun:
    """One method's answer to one prompt (all its turns)."""

    turns: list[list[int]] = field(default_factory=list)  # output tokens per turn
    prompt_ids: list[list[int]] = field(default_factory=list)  # fed prompt ids per turn
    seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)  # the engine's, over the turns
    notes: list[str] = field(default_factory=list)
    dropped: int = 0

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.turns)

    def as_run(self) -> Run:
        """All turns as one run: their tokens, summed seconds and merged statistics."""
        return Run([t for turn in self.turns for t in turn], self.seconds, self.stats)

    def add(self, ids: list[int], run: Run) -> None:
        self.prompt_ids.append(ids)
        self.turns.append(run.tokens)
        self.seconds += run.seconds
        if run.stats is not None:
            self.stats.merge(run.stats)


@dataclass
class BenchResult:
    """What :func:`run_bench` measured; :meth:`as_dict` is the ``--json`` document."""

    config: dict
    overall: dict
    categories: dict[str, dict]
    prompts: list[dict]
    skipped: list[dict]

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------ decoding
def _encode_turn(pipe: Pipeline, history: list[dict]) -> list[int]:
    """Chat models get the chat template; others a plain concatenation of the conversation."""
    if pipe.target.is_chat():
        return pipe.encode(history, chat=True)
    return pipe.encode("\n\n".join(m["content"] for m in history), chat=False)


def converse(
    pipe: Pipeline, prompt: BenchPrompt, decode: Callable[[list[int]], Run], budget: int, mode: str
) -> MethodRun:
    """Ask the turns of ``prompt`` in order, each after the method's own previous answers."""
    out = MethodRun()
    history: list[dict] = []
    for t, text in enumerate(prompt.turns):
        history.append({"role": "user", "content": text})
        fitted = fit_context(_encode_turn(pipe, history), budget, mode)
        if fitted.message:
            out.notes.append(f"turn {t + 1} {fitted.message}")
        if fitted.ids is None:
            break
        out.dropped += fitted.dropped
        run = decode(fitted.ids)
        out.add(fitted.ids, run)
        answer = pipe.tokenizer.decode(run.tokens, skip_special_tokens=True).strip()
        history.append({"role": "assistant", "content": answer})
    return out


def _classify(
    pipe: Pipeline, plain: MethodRun, spec: MethodRun, max_new_tokens: int, tol: float
) -> tuple[str, int | None]:
    """The prompt's equality class and the first differing output index (of the first differing turn)."""
    for ids, p_out, s_out in zip(plain.prompt_ids, plain.turns, spec.turns):
        if p_out != s_out:
            return harness.equality(pipe.runtime, ids, p_out, s_out, max_new_tokens, pipe.eos_ids, tol)
    return lossless.IDENTICAL, None  # equal first turns give equal later contexts, so equal turn counts


def _prompt_params(params: SamplingParams, i: int) -> SamplingParams:
    """Prompt i's sampling parameters: greedy as given; sampling seeded with ``seed + i``."""
    if params.greedy:
        return params
    return SamplingParams(params.temperature, params.top_k, params.top_p, (params.seed or 0) + i)


# ------------------------------------------------------------------------------------ aggregation
@dataclass
class _Tally:
    """Sums over prompts, turned into the figures of one table row."""

    prompts: int = 0
    methods: dict[str, harness.Totals] = field(default_factory=dict)
    classes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    classified: bool = True
    shared: dict[str, list[int]] = field(default_factory=dict)  # method -> [shared, plain tokens, equal]
    forced: list[int] = field(default_factory=lambda: [0, 0])  # llama.cpp fed our output: [matches, tokens]

    def add(self, row: dict, runs: dict[str, MethodRun]) -> None:
        self.prompts += 1
        for method, run in runs.items():
            self.methods.setdefault(method, harness.Totals()).add(run.as_run())
            if row.get(f"{method}_shared_tokens") is not None:
                sums = self.shared.setdefault(method, [0, 0, 0])
                sums[0] += row[f"{method}_shared_tokens"]
                sums[1] += row["plain_new_tokens"]
                sums[2] += row[f"{method}_first_difference"] is None
        if row.get("llamacpp_forced_matches") is not None:
            self.forced[0] += row["llamacpp_forced_matches"]
            self.forced[1] += row["plain_new_tokens"]
        if row["equality"] is None:
            self.classified = False
        else:
            self.classes[row["equality"]] += 1

    def rate(self, method: str) -> float | None:
        return self.methods[method].tokens_per_s if method in self.methods else None

    def summary(self) -> dict:
        spec, plain = self.rate("spec"), self.rate("plain")
        stats = self.methods["spec"].stats if "spec" in self.methods else SpecStats()
        out = {
            "prompts": self.prompts,
            "tokens_per_s": _r(spec),
            "plain_tokens_per_s": _r(plain),
            "speedup": _r(spec / plain if spec and plain else None),
            "mean_accepted_tokens": _r(stats.mean_accepted_length),
            "acceptance_rate": _r(stats.acceptance_rate),
            "new_tokens": self._tokens("spec"),
            "plain_new_tokens": self._tokens("plain"),
            "seconds": _r(self._seconds("spec")),
            "plain_seconds": _r(self._seconds("plain")),
            "draft_time_s": _r(stats.draft_time),
            "target_time_s": _r(stats.target_time),
            "prefill_time_s": _r(stats.prefill_time),
            "per_position_acceptance": [round(x, 4) for x in stats.per_position_acceptance()],
            "collapsed": stats.collapsed,
        }
        for cls in CLASSES:
            out[cls.replace("-", "_")] = self.classes[cls] if self.classified else None
        for method in BASELINE_METHODS:
            rate = self.rate(method)
            if rate is not None:
                out[f"{method}_tokens_per_s"] = _r(rate)
                out[f"{method}_new_tokens"] = self._tokens(method)
                out[f"speedup_vs_{method}"] = _r(spec / rate if spec and rate else None)
                out[f"plain_speedup_vs_{method}"] = _r(plain / rate if plain and rate else None)
        for method, (shared, total, equal) in self.shared.items():
            # greedy token agreement with specdraft's plain output: leading tokens shared, summed
            out[f"{method}_agreement"] = _r(shared / total if total else None)
            out[f"{method}_identical"] = equal
        if self.forced[1]:
            out["llamacpp_forced_agreement"] = _r(self.forced[0] / self.forced[1])
        return out

    def _tokens(self, method: str) -> int:
        return self.methods[method].tokens if method in self.methods else 0

    def _seconds(self, method: str) -> float | None:
        return self.methods[method].seconds if method in self.methods else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


# ------------------------------------------------------------------------------------ the run
def run_bench(
    pipe: Pipeline,
    prompts: list[BenchPrompt],
    options: BenchOptions,
    log: Callable[[str], None] | None = None,
) -> BenchResult:
    """Benchmark ``pipe``'s drafter against plain decoding (and transformers) on ``prompts``.

    Args:
        pipe: target and drafter (the drafter must not be None).
        prompts: the questions, e.g. from :func:`specdraft.bench.prompts.load_prompts`.
        options: k, budget, sampling, baselines, long-prompt handling.
        log: where notes go (truncated or skipped prompts); default stderr.

    Returns:
        Per-prompt rows, per-category and overall figures (module docstring for definitions).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    _check(pipe, prompts, options)
    hf = _hf_baselines(pipe, options, log) if "hf" in options.baselines else None
    lc = _llamacpp_baselines(pipe, options) if "llamacpp" in options.baselines else None
    methods = _methods(pipe, options, hf, lc)
    if "bf16" in options.baselines:
        methods.append(harness.engine_method("bf16_plain", _bf16_runtime(pipe), eos_ids=pipe.eos_ids))
    budget = harness.prompt_budget(pipe.runtime, methods, options.max_new_tokens, options.max_prompt_tokens)
    if budget < 2:
        raise SpecdraftError(
            f"--max-new-tokens {options.max_new_tokens} leaves no room for a prompt in the context "
            f"window ({pipe.runtime.max_context})"
        )
    if lc is not None:  # room for the longest prompt, the new tokens and one draft past them
        lc.load(budget + options.max_new_tokens + lc.lookup_tokens + 1)
        log(f"note: {lc.note}")
    tol = harness.tolerance(pipe.runtime, options.tolerance)

    started = time.perf_counter()
    if options.warmup:
        first = [{"role": "user", "content": prompts[0].turns[0]}]
        ids = fit_context(_encode_turn(pipe, first), min(budget, 64), "truncate").ids
        harness.warm_up(
            methods, ids, min(WARMUP_TOKENS, options.max_new_tokens), _prompt_params(options.params, 0)
        )
    warmup_s = time.perf_counter() - started

    overall, categories = _Tally(), {}
    rows, skipped = [], []
    bar = _progress(len(prompts), options.progress)
    try:
        for i, prompt in enumerate(prompts):
            if _out_of_time(options, prompts, i, started, warmup_s, skipped, log):
                break
            runs = _bench_prompt(pipe, prompt, i, methods, options, budget)
            for note in runs["plain"].notes:
                log(f"prompt {prompt.id} ({prompt.category}): {note}")
            if not runs["plain"].turns:
                skipped.append(
                    {"id": prompt.id, "category": prompt.category, "reason": "; ".join(runs["plain"].notes)}
                )
            else:
                row = _row(pipe, prompt, runs, options, tol, lc)
                rows.append(row)
                overall.add(row, runs)
                categories.setdefault(prompt.category, _Tally()).add(row, runs)
            _advance(bar, overall)
    finally:
        if bar is not None:
            bar.close()
    if not rows:
        raise SpecdraftError(
            "every prompt was skipped: none fits the context window (use --long-prompts truncate)"
        )
    return BenchResult(
        config=_config(pipe, options, hf, lc, budget, tol),
        overall=overall.summary(),
        categories={c: t.summary() for c, t in categories.items()},
        prompts=rows,
        skipped=skipped,
    )


def _check(pipe: Pipeline, prompts: list[BenchPrompt], options: BenchOptions) -> None:
    if pipe.drafter is None:
        raise SpecdraftError(
            "bench compares speculative with plain decoding: give a draft (--draft), not none"
        )
    if options.fixed_k == 0:
        raise SpecdraftError(
            "bench compares speculative with plain decoding: use --k >= 1, auto or heuristic"
        )
    if not prompts:
        raise SpecdraftError("no prompts to benchmark")


def _hf_baselines(pipe: Pipeline, options: BenchOptions, log: Callable[[str], None]):
    from transformers.utils import logging as hf_logging

    from specdraft.bench.hf_baselines import build_hf_baselines

    hf = build_hf_baselines(pipe, options.fixed_k)
    if "hf_assisted" not in hf.methods:
        log(f"note: no transformers assisted baseline: {hf.assistant_note}")
    else:
        log(f"note: transformers assistant: {hf.assistant_note}")
    hf_logging.set_verbosity_error()
    return hf


def _llamacpp_baselines(pipe: Pipeline, options: BenchOptions):
    from specdraft.bench.llamacpp_baselines import build_llamacpp_baselines

    return build_llamacpp_baselines(
        pipe.target.name, torch.get_num_threads(), pipe.eos_ids, options.fixed_k, pipe.draft_spec
    )


def _bf16_runtime(pipe: Pipeline):
    """The target in the bf16 compact runtime (``--baselines bf16``), its transformers model loaded."""
    from specdraft.models.loading import load_model
    from specdraft.models.runtime import make_runtime

    loaded = pipe.target if pipe.target.model is not None else load_model(pipe.target.name, torch.float32)
    return make_runtime(loaded, "compact", torch.bfloat16)


def _methods(pipe: Pipeline, options: BenchOptions, hf, lc=None) -> list[Method]:
    """plain, spec, the transformers and the llama.cpp baselines, in this order (prompt 0's)."""
    policy = make_policy(options.k)  # one policy for the whole run: an adaptive one keeps learning
    methods = [
        harness.engine_method("plain", pipe.runtime, None, eos_ids=pipe.eos_ids),
        harness.engine_method("spec", pipe.runtime, pipe.drafter, policy, eos_ids=pipe.eos_ids),
    ]
    for name in hf.methods if hf else ():
        methods.append(harness.baseline_method(name, lambda ids, n, p, m=name: hf.run(m, ids, n, p)))
    for name in lc.methods if lc else ():
        methods.append(harness.baseline_method(name, lambda ids, n, p, m=name: lc.run(m, ids, n, p)))
    return methods


def _bench_prompt(
    pipe: Pipeline, prompt: BenchPrompt, i: int, methods: list[Method], options: BenchOptions, budget: int
) -> dict[str, MethodRun]:
    """Every method on prompt ``i``, in the harness's interleaved order; runs by method name."""
    params = _prompt_params(options.params, i)
    runs: dict[str, MethodRun] = {}
    for method in harness.interleave(methods, i):
        decode = partial(method.run, max_new_tokens=options.max_new_tokens, params=params)
        runs[method.name] = converse(pipe, prompt, decode, budget, options.long_prompts)
    return {m.name: runs[m.name] for m in methods}


def _out_of_time(
    options: BenchOptions,
    prompts: list[BenchPrompt],
    i: int,
    started: float,
    warmup_s: float,
    skipped: list[dict],
    log: Callable[[str], None],
) -> bool:
    """Whether prompt ``i`` would end past the time budget; if so the prompts left are ``skipped``."""
    if i == 0 or options.time_budget_s is None:
        return False
    elapsed = time.perf_counter() - started
    expected = (elapsed - warmup_s) / i  # mean seconds per prompt so far
    if elapsed + expected <= options.time_budget_s:
        return False
    skipped += [{"id": p.id, "category": p.category, "reason": "time budget"} for p in prompts[i:]]
    log(
        f"time budget of {options.time_budget_s:.0f} s: {elapsed:.0f} s spent, about {expected:.0f} s per "
        f"prompt; {len(prompts) - i} prompts not run"
    )
    return True


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="prompt", file=sys.stderr, dynamic_ncols=True)


def _advance(bar, overall: _Tally) -> None:
    if bar is None:
        return
    if overall.prompts:
        o = overall.summary()
        bar.set_postfix_str(
            f"spec {o['tokens_per_s']:.1f} tok/s, plain {o['plain_tokens_per_s']:.1f} tok/s, "
            f"accepted {o['mean_accepted_tokens']:.2f}, acceptance {o['acceptance_rate']:.0%}",
            refresh=False,
        )
    bar.update(1)


def _config(pipe: Pipeline, options: BenchOptions, hf, lc, budget: int, tol: float) -> dict:
    params = options.params
    return {
        "target": pipe.target.name,
        "draft": pipe.draft_spec,
        "k": str(options.k),
        "max_new_tokens": options.max_new_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": params.seed,
        "dtype": harness.runtime_precision(pipe.runtime),
        "draft_dtype": harness.runtime_precision(pipe.drafter.runtime)
        if hasattr(pipe.drafter, "runtime")
        else None,
        "hf_dtype": str(next(pipe.target.model.parameters()).dtype).replace("torch.", "") if hf else None,
        "threads": torch.get_num_threads(),
        "runtime": repr(pipe.runtime),
        "baselines": list(options.baselines),
        "hf_assistant": hf.assistant_note if hf else None,
        "llamacpp": lc.note if lc else None,
        "long_prompts": options.long_prompts,
        "prompt_budget_tokens": budget,
        "equality_tolerance": tol if params.greedy else None,
        "time_budget_s": options.time_budget_s,
        "torch": torch.__version__,
    }


def _row(
    pipe: Pipeline,
    prompt: BenchPrompt,
    runs: dict[str, MethodRun],
    options: BenchOptions,
    tol: float,
    lc=None,
) -> dict:
    plain, spec = runs["plain"], runs["spec"]
    equality, first_diff = (None, None)
    if options.params.greedy:
        equality, first_diff = _classify(pipe, plain, spec, options.max_new_tokens, tol)
    row = {
        "id": prompt.id,
        "category": prompt.category,
        "turns": len(plain.turns),
        "prompt_tokens": sum(len(ids) for ids in spec.prompt_ids),
        "truncated_tokens": plain.dropped,
        "new_tokens": spec.new_tokens,
        "seconds": _r(spec.seconds),
        "tokens_per_s": _r(spec.new_tokens / spec.seconds if spec.seconds else 0.0),
        "plain_new_tokens": plain.new_tokens,
        "plain_seconds": _r(plain.seconds),
        "plain_tokens_per_s": _r(plain.new_tokens / plain.seconds if plain.seconds else 0.0),
        "mean_accepted_tokens": _r(spec.stats.mean_accepted_length),
        "acceptance_rate": _r(spec.stats.acceptance_rate),
        "collapsed": spec.stats.collapsed,  # requests of this prompt flagged (issue 17)
        "equality": equality,
        "first_difference": first_diff,
        "notes": plain.notes,
    }
    row["speedup"] = _r(
        row["tokens_per_s"] / row["plain_tokens_per_s"] if row["plain_tokens_per_s"] else None
    )
    for method in BASELINE_METHODS:
        if method in runs:
            run = runs[method]
            row[f"{method}_new_tokens"] = run.new_tokens
            row[f"{method}_tokens_per_s"] = _r(run.new_tokens / run.seconds if run.seconds else 0.0)
    for method in AGREEMENT_METHODS:
        if method in runs and options.params.greedy:  # another runtime: agreement, not equality
            reference = plain.as_run().tokens
            shared, first = agreement(reference, runs[method].as_run().tokens)
            row[f"{method}_shared_tokens"] = shared
            row[f"{method}_first_difference"] = first
            row[f"{method}_agreement"] = _r(shared / len(reference) if reference else None)
    if lc is not None and options.params.greedy:  # llama.cpp fed our output: the models, position by position
        row["llamacpp_forced_matches"] = sum(map(lc.forced_matches, plain.prompt_ids, plain.turns))
        row["llamacpp_forced_agreement"] = _r(
            row["llamacpp_forced_matches"] / plain.new_tokens if plain.new_tokens else None
        )
    return row


# ------------------------------------------------------------------------------------ output
def markdown_table(result: BenchResult | dict) -> str:
    """The per-category and overall figures as a markdown table."""
    d = result.as_dict() if isinstance(result, BenchResult) else result
    hf_cols = [
        (m, label)
        for m, label in (
            ("hf_plain", "HF plain"),
            ("hf_assisted", "HF assisted"),
            ("hf_prompt_lookup", "HF lookup"),
            ("llamacpp_plain", "llama.cpp plain"),
            ("llamacpp_spec", "llama.cpp lookup"),
            ("bf16_plain", "bf16 plain"),
        )
        if f"{m}_tokens_per_s" in d["overall"]
    ]
    head = [
        "category",
        "prompts",
        "spec tok/s",
        "plain tok/s",
        "speedup",
        "accepted/step",
        "acceptance",
        "identical/tie/div",
    ]
    head += [f"{label} tok/s" for _, label in hf_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]

    def fmt(x, spec="{:.1f}"):
        return "-" if x is None else spec.format(x)

    for name, s in [*d["categories"].items(), ("**overall**", d["overall"])]:
        eq = "n/a" if s["identical"] is None else f"{s['identical']}/{s['tie_divergent']}/{s['divergent']}"
        cells = [
            name,
            str(s["prompts"]),
            fmt(s["tokens_per_s"]),
            fmt(s["plain_tokens_per_s"]),
            fmt(s["speedup"], "{:.2f}x"),
            fmt(s["mean_accepted_tokens"], "{:.2f}"),
            fmt(s["acceptance_rate"], "{:.0%}"),
            eq,
        ]
        cells += [fmt(s.get(f"{m}_tokens_per_s")) for m, _ in hf_cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
