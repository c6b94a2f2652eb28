"""Latency profiler: T_target(b, n), T_draft(b), and where a draft step's time goes.

The analytic model (:mod:`specdraft.analytic`) predicts throughput from two latencies:

- ``T_target(b, n)``: one target forward over ``n`` new tokens for each of ``b`` rows whose cache
  already holds ``context`` tokens (n = k + 1 when verifying k drafts; n = 1 is a plain step);
- ``T_draft(b)``: one draft step, i.e. one draft token for each of ``b`` rows at that context.
  For a model drafter (:class:`~specdraft.drafters.model.ModelDrafter` and the gated one) that is
  its whole proposal of one token as the engine calls it: the forward over the committed token it
  has not read, its token choice and, gated, its confidence and prefix rule (for a small trained
  draft a large share of the bare forward's time); a proposal of :data:`DRAFT_FORWARDS`
  tokens is timed too, and ``T_next(b)``, what each further forward adds, is the slope between
  them. Other drafts with a model (feature and tree drafters) time one forward of
  ``drafter.runtime`` plus the argmax (a feature-conditioned draft's input projection is not
  included); a drafter without a model (prompt lookup) one ``propose`` of one token from a random
  context.

The engine's own work in a step (verification, commit, the policy's bookkeeping) is measured apart,
by :func:`engine_overhead`, which the study adds to each step.

How they are measured: the context is prefilled once per batch size (random token ids; the
position-indexed cache makes every timed forward rewrite the same slots, so nothing grows), then
after ``warmup`` untimed rounds, ``repeats`` rounds each time every (b, n) configuration once, in
turn (A B C A B C ...), so a slow phase of a shared machine hits all of them alike. The figure is
the median of the rounds. The torch thread count is recorded with the result. The same rounds
serve :func:`profile_latency` (one draft, several batch sizes, the breakdown; what ``specdraft
profile`` and the study store) and :func:`measure_latency` (several draft runtimes at batch 1,
timed against each other; what the draft search compares). ``T_target(b, n)`` between and beyond
the measured sizes is read through :class:`specdraft.analytic.LatencyCurve`.

Breakdown of a batch-1 draft step (:func:`draft_breakdown`): one forward of the draft runs under
``torch.profiler`` and each top-level ATen op is put in a bucket by its place in the compact
runtime's sequence (also inside a wrapper such as a designed draft's subset head): every layer runs
exactly four matmuls (q/k/v, output projection, gate/up, down) and the LM head is the last one, so

- ``overhead``: ops before the embedding lookup (position checks, RoPE table, masks);
- ``embedding``: the embedding lookup;
- ``attention``: input norm, q/k/v projection, RoPE, cache write, scaled-dot-product attention,
  output projection (ops up to the second matmul of a layer);
- ``mlp``: residual add, norm, gate/up projection, SiLU, down projection;
- ``lm_head``: final norm and the vocabulary projection;
- ``python``: wall time between ops (interpreter and dispatch), i.e. the profiled wall time minus
  the ops' time.

Each bucket is the median over a few profiled steps, and the shares are scaled to the unprofiled
median ``T_draft(1)`` (the profiler's own overhead inflates every op). Runtimes that are not the
compact one get the buckets ``matmul``, ``attention``, ``other`` and ``python`` by op name;
drafters without a model (prompt lookup) get one bucket, ``lookup``.

Use from Python (the study imports this)::

    from specdraft import api
    from specdraft.bench.profile import profile_pipeline, profile_latency, LatencyProfile
    pipe = api.load("smollm2-135m", draft="prune:0,1,2,29", dtype="fp32", threads=1)
    prof = profile_pipeline(pipe, batch_sizes=(1, 2, 4, 8), new_tokens=range(1, 10), context=200)
    prof.target_time(n=4, batch=2)   # seconds, interpolated over the measured n (prof.curve)
    prof.draft_time(batch=1)         # seconds per draft step
    prof.save("runs/profile.json"); LatencyProfile.load("runs/profile.json")
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdraft import kernels
from specdraft.analytic import LatencyCurve
from specdraft.drafters.base import DraftContext
from specdraft.drafters.model import ModelDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime
from specdraft.models.runtime import Runtime
from specdraft.tree import TokenTree
from specdraft.verify import SamplingParams

BUCKETS = ("overhead", "embedding", "attention", "mlp", "lm_head", "python", "proposal")
DRAFT_FORWARDS = 4  # a model drafter's proposals are timed at 1 and this many tokens
# dense (F.linear, a few-row form or the native kernel) and int8
MATMUL_OPS = ("aten::linear", "aten::matmul", kernels.PROFILE_NAME, "quantized::linear_dynamic")


@dataclass
class LatencyProfile:
    """Measured latencies of one target (and draft) on this machine.

    Attributes:
        target: target name.
        draft: draft name ("none" when no drafter was profiled).
        dtype: what the target computes in: ``fp32``, ``bf16`` or ``int8``.
        threads: torch intra-op threads during the measurement.
        context: tokens already in the cache when each timed forward runs.
        repeats: timed rounds per configuration (the figures are their medians).
        warmup: untimed rounds before those.
        t_target: ``{batch: {new_tokens: median seconds}}`` of one target forward.
        t_draft: ``{batch: median seconds}`` of one draft step (one token per row; a model
            drafter's proposal of one token); empty without a drafter.
        draft_breakdown: ``{bucket: seconds}`` of one batch-1 draft step (module docstring); sums to
            ``t_draft[1]``.
        breakdown_method: how the breakdown was attributed.
        draft_dtype: what the draft computes in (``""`` for drafts without a model).
        cpu: the CPU model.
        torch_version: torch version.
        t_draft_next: ``{batch: seconds}`` each further draft forward adds to a model drafter's
            proposal (from proposals of 1 and :data:`DRAFT_FORWARDS` tokens); empty for others.
        t_engine: ``{batch: median seconds}`` of an engine step's own work beyond the proposal and
            the target forward (:func:`engine_overhead`); empty when not measured.
    """

    target: str
    draft: str
    dtype: str
    threads: int
    context: int
    repeats: int
    warmup: int
    t_target: dict[int, dict[int, float]]
    t_draft: dict[int, float] = field(default_factory=dict)
    draft_breakdown: dict[str, float] = field(default_factory=dict)
    breakdown_method: str = ""
    draft_dtype: str = ""
    cpu: str = ""
    torch_version: str = torch.__version__
    t_draft_next: dict[int, float] = field(default_factory=dict)
    t_engine: dict[int, float] = field(default_factory=dict)

    @property
    def curve(self) -> LatencyCurve:
        """``t_target`` as a :class:`~specdraft.analytic.LatencyCurve` (linear beyond the measured n,
        interpolated between measured batch sizes)."""
        return LatencyCurve(self.t_target)

    def target_time(self, n: int, batch: int = 1) -> float:
        """T_target(batch, n) in seconds at a measured batch size, read off :attr:`curve` (linear
        interpolation, or extrapolation, over the measured n)."""
        self._row(self.t_target, batch, "target")
        return self.curve.time(n, batch)

    def draft_time(self, batch: int = 1) -> float:
        """T_draft(batch): seconds per draft step."""
        if not self.t_draft:
            raise SpecdraftError("this profile has no draft measurements")
        if batch in self.t_draft:
            return self.t_draft[batch]
        raise SpecdraftError(f"no draft measurement for batch {batch}; measured: {sorted(self.t_draft)}")

    def _row(self, table: dict, batch: int, what: str) -> dict:
        if batch not in table:
            raise SpecdraftError(f"no {what} measurement for batch {batch}; measured: {sorted(table)}")
        return table[batch]

    def as_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        """Write as JSON (dict keys become strings; :meth:`load` turns them back)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.as_dict(), indent=2))

    @classmethod
    def from_dict(cls, d: dict) -> LatencyProfile:
        d = dict(d)
        d["t_target"] = LatencyCurve.from_dict(d["t_target"]).points
        for name in ("t_draft", "t_draft_next", "t_engine"):
            d[name] = {int(b): float(t) for b, t in d.get(name, {}).items()}
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SpecdraftError(f"cannot read latency profile {path}: {e}") from None

    def table(self) -> str:
        """A markdown table: T_target(b, n) and T_draft(b) in milliseconds, then the breakdown."""
        ns = sorted({n for row in self.t_target.values() for n in row})
        head = ["batch"] + [f"T_target n={n}" for n in ns] + (["T_draft"] if self.t_draft else [])
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for b in sorted(self.t_target):
            row = self.t_target[b]
            cells = [str(b)] + [f"{row[n] * 1e3:.2f}" if n in row else "-" for n in ns]
            if self.t_draft:
                cells.append(f"{self.t_draft[b] * 1e3:.2f}" if b in self.t_draft else "-")
            lines.append("| " + " | ".join(cells) + " |")
        text = "\n".join(lines) + (
            f"\n\nmilliseconds, median of {self.repeats}; context {self.context}; "
            f"{self.threads} threads; {self.dtype}"
        )
        if self.draft_breakdown:
            total = sum(self.draft_breakdown.values()) or 1.0
            parts = ", ".join(
                f"{k} {v * 1e3:.2f} ms ({v / total:.0%})" for k, v in self.draft_breakdown.items()
            )
            precision = f", {self.draft_dtype}" if self.draft_dtype else ""
            text += f"\ndraft step ({self.draft}{precision}, batch 1): {parts}"
        return text


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------------ timing
def _prefilled(runtime: Runtime, batch: int, context: int, capacity: int, seed: int = 0):
    """A state of ``batch`` rows holding ``context`` random tokens."""
    g = torch.Generator().manual_seed(seed)
    state = runtime.new_state(batch, capacity)
    if context > 0:
        tokens = torch.randint(runtime.vocab_size, (batch, context), generator=g)
        positions = torch.arange(context).expand(batch, context)
        runtime.forward(state, tokens, positions, logits_index=torch.full((batch, 1), context - 1))
    return state


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn()``, in seconds."""
    return statistics.median(_timed(fn) for _ in range(reps))


def _round_robin(jobs: list[tuple[tuple, object]], repeats: int, warmup: int) -> dict[tuple, float]:
    """``{key: median seconds}`` of ``(key, fn)`` jobs timed in turn (A B C A B C ...), ``warmup``
    untimed rounds first, then ``repeats`` timed ones."""
    samples: dict[tuple, list[float]] = {key: [] for key, _ in jobs}
    for r in range(warmup + repeats):
        for key, fn in jobs:
            t = _timed(fn)
            if r >= warmup:
                samples[key].append(t)
    return {key: statistics.median(ts) for key, ts in samples.items()}


def _tree_step(n: int, batch: int, context: int, capacity: int) -> tuple[torch.Tensor, dict]:
    """A token-tree step of n tokens per row after ``context`` tokens, as :meth:`Runtime.forward`'s
    positions and keyword arguments: the root and n - 1 nodes, two children per node, filled level
    by level."""
    tree = TokenTree(torch.zeros(n - 1, dtype=torch.int64), torch.arange(n - 1) // 2 - 1)
    mask = tree.step_mask(context, capacity).expand(batch, n, capacity)  # (batch, n, capacity)
    slots = tree.slots(context).expand(batch, n)
    return tree.positions(context).expand(batch, n), {"attn_mask": mask, "slots": slots}


def _target_jobs(
    target: Runtime, batch: int, context: int, new_tokens: list[int], tree: bool = False
) -> list[tuple]:
    """``(("target", batch, n), fn)`` for each n: one target forward over n new tokens per row;
    ``tree``: ``(("tree", batch, n), fn)``, a token-tree step of n tokens (:func:`_tree_step`)."""
    capacity = context + max(new_tokens) + 1
    state = _prefilled(target, batch, context, capacity)
    jobs = []
    for n in new_tokens:
        tokens = torch.zeros(batch, n, dtype=torch.int64)
        if tree:
            positions, kw = _tree_step(n, batch, context, capacity)
        else:
            positions, kw = context + torch.arange(n).expand(batch, n), {}
        key = ("tree" if tree else "target", batch, n)
        jobs.append((key, lambda s=state, t=tokens, p=positions, kw=kw: target.forward(s, t, p, **kw)))
    return jobs


def _runtime_step(runtime: Runtime, batch: int, context: int):
    """A callable running one model-draft step: one forward of one token per row at ``context``,
    then the argmax."""
    state = _prefilled(runtime, batch, context, context + 2, seed=1)
    tok = torch.zeros(batch, 1, dtype=torch.int64)
    pos = torch.full((batch, 1), context)
    return lambda: runtime.forward(state, tok, pos).logits[:, -1].argmax(-1)


def _random_context(batch: int, context: int, vocab: int) -> DraftContext:
    """Greedy rows of ``context`` committed random tokens (one spare slot)."""
    g = torch.Generator().manual_seed(2)
    return DraftContext(
        tokens=torch.randint(vocab, (batch, context + 1), generator=g),
        lengths=torch.full((batch,), context),
        params=[SamplingParams()] * batch,
        generators=[None] * batch,
    )


def _draft_step(drafter, batch: int, context: int, vocab: int, forwards: int = 1):
    """A callable running one draft step at ``context``: a model drafter's whole proposal of
    ``forwards`` tokens per row (:func:`_proposal`), a block drafter's forward over one block, or
    one ``propose`` of one token by a drafter without a model (``forwards`` is 1 for both)."""
    if isinstance(drafter, ModelDrafter):
        return _proposal(drafter, _random_context(batch, context, vocab), forwards)
    if getattr(drafter, "runtime", None) is not None:  # other model drafts: one forward of their runtime
        return _runtime_step(drafter.runtime, batch, context)
    block = getattr(drafter, "profile_step", None)
    if block is not None:  # a block drafter: its step is one forward over a whole block
        return block(batch, context)
    state = drafter.new_state(batch, context + 2)
    ctx = _random_context(batch, context, vocab)
    return lambda: drafter.propose(state, ctx, 1)


def _proposal(drafter, ctx: DraftContext, forwards: int):
    """A callable running one proposal of a :class:`ModelDrafter` of ``forwards`` tokens per row as
    the engine calls it after a rejection: one committed token it has not read (fed with its first
    forward), then each token with the drafter's own token choice. A drafter that stops early (the
    gated one) proposes :data:`DRAFT_FORWARDS` tokens and is made to stop after the first or to
    draft them all (``forwards`` is 1 or that), so that each position pays its confidence and
    prefix rule as in a real proposal (random contexts would stop it anywhere)."""
    L = ctx.lengths
    gated = getattr(drafter, "stops_early", False)
    if gated and forwards not in (1, DRAFT_FORWARDS):
        raise SpecdraftError(f"a gated drafter's proposals are timed at 1 or {DRAFT_FORWARDS} tokens")
    k = DRAFT_FORWARDS if gated else forwards
    state = drafter.new_state(len(L), int(L.max()) + k + 1)
    drafter.propose(state, ctx, 1)  # reads the context (untimed)
    hold = (lambda: drafter.drafting(every_token=forwards > 1)) if gated else contextlib.nullcontext

    def run():
        state.fed = L - 1
        with hold():
            return drafter.propose(state, ctx, k)

    return run


def _check(
    target: Runtime, batch_sizes: list[int], new_tokens: list[int], context: int, repeats: int, warmup: int
) -> None:
    """One clear error for sizes the profiler cannot measure."""
    if not batch_sizes or min(batch_sizes) < 1 or not new_tokens or min(new_tokens) < 1:
        raise SpecdraftError("batch sizes and new-token counts must be >= 1")
    if repeats < 1 or warmup < 0 or context < 1:
        raise SpecdraftError("need repeats >= 1, warmup >= 0 and context >= 1")
    if context + max(new_tokens) > target.max_context:
        raise SpecdraftError(
            f"context {context} + {max(new_tokens)} new tokens exceeds the target's window "
            f"({target.max_context})"
        )


def profile_latency(
    target: Runtime,
    drafter=None,
    *,
    batch_sizes: Iterable[int] = (1,),
    new_tokens: Iterable[int] = range(1, 10),
    context: int = 200,
    repeats: int = 9,
    warmup: int = 2,
    breakdown: bool = True,
    target_name: str = "target",
    draft_name: str | None = None,
) -> LatencyProfile:
    """Measure T_target(b, n) and T_draft(b) (module docstring).

    Args:
        target: the target runtime.
        drafter: a drafter (``drafter.runtime`` is timed for model drafts; other drafters time
            one ``propose`` of one token); None measures the target only.
        batch_sizes: rows b.
        new_tokens: tokens n per target forward (k + 1 for draft length k).
        context: tokens in the cache before each timed forward.
        repeats: timed rounds (medians are taken over them); >= 1.
        warmup: untimed rounds first.
        breakdown: also profile where a batch-1 draft step's time goes.
        target_name, draft_name: recorded in the result.

    Returns:
        A :class:`LatencyProfile`.
    """
    batch_sizes, new_tokens = sorted(set(batch_sizes)), sorted(set(new_tokens))
    _check(target, batch_sizes, new_tokens, context, repeats, warmup)
    model = isinstance(drafter, ModelDrafter)
    forwards = (1, DRAFT_FORWARDS) if model else (1,)
    jobs = []
    for b in batch_sizes:
        jobs += _target_jobs(target, b, context, new_tokens)
        if drafter is not None:
            jobs += [
                (("draft", b, c), _draft_step(drafter, b, context, target.vocab_size, c)) for c in forwards
            ]
    if model and breakdown:  # the forward alone, which the breakdown divides into buckets
        jobs.append((("forward", batch_sizes[0], 1), _runtime_step(drafter.runtime, batch_sizes[0], context)))

    times = _round_robin(jobs, repeats, warmup)
    t_target: dict[int, dict[int, float]] = {}
    for (kind, b, n), t in times.items():
        if kind == "target":
            t_target.setdefault(b, {})[n] = t
    t_draft = {b: times["draft", b, 1] for b in batch_sizes} if drafter is not None else {}
    more = DRAFT_FORWARDS - 1
    t_draft_next = {b: (times["draft", b, DRAFT_FORWARDS] - t_draft[b]) / more for b in batch_sizes if model}

    parts, method = {}, ""
    if drafter is not None and breakdown:
        parts, method = draft_breakdown(drafter, context, target.vocab_size)
        b = batch_sizes[0]
        parts = _scaled(parts, t_draft[b], times.get(("forward", b, 1)))

    from specdraft.bench.harness import runtime_precision

    return LatencyProfile(
        target=target_name,
        draft=draft_name or (getattr(drafter, "name", "draft") if drafter is not None else "none"),
        dtype=runtime_precision(target),
        threads=torch.get_num_threads(),
        context=context,
        repeats=repeats,
        warmup=warmup,
        t_target=t_target,
        t_draft=t_draft,
        t_draft_next=t_draft_next,
        draft_breakdown=parts,
        breakdown_method=method,
        draft_dtype=runtime_precision(drafter.runtime) if hasattr(drafter, "runtime") else "",
        cpu=cpu_name(),
    )


def _scaled(parts: dict[str, float], step: float, forward: float | None = None) -> dict[str, float]:
    """Profiled bucket shares scaled to the unprofiled median of what was profiled (the profiler's
    overhead inflates every op): the whole ``step``, or a model drafter's ``forward``, whose step
    gets a ``proposal`` bucket for the rest (token choice, gating), so the buckets sum to ``step``."""
    total = sum(parts.values())
    if total <= 0:
        return parts
    profiled = step if forward is None else min(forward, step)
    out = {k: v / total * profiled for k, v in parts.items()}
    if forward is not None:
        out["proposal"] = step - profiled
    return out


def engine_overhead(
    target: Runtime,
    drafter=None,
    *,
    batch_sizes: Iterable[int] = (1,),
    context: int = 64,
    k: int = 4,
    steps: int = 12,
) -> dict[int, float]:
    """``{batch: median seconds}`` of an engine step's own work: its wall time less the drafter's
    proposal and the target's forward (verification, commit, the policy and statistics), over
    ``steps`` greedy steps at draft length k (plain steps without a drafter) of random prompts of
    ``context`` tokens, after the first step of the batch (where a draft reads the prompt)."""
    from specdraft.engine import Engine, Request
    from specdraft.policy import FixedK

    k = k if drafter is not None else 0
    budget = min((steps + 2) * (k + 1), target.max_context - context - k - 2)
    g = torch.Generator().manual_seed(3)
    out = {}
    for b in batch_sizes:
        engine = Engine(target, drafter, FixedK(k))
        prompts = torch.randint(target.vocab_size, (b, context), generator=g).tolist()
        engine.add([Request(p, budget, SamplingParams()) for p in prompts])
        engine.step()
        samples = []
        while engine.active and len(samples) < steps:
            before, t0 = engine.stats.draft_time + engine.stats.target_time, time.perf_counter()
            engine.step()
            spent = engine.stats.draft_time + engine.stats.target_time - before
            samples.append(time.perf_counter() - t0 - spent)
        for r in list(engine.requests):
            engine.cancel(r.id)
        out[b] = statistics.median(samples)
    return out


def profile_pipeline(pipe, **kwargs) -> LatencyProfile:
    """:func:`profile_latency` for a loaded :class:`specdraft.api.Pipeline` (names filled in)."""
    kwargs.setdefault("target_name", pipe.target.name)
    kwargs.setdefault("draft_name", pipe.draft_spec)
    return profile_latency(pipe.runtime, pipe.drafter, **kwargs)


@dataclass
class DraftLatencies:
    """Batch-1 latencies of one target and several draft runtimes, measured together.

    Attributes:
        draft: ``{name: seconds per draft token}``.
        target: ``{n: seconds for a target forward over n tokens}``.
        context: cached positions the forwards attend to.
    """

    draft: dict[str, float] = field(default_factory=dict)
    target: dict[int, float] = field(default_factory=dict)
    context: int = 256

    def curve(self) -> LatencyCurve:
        """T_target(n): linear between the measured n and flat beyond them (as the draft search
        has always read its table)."""
        return LatencyCurve({1: self.target}, beyond="flat")


@torch.inference_mode()
def measure_latency(
    target: Runtime,
    drafts: dict[str, Runtime],
    ns: Iterable[int] = (1, 2, 4, 6, 8),
    context: int = 256,
    reps: int = 9,
) -> DraftLatencies:
    """Median batch-1 latencies of the target over each n in ``ns`` and of one step of each draft
    runtime, all timed in turn (module docstring) after one warm-up round.

    Args:
        target: the target runtime.
        drafts: ``{name: runtime}`` draft runtimes (one token per forward, then the argmax, as when
            drafting).
        ns: target forward sizes (tokens fed at once).
        context: positions already in the caches.
        reps: timed rounds.
    """
    ns = sorted(set(ns))
    _check(target, [1], ns, context, reps, 1)
    jobs = _target_jobs(target, 1, context, ns)
    jobs += [(("draft", name, 1), _runtime_step(rt, 1, context)) for name, rt in drafts.items()]
    lat = DraftLatencies(context=context)
    for (kind, key, n), t in _round_robin(jobs, reps, warmup=1).items():
        if kind == "target":
            lat.target[n] = t
        else:
            lat.draft[key] = t
    return lat


@torch.inference_mode()
def compare_forwards(
    runtimes: dict[str, Runtime], new_tokens: Iterable[int], context: int, reps: int, trees: bool = False
) -> dict[str, dict[int, float]]:
    """Median seconds of one batch-1 forward of n new tokens at a ``context``-token cache, for
    several runtimes of one model: ``{name: {n: seconds}}``. Each round times every n in turn and,
    for each n, every runtime (A B, A B, ...), so a slow phase of the machine hits all of them.
    ``trees``: in the same rounds, right after each chain step, a token-tree step of n tokens
    (:func:`_tree_step`) on the same runtime, as ``"<name> tree"``.
    """
    ns = sorted(set(new_tokens))
    for runtime in runtimes.values():
        _check(runtime, [1], ns, context, reps, 0)
    kinds = ("target", "tree") if trees else ("target",)
    jobs = {
        (name, kind): dict(_target_jobs(rt, 1, context, ns, kind == "tree"))
        for name, rt in runtimes.items()
        for kind in kinds
    }
    order = [
        ((name, kind, n), jobs[name, kind][kind, 1, n]) for n in ns for name in runtimes for kind in kinds
    ]
    medians = _round_robin(order, reps, warmup=0)
    label = {"target": "", "tree": " tree"}
    return {
        name + label[kind]: {n: medians[name, kind, n] for n in ns} for name in runtimes for kind in kinds
    }


def ragged_forwards(
    runtime: Runtime, shapes: dict[str, list[int]], context: int, reps: int
) -> dict[str, float]:
    """Median seconds of one ragged forward per shape (row b feeds ``1 + shape[b]`` tokens at a
    ``context``-token cache; all zeros: a plain step), shapes timed in turn each round. The runtime
    must take ``lengths`` (:attr:`specdraft.engine.Engine.ragged`)."""
    jobs = []
    for name, extra in shapes.items():
        B, k = len(extra), max(extra)
        state = _prefilled(runtime, B, context, context + k + 1)
        tokens = torch.zeros(B, k + 1, dtype=torch.int64)
        positions = context + torch.arange(k + 1).expand(B, -1)
        kw = {"lengths": 1 + torch.tensor(extra)} if k else {}
        jobs.append((name, lambda s=state, t=tokens, p=positions, kw=kw: runtime.forward(s, t, p, **kw)))
    return _round_robin(jobs, reps, warmup=1)


# ------------------------------------------------------------------------------------ breakdown
def draft_breakdown(
    drafter, context: int = 200, vocab: int | None = None, rounds: int = 7
) -> tuple[dict[str, float], str]:
    """Profiled seconds per bucket of one batch-1 draft step (a model drafter's runtime forward, the
    step of any other drafter): per bucket the median over ``rounds`` steps.

    Returns:
        ``({bucket: seconds}, method)``; the seconds include the profiler's overhead, so use the
        shares (:func:`profile_latency` rescales them to the measured step time).
    """
    # torch 2.13's kineto prints two "USDT: ... profiler_start/stop" lines to stderr per profiled
    # step unless its log level is above 5 (it reads the variable when the profiler first starts)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    runtime = getattr(drafter, "runtime", None)
    vocab = vocab or getattr(runtime, "vocab_size", 2)
    if runtime is not None:
        step = _runtime_step(runtime, 1, context)
    else:
        step = _draft_step(drafter, 1, context, vocab)
    step()  # warm
    per_round: dict[str, list[float]] = {}
    method = ""
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        events = sorted((e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start)
        if runtime is None:
            buckets, method = {"lookup": sum(e.cpu_time_total for e in events)}, "n-gram lookup (no model)"
        elif isinstance(compact_of(runtime), LlamaRuntime):
            buckets, method = _llama_buckets(events, len(compact_of(runtime).layers))
        else:
            buckets, method = _name_buckets(events)
        if events:  # wall time the ops do not cover: the interpreter between them
            wall = events[-1].time_range.end - events[0].time_range.start
            buckets["python"] = max(wall - sum(e.cpu_time_total for e in events), 0.0)
        for k, v in buckets.items():
            per_round.setdefault(k, []).append(v * 1e-6)  # profiler times are microseconds
    return {k: statistics.median(v) for k, v in per_round.items()}, method


def compact_of(runtime):
    """The compact runtime inside wrappers such as a designed draft's subset-head runtime."""
    while not isinstance(runtime, LlamaRuntime) and hasattr(runtime, "runtime"):
        runtime = runtime.runtime
    return runtime


