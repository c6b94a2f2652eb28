"""Online validation: run a few configurations for real and compare with the predictions.

For each chosen configuration (draft, k, batch, dataset) the engine decodes the dataset's prompts,
``batch`` at a time, and every step is timed. The measured figure is steady-state decode tokens/s,
the quantity the sweep predicts: prefill and the first step of each batch (where a draft model
also reads the prompt) are left out. Its prediction is recomputed for exactly these prompts, from
the offline pass and the sweep's latency profile; the online mean accepted length (from
:class:`specdraft.stats.SpecStats`) is recorded next to the offline one, which greedy decoding
makes equal up to floating-point ties.

With ``reprofile`` the latencies are also measured again right before and right after each run
(at the batch sizes and context range the run decodes at) and a second prediction is made from
them, its step time the mean of the two: on a shared machine that separates the model's error from
the machine's drift since the sweep's profile, and bracketing the run cancels a steady drift during it.

Plain decoding of the same prompts runs interleaved with the speculative run, step by step
(:func:`online_runs`), and its throughput is predicted from the same profile: the speedup over
plain decoding is then validated too. Both runs see the machine at the same moments, so a shared
host's drift (its speed moves by a fifth and more within minutes) cancels in the measured speedup,
where it cannot in the measured throughput.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdraft import analytic
from specdraft.engine import Engine, Request
from specdraft.policy import FixedK
from specdraft.stats import SpecStats
from specdraft.study.latency import Latencies, draft_kind, measure_draft, measure_target
from specdraft.study.offline import Simulation, offline_proposals, simulate
from specdraft.study.store import ResultStore, code_version, row_key
from specdraft.study.sweep import Dataset, StudyConfig, build_drafter, closed_form, load_target, predict
from specdraft.verify import SamplingParams

if TYPE_CHECKING:
    from specdraft.api import Pipeline


ERRORS = (
    "relative_error",
    "reprofiled_relative_error",
    "speedup_relative_error",
    "reprofiled_speedup_relative_error",
)
"""An online row's relative errors: throughput and speedup over plain decoding, predicted from the
sweep's profile and from the latencies re-measured around the run."""


@dataclass
class OnlineRun:
    """A timed engine run, accumulated batch by batch.

    Attributes:
        tokens: steady-state output tokens (first step of each batch excluded).
        seconds: steady-state wall seconds.
        total_tokens: every output token.
        total_seconds: wall seconds including prefill and first steps.
        stats: the engine's statistics, summed over batches.
        outputs: output tokens per prompt.
    """

    tokens: int = 0
    seconds: float = 0.0
    total_tokens: int = 0
    total_seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _Decoding:
    """One batch of prompts decoded greedily by one arm, a timed engine step at a time, into its run
    (``drafter`` None: plain decoding)."""

    def __init__(self, run: OnlineRun, runtime, drafter, k: int, prompts, max_new_tokens: int, eos_ids):
        self.run, self.engine = run, Engine(runtime, drafter, FixedK(k))
        reqs = [Request(p, max_new_tokens, SamplingParams(), tuple(eos_ids)) for p in prompts]
        t0 = time.perf_counter()
        self.ids = self.engine.add(reqs)
        run.total_seconds += time.perf_counter() - t0
        self.got = {i: [] for i in self.ids}
        self.emitted, self.first = 0, True

    @property
    def active(self) -> bool:
        return bool(self.engine.active)

    def step(self) -> None:
        t = time.perf_counter()
        events = self.engine.step()
        dt = time.perf_counter() - t
        n = 0
        for ev in events:
            self.got[ev.request_id] += ev.tokens
            n += len(ev.tokens)
        self.emitted += n
        self.run.total_tokens += n
        self.run.total_seconds += dt
        if not self.first:
            self.run.tokens += n
            self.run.seconds += dt
        self.first = False
        if not self.engine.active:
            self.run.stats.merge(self.engine.stats)
            self.run.outputs += [self.got[i] for i in self.ids]


def online_runs(
    runtime,
    arms: list[tuple[object, int]],
    prompts: list[list[int]],
    batch: int,
    max_new_tokens: int,
    eos_ids,
) -> list[OnlineRun]:
    """Decode ``prompts`` greedily, ``batch`` at a time, once per arm ``(drafter, k)``, the arms
    interleaved step by step: each batch is open in every arm at once, and the arm that has emitted
    the fewest tokens so far steps next. The arms then move through the answers together, so a drift
    of the machine's speed (seconds to minutes on a shared host) falls on all of them alike."""
    runs = [OnlineRun() for _ in arms]
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        open_ = [
            _Decoding(run, runtime, d, k, chunk, max_new_tokens, eos_ids) for run, (d, k) in zip(runs, arms)
        ]
        while any(d.active for d in open_):
            min((d for d in open_ if d.active), key=lambda d: d.emitted).step()
    return runs


