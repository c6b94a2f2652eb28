"""The bench harness: methods, interleaving, timing and the equality check, written once.

``specdraft bench`` (and ``specdraft demo`` through it) and every ``benchmarks/`` script that
decodes build their measurements from these pieces:

- :class:`Method`: a name and a way to decode one prompt, either an :class:`specdraft.engine.Engine`
  (a fresh one per call over a target, a drafter and a policy kept for the whole run) or a
  baseline such as transformers ``generate``. :meth:`Method.run` times the call and returns a
  :class:`Run`: output tokens, wall seconds (prefill included: what a user waits for) and the
  engine's statistics, which split out the prefill. :meth:`Method.run_batch` decodes several
  prompts together as one batch and returns a :class:`BatchRun` with per-step counts (forwards per
  row, tokens fed to the target, rows flagged as collapsed) from :func:`decode_counted`.
- :func:`interleave`: the order of the methods on prompt i, rotated by i (A B, then B A; A B C,
  B C A, C A B, ...); :func:`run_prompt` runs them in it. Running the methods back to back on each
  prompt, after one warm-up of each (:func:`warm_up`), means a slow phase of a shared machine hits
  all of them, and rotating the order keeps a drift within a prompt from always favouring the same
  method. :func:`run_prompts` does it for every prompt and sums each method's runs.
- :class:`Totals`: one method's sums over prompts. Rates are sums of tokens over sums of seconds,
  never a mean of per-prompt rates.
- :func:`agreement`: how far two sets of greedy outputs agree (two runtimes of one model).
- :func:`equality`: a greedy output against plain decoding's, classified by
  :func:`specdraft.lossless.classify` (identical / tie-divergent / divergent) with
  :func:`tolerance` (0 in fp32: any difference is a bug).
- :func:`prompt_budget`: the prompt tokens that fit the context window after the generation budget
  and the cache room the methods' engines reserve (:attr:`specdraft.engine.Engine.reserve`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from specdraft import lossless
from specdraft.drafters.base import Drafter
from specdraft.engine import Engine, Request
from specdraft.errors import SpecdraftError
from specdraft.models.runtime import Runtime
from specdraft.policy import KPolicy
from specdraft.stats import SpecStats
from specdraft.verify import SamplingParams

T = TypeVar("T")
GREEDY = SamplingParams()


@dataclass
class Run:
    """One method's decode of one prompt.

    Attributes:
        tokens: the output tokens.
        seconds: wall seconds of the call, prefill included.
        stats: the engine's statistics of the call (None for a baseline).
        first_token_seconds: wall seconds until the first step's tokens: the prefill and one step
            (0 for a baseline, which returns its tokens at once).
    """

    tokens: list[int]
    seconds: float
    stats: SpecStats | None = None
    first_token_seconds: float = 0.0

    @property
    def prefill_seconds(self) -> float:
        """Seconds the engine spent prefilling (0 for a baseline, which does not split them)."""
        return self.stats.prefill_time if self.stats is not None else 0.0


@dataclass
class BatchRun:
    """An engine method's decode of several prompts together, one batch row each, with per-step
    counts.

    Attributes:
        outputs: each prompt's output tokens, in the prompts' order.
        seconds: wall seconds of the call, prefill included.
        first_token_seconds: wall seconds until the first step's tokens (prefill and one step).
        stats: the engine's statistics of the call.
        steps: per prompt, the target forwards its row took part in.
        tokens_fed: tokens fed to the target in those forwards: active rows x (k + 1) per step
            (ragged steps: each row's own 1 + k_b).
        collapsed: the prompts (indices) whose rows the policy flagged as collapsed.
        request_ids: the engine's request id of each prompt's row (to read per-request counts a
            policy or drafter kept).
    """

    outputs: list[list[int]]
    seconds: float
    first_token_seconds: float
    stats: SpecStats
    steps: list[int]
    tokens_fed: int
    collapsed: list[int]
    request_ids: list[int]


def decode_counted(engine: Engine, requests: list[Request]) -> BatchRun:
    """Decode ``requests`` together to the end on a fresh ``engine``, timed, counting per step.

    The clock starts before the prefill; build the engine before calling.
    """
    t0 = time.perf_counter()
    ids = engine.add(requests)
    out: dict[int, list[int]] = {i: [] for i in ids}
    steps = dict.fromkeys(ids, 0)
    fed, first = 0, None
    while engine.active:
        drafted = engine.stats.drafted
        events = engine.step()
        if first is None:
            first = time.perf_counter() - t0
        # a ragged step (Engine.ragged) feeds each row its own 1 + k_b tokens, a padded one k + 1
        extra = engine.stats.drafted - drafted if engine.ragged else len(events) * engine.stats.k_history[-1]
        fed += len(events) + extra
        for ev in events:
            out[ev.request_id] += ev.tokens
            steps[ev.request_id] += 1
    seconds = time.perf_counter() - t0
    return BatchRun(
        outputs=[out[i] for i in ids],
        seconds=seconds,
        first_token_seconds=seconds if first is None else first,
        stats=engine.stats,
        steps=[steps[i] for i in ids],
        tokens_fed=fed,
        collapsed=sorted(ids.index(i) for i in engine.collapsed if i in steps),
        request_ids=ids,
    )


@dataclass
class Method:
    """A named way to decode one prompt.

    Attributes:
        name: the method's label in tables and JSON.
        new_engine: builds the engine of one call (None for a baseline).
        baseline: ``(ids, max_new_tokens, params) -> tokens`` for a method that is not an engine.
        eos_ids: an engine method stops after any of these (a baseline handles its own).
    """

    name: str
    new_engine: Callable[[], Engine] | None = None
    baseline: Callable[[list[int], int, SamplingParams], list[int]] | None = None
    eos_ids: tuple[int, ...] = ()

    def run(self, ids: list[int], max_new_tokens: int, params: SamplingParams = GREEDY) -> Run:
        """Decode ``ids`` once, timed (an engine is built before the clock starts)."""
        if self.new_engine is None:
            t0 = time.perf_counter()
            tokens = self.baseline(list(ids), max_new_tokens, params)
            return Run(tokens, time.perf_counter() - t0)
        batch = self.run_batch([ids], max_new_tokens, params)
        return Run(batch.outputs[0], batch.seconds, batch.stats, batch.first_token_seconds)

    def run_batch(
        self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams = GREEDY
    ) -> BatchRun:
        """Decode ``prompts`` together, one row each, timed and counted (an engine method only)."""
        if self.new_engine is None:
            raise SpecdraftError(f"method {self.name!r} is not an engine: it decodes one prompt at a time")
        engine = self.new_engine()
        requests = [Request(list(ids), max_new_tokens, params, self.eos_ids) for ids in prompts]
        return decode_counted(engine, requests)

    @property
    def reserve(self) -> int:
        """Cache room past prompt + new tokens that the method's engine needs (0 for a baseline)."""
        return self.new_engine().reserve if self.new_engine is not None else 0


def engine_method(
    name: str,
    runtime: Runtime,
    drafter: Drafter | None = None,
    policy: KPolicy | None = None,
    eos_ids: tuple[int, ...] = (),
) -> Method:
    """Decoding with the engine: plain when ``drafter`` is None, else speculative.

    The one ``policy`` serves every call, so an adaptive policy keeps learning across prompts (as
    the server keeps one); a drafter that reads target hidden states gets them.
    """
    return Method(name, lambda: Engine(runtime, drafter, policy), eos_ids=eos_ids)


def baseline_method(name: str, decode: Callable[[list[int], int, SamplingParams], list[int]]) -> Method:
    """A method that is not the engine: ``decode(ids, max_new_tokens, params) -> tokens``."""
    return Method(name, baseline=decode)


def interleave(methods: Sequence[T], i: int) -> list[T]:
    """The order of ``methods`` on prompt ``i``: rotated by ``i`` (A B, B A, A B, ...)."""
    s = i % len(methods) if methods else 0
    return [*methods[s:], *methods[:s]]


def run_prompt(
    methods: Sequence[Method], ids: list[int], i: int, max_new_tokens: int, params: SamplingParams = GREEDY
) -> dict[str, Run]:
    """Every method once on prompt ``i``'s ``ids``, in :func:`interleave` order; runs by method
    name, in the order of ``methods``."""
    runs = {m.name: m.run(ids, max_new_tokens, params) for m in interleave(methods, i)}
    return {m.name: runs[m.name] for m in methods}


def run_prompts(
    methods: Sequence[Method],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    params: SamplingParams = GREEDY,
) -> dict[str, Totals]:
    """Every method on every prompt (:func:`run_prompt`: interleaved); each method's totals, its
    outputs among them, by method name in the order of ``methods``."""
    totals = {m.name: Totals() for m in methods}
    for i, ids in enumerate(prompts):
        for name, run in run_prompt(methods, ids, i, max_new_tokens, params).items():
            totals[name].add(run)
    return totals


def agreement(outputs: Sequence[list[int]], refs: Sequence[list[int]]) -> dict:
    """Greedy agreement of ``outputs`` with ``refs`` (two runtimes of one model, say), prompt by
    prompt: identical outputs, the prompts, the mean common prefix and the fraction of positions
    (over the shorter of each pair) where the tokens agree."""
    prefix = [lossless.first_difference(a, c) for a, c in zip(outputs, refs)]
    prefix = [len(a) if k is None else k for k, a in zip(prefix, outputs)]
    agree = sum(x == y for a, c in zip(outputs, refs) for x, y in zip(a, c))
    return {
        "identical_outputs": sum(a == c for a, c in zip(outputs, refs)),
        "prompts": len(outputs),
        "mean_common_prefix": statistics.mean(prefix) if prefix else 0.0,
        "positionwise": agree / max(sum(min(len(a), len(c)) for a, c in zip(outputs, refs)), 1),
    }


def warm_up(
    methods: Sequence[Method], ids: list[int], max_new_tokens: int, params: SamplingParams = GREEDY
) -> None:
    """Run every method once, untimed (first calls, lazy set-up, a drafter's one-time calibration)."""
    for method in methods:
        method.run(ids, max_new_tokens, params)


def prompt_budget(
    runtime: Runtime, methods: Sequence[Method], max_new_tokens: int, max_prompt_tokens: int | None = None
) -> int:
    """Prompt tokens that fit: the context window less ``max_new_tokens`` and the largest engine
    reserve among ``methods``, at most ``max_prompt_tokens`` (None: no cap)."""
    budget = runtime.max_context - max_new_tokens - max((m.reserve for m in methods), default=0)
    return budget if max_prompt_tokens is None else min(budget, max_prompt_tokens)


@dataclass
class Totals:
    """One method's sums over prompts.

    Attributes:
        tokens: output tokens.
        seconds: wall seconds of the calls, prefill included.
        prefill_seconds: the engine's prefill seconds among them.
        runs: the runs added.
        first_token_seconds: their seconds until the first step's tokens.
        stats: the engine's statistics, merged.
        classes: equality classes counted (:func:`equality`).
        outputs: the runs' output tokens, in the order added.
    """

    tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    runs: int = 0
    first_token_seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)
    classes: dict[str, int] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, run: Run, equality_class: str | None = None) -> None:
        self.tokens += len(run.tokens)
        self.seconds += run.seconds
        self.prefill_seconds += run.prefill_seconds
        self.runs += 1
        self.outputs.append(run.tokens)
        self.first_token_seconds += run.first_token_seconds
        if run.stats is not None:
            self.stats.merge(run.stats)
        if equality_class is not None:
            self.classes[equality_class] = self.classes.get(equality_class, 0) + 1

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per wall second, prefill included."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens per wall second with the engine's prefill left out."""
        seconds = self.seconds - self.prefill_seconds
        return self.tokens / seconds if seconds > 0 else 0.0

    @property
    def after_first_tokens_per_s(self) -> float:
        """Output tokens after each run's first over the wall seconds after each run's first step
        (an engine method; the prefill and the first step left out)."""
        seconds = self.seconds - self.first_token_seconds
        return (self.tokens - self.runs) / seconds if seconds > 0 else 0.0

    @property
    def mismatches(self) -> int:
        """Outputs counted as anything but identical to plain decoding."""
        return sum(n for c, n in self.classes.items() if c != lossless.IDENTICAL)