def _llama_buckets(events, n_layers: int) -> tuple[dict[str, float], str]:
    """Attribute ops by their place in the compact forward (module docstring)."""
    linears = [i for i, e in enumerate(events) if e.name in MATMUL_OPS]
    if len(linears) != 4 * n_layers + 1:
        return _name_buckets(events)
    # the embedding lookup is the last index op before the first matmul (RoPE tables come first)
    lookups = [i for i in range(linears[0]) if events[i].name in ("aten::index", "aten::embedding")]
    embed_at = lookups[-1] if lookups else -1
    out = dict.fromkeys(BUCKETS[:-1], 0.0)
    m = 0  # matmuls before this op; a non-matmul op belongs with the next matmul
    for i, e in enumerate(events):
        if i < embed_at:
            bucket = "overhead"
        elif i == embed_at:
            bucket = "embedding"
        elif m >= 4 * n_layers:
            bucket = "lm_head"  # final norm, the LM head matmul, the float cast
        else:
            bucket = "attention" if m % 4 in (0, 1) else "mlp"
        if e.name in MATMUL_OPS:
            m += 1
        out[bucket] += e.cpu_time_total
    return out, "compact-runtime op sequence (torch.profiler)"


def _name_buckets(events) -> tuple[dict[str, float], str]:
    out = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        if e.name in MATMUL_OPS or e.name in ("aten::matmul", "aten::mm", "aten::addmm", "aten::bmm"):
            out["matmul"] += e.cpu_time_total
        elif "attention" in e.name:
            out["attention"] += e.cpu_time_total
        else:
            out["other"] += e.cpu_time_total
    return out, "ATen op names (torch.profiler)"