def choose(rows: list[dict], n: int, seed: int = 0) -> list[dict]:
    """``n`` configuration rows spread over drafts, k, batch sizes and datasets (deterministic)."""
    if n <= 0 or not rows:
        return []
    rng = random.Random(seed)
    axes = {a: sorted({r[a] for r in rows}, key=str) for a in ("draft", "k", "batch", "dataset")}
    for values in axes.values():
        rng.shuffle(values)
    index = {(r["draft"], r["k"], r["batch"], r["dataset"]): r for r in rows}
    chosen, seen = [], set()
    i = 0
    while len(chosen) < min(n, len(index)) and i < 50 * n:
        key = tuple(axes[a][(i + j) % len(axes[a])] for j, a in enumerate(axes))
        i += 1
        if key in index and key not in seen:
            seen.add(key)
            chosen.append(index[key])
    return chosen


def validate(
    config: StudyConfig,
    datasets: dict[str, Dataset],
    lat: Latencies,
    store: ResultStore,
    n: int,
    *,
    prompts: int | None = None,
    reprofile: bool = False,
    log: Callable[[str], None] = print,
    version: str | None = None,
) -> list[dict]:
    """Validate ``n`` configurations online; appends (and returns) their ``online`` rows.

    Args:
        config: the study configuration.
        datasets: datasets by name, with cached continuations.
        lat: the sweep's latencies.
        store: results file; configurations already validated there are skipped.
        n: how many configurations.
        prompts: prompts per run (default: the whole dataset; at least the batch size).
        reprofile: also re-measure the latencies right before and after each run (module docstring).
        log: status lines.
        version: the code version the sweep's rows were written with (default: the current one).
    """
    version = version or code_version()
    rows = [
        r
        for r in store.of_kind("config")
        if r["code_version"] == version
        and r["dataset"] in datasets
        and r["draft"] in config.drafts
        and r["k"] in config.ks
        and r["batch"] in config.batches
    ]
    pipe = load_target(config.target, config.dtype, config.threads)
    out = []
    for i, row in enumerate(choose(rows, n), 1):
        ds = datasets[row["dataset"]]
        count = max(row["batch"], prompts or len(ds.sequences))
        seqs = [s for s in ds.sequences if s.continuation][:count]
        cfg = {
            "kind": "online",
            "validates": row["key"],
            "prompts": len(seqs),
            "reprofile": "bracketed" if reprofile else False,
            "plain": "interleaved by step",
        }
        key = row_key(cfg, version)
        if key in store:
            out.append(next(r for r in store.rows if r.get("key") == key))
            continue
        fields, summary = _validate_one(config, pipe, lat, row, seqs, reprofile)
        result = {"key": key, "kind": "online", "code_version": version, "config": cfg, **fields}
        store.append(result)
        out.append(result)
        log(f"validate {i}/{n}: {summary}")
    return out