def runtime_precision(runtime) -> str:
    """``fp32``, ``bf16`` or ``int8``: what the runtime computes in (the GGUF block types, such
    as ``q4_1+q8_0``, on the quantized runtime; a head-subset wrapper's: its inner runtime's)."""
    if isinstance(getattr(runtime, "runtime", None), Runtime):  # SubsetHeadRuntime
        return runtime_precision(runtime.runtime)
    weights = getattr(runtime, "w", None)
    if weights is not None and hasattr(weights, "precision"):
        return weights.precision
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    return names.get(runtime.dtype, str(runtime.dtype).replace("torch.", ""))


def tolerance(runtime, given: float | None = None) -> float:
    """The near-tie margin of :func:`equality`: ``given``, else 0 in fp32 and on the quantized
    runtime (its rows are bit-identical whatever the batch) and
    :data:`specdraft.lossless.DEFAULT_TOLERANCE` otherwise."""
    if given is not None:
        return given
    exact = runtime_precision(runtime) == "fp32" or runtime_precision(runtime).startswith("q")
    return 0.0 if exact else lossless.DEFAULT_TOLERANCE


def equality(
    runtime: Runtime,
    prompt_ids: list[int],
    plain: list[int],
    tokens: list[int],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    tol: float,
) -> tuple[str, int | None]:
    """A greedy output against plain greedy decoding's for the same prompt.

    Equal outputs are ``identical``; otherwise plain decoding is run once more recording its top-2
    logit margins and :func:`specdraft.lossless.classify` decides.

    Returns:
        The class and the first output index where they differ (None when identical).
    """
    if tokens == plain:
        return lossless.IDENTICAL, None
    ref, margins = lossless.plain_greedy_margins(runtime, prompt_ids, max_new_tokens, eos_ids)
    return lossless.classify(tokens, ref, margins, tol), lossless.first_difference(tokens, ref)