def _validate_one(
    config: StudyConfig, pipe: Pipeline, lat: Latencies, row: dict, seqs: list, reprofile: bool
) -> tuple[dict, str]:
    """One configuration: its prediction from the sweep's latencies, then a real engine run on
    ``seqs`` with plain decoding of the same prompts interleaved (module docstring), and latencies
    re-measured around them when ``reprofile``.

    Returns:
        The row's fields after ``key``, ``kind``, ``code_version`` and ``config``, and a one-line
        summary for the log.
    """
    k, b, draft = row["k"], row["batch"], row["draft"]
    drafter = build_drafter(pipe, draft, config.draft_dtype)
    props = [offline_proposals(drafter, s, k) for s in seqs]
    sim, plain_sim = simulate(props, k, b), simulate(props, 0, b)
    closed = _closed_form(sim, lat, draft, k, b)
    sizes = sorted({x for x in config.batches if x <= b} | {b})
    ctxs = sorted({min(s.context for s in sim.steps), max(s.context for s in sim.steps)})
    # warm-up (first-call allocations), then the timed runs
    online_runs(pipe.runtime, [(drafter, k), (None, 0)], [seqs[0].prompt], 1, 4, pipe.eos_ids)
    before = _measure(config, pipe, drafter, draft, k, sizes, ctxs) if reprofile else None
    run, plain = online_runs(
        pipe.runtime,
        [(drafter, k), (None, 0)],
        [s.prompt for s in seqs],
        b,
        config.max_new_tokens,
        pipe.eos_ids,
    )
    after = _measure(config, pipe, drafter, draft, k, sizes, ctxs) if reprofile else None
    result = {
        "validates": row["key"],
        "target": config.target,
        "draft": draft,
        "dataset": row["dataset"],
        "k": k,
        "batch": b,
        "prompts": len(seqs),
        "outputs_equal_cached": sum(o == s.continuation for o, s in zip(run.outputs, seqs)),
        "outputs_equal_plain": sum(o == p for o, p in zip(run.outputs, plain.outputs)),
        "measured_tokens_per_s": round(run.tokens_per_s, 4),
        "measured_plain_tokens_per_s": round(plain.tokens_per_s, 4),
        "measured_speedup": round(run.tokens_per_s / plain.tokens_per_s, 5),
        "measured_total_tokens_per_s": round(run.total_tokens / run.total_seconds, 4)
        if run.total_seconds
        else None,
        **_errors("", predict(sim, lat, draft), predict(plain_sim, lat, draft), run, plain),
        "analytic_tokens_per_s": round(closed, 4),
        "analytic_relative_error": round(analytic.relative_error(closed, run.tokens_per_s), 5),
        "online_mean_accepted_length": round(run.stats.mean_accepted_length, 5),
        "offline_mean_accepted_length": round(sim.mean_accepted_length, 5),
        "online_draft_time_s": round(run.stats.draft_time, 5),
        "online_target_time_s": round(run.stats.target_time, 5),
        "seconds": round(run.total_seconds + plain.total_seconds, 3),
    }
    if reprofile:
        spec = [predict(sim, lt, draft) for lt in (before, after)]
        base = [predict(plain_sim, lt, draft) for lt in (before, after)]
        result |= _errors("reprofiled_", _bracketed(spec), _bracketed(base), run, plain)
    summary = (
        f"{draft} k={k} b={b} {row['dataset']}: measured {run.tokens_per_s:.1f} tok/s, predicted "
        f"{result['predicted_tokens_per_s']:.1f} ({result['relative_error']:.1%}); speedup measured "
        f"{result['measured_speedup']:.2f}x, predicted {result['predicted_speedup']:.2f}x "
        f"({result['speedup_relative_error']:.1%}); accepted/step online "
        f"{result['online_mean_accepted_length']:.2f} vs offline {result['offline_mean_accepted_length']:.2f}"
    )
    return result, summary


def _bracketed(predictions: list[tuple[float, float]]) -> tuple[float, float]:
    """(tokens, seconds) of predictions from profiles taken before and after a run: their mean step
    time, which cancels a steady drift during the run."""
    return predictions[0][0], statistics.mean(sec for _, sec in predictions)


def _errors(
    prefix: str, spec: tuple[float, float], plain: tuple[float, float], run: OnlineRun, base: OnlineRun
) -> dict:
    """``<prefix>``-named predicted throughput, plain throughput and speedup over plain decoding, and
    their relative errors against ``run`` and ``base`` (plain decoding); ``spec`` and ``plain`` are
    the predictions' (tokens, seconds)."""
    predicted, predicted_plain = spec[0] / spec[1], plain[0] / plain[1]
    speedup = predicted / predicted_plain
    return {
        f"{prefix}predicted_tokens_per_s": round(predicted, 4),
        f"{prefix}relative_error": round(analytic.relative_error(predicted, run.tokens_per_s), 5),
        f"{prefix}predicted_plain_tokens_per_s": round(predicted_plain, 4),
        f"{prefix}predicted_speedup": round(speedup, 5),
        f"{prefix}speedup_relative_error": round(
            analytic.relative_error(speedup, run.tokens_per_s / base.tokens_per_s), 5
        ),
    }


def _closed_form(sim: Simulation, lat: Latencies, draft: str, k: int, b: int) -> float:
    """:func:`~specdraft.study.sweep.closed_form` at the simulation's mean decode context."""
    return closed_form(sim, lat, draft, k, b, statistics.mean(s.context for s in sim.steps if not s.first))


def _measure(
    config: StudyConfig, pipe: Pipeline, drafter, draft: str, k: int, sizes: list[int], ctxs: list[int]
) -> Latencies:
    """Latencies re-measured at the batch sizes and context range one validation run decodes at."""
    return Latencies(
        target=measure_target(
            pipe.runtime,
            batch_sizes=sizes,
            k_max=k,
            contexts=ctxs,
            repeats=config.profile_repeats,
            name=config.target,
        ),
        drafts={
            draft: measure_draft(
                pipe.runtime,
                drafter,
                draft,
                batch_sizes=sizes,
                contexts=ctxs,
                repeats=config.profile_repeats,
                name=config.target,
            )
        },
        draft_kinds={draft: draft_kind(drafter)},
    )


def summarize(online_rows: list[dict]) -> dict:
    """How many rows, and the median of each relative error they carry (``median_<field>``)."""
    out = {"validated": len(online_rows)}
    for name in ERRORS:
        values = [r[name] for r in online_rows if r.get(name) is not None]
        if values:
            out[f"median_{name}"] = statistics.median(values)
    return out
