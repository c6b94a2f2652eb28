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
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass
class OnlineRun:
    """A timed engine run.

    Attributes:
        tokens: steady-state output tokens (first step of each batch excluded).
        seconds: steady-state wall seconds.
        total_tokens: every output token.
        total_seconds: wall seconds including prefill and first steps.
        stats: the engine's statistics, summed over batches.
        outputs: output tokens per prompt.
    """

    tokens: int
    seconds: float
    total_tokens: int
    total_seconds: float
    stats: SpecStats
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def online_run(
    runtime, drafter, prompts: list[list[int]], k: int, batch: int, max_new_tokens: int, eos_ids
) -> OnlineRun:
    """Decode ``prompts`` greedily, ``batch`` at a time, timing every engine step."""
    stats = SpecStats()
    tokens = total_tokens = 0
    seconds = total_seconds = 0.0
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        engine = Engine(runtime, drafter, FixedK(k))
        reqs = [
            Request(p, max_new_tokens, SamplingParams(), tuple(eos_ids))
            for p in prompts[start : start + batch]
        ]
        t0 = time.perf_counter()
        ids = engine.add(reqs)
        got = {i: [] for i in ids}
        total_seconds += time.perf_counter() - t0
        first = True
        while engine.active:
            t = time.perf_counter()
            events = engine.step()
            dt = time.perf_counter() - t
            n = 0
            for ev in events:
                got[ev.request_id] += ev.tokens
                n += len(ev.tokens)
            total_tokens += n
            total_seconds += dt
            if not first:
                tokens += n
                seconds += dt
            first = False
        stats.merge(engine.stats)
        outputs += [got[i] for i in ids]
    return OnlineRun(tokens, seconds, total_tokens, total_seconds, stats, outputs)


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
    ``seqs`` (with latencies re-measured around it when ``reprofile``).

    Returns:
        The row's fields after ``key``, ``kind``, ``code_version`` and ``config``, and a one-line
        summary for the log.
    """
    k, b, draft = row["k"], row["batch"], row["draft"]
    drafter = build_drafter(pipe, draft, config.draft_dtype)
    props = [offline_proposals(drafter, s, k) for s in seqs]
    sim = simulate(props, k, b)
    tok, sec = predict(sim, lat, draft)
    predicted = tok / sec
    closed = _closed_form(sim, lat, draft, k, b)
    sizes = sorted({x for x in config.batches if x <= b} | {b})
    ctxs = sorted({min(s.context for s in sim.steps), max(s.context for s in sim.steps)})
    # warm-up (first-call allocations), then the timed run
    online_run(pipe.runtime, drafter, [seqs[0].prompt], k, 1, 4, pipe.eos_ids)
    before = _measure(config, pipe, drafter, draft, k, sizes, ctxs) if reprofile else None
    run = online_run(
        pipe.runtime, drafter, [s.prompt for s in seqs], k, b, config.max_new_tokens, pipe.eos_ids
    )
    after = _measure(config, pipe, drafter, draft, k, sizes, ctxs) if reprofile else None
    same = sum(o == s.continuation for o, s in zip(run.outputs, seqs))
    result = {
        "validates": row["key"],
        "target": config.target,
        "draft": draft,
        "dataset": row["dataset"],
        "k": k,
        "batch": b,
        "prompts": len(seqs),
        "outputs_equal_cached": same,
        "measured_tokens_per_s": round(run.tokens_per_s, 4),
        "measured_total_tokens_per_s": round(run.total_tokens / run.total_seconds, 4)
        if run.total_seconds
        else None,
        "predicted_tokens_per_s": round(predicted, 4),
        "relative_error": round(analytic.relative_error(predicted, run.tokens_per_s), 5),
        "analytic_tokens_per_s": round(closed, 4),
        "analytic_relative_error": round(analytic.relative_error(closed, run.tokens_per_s), 5),
        "online_mean_accepted_length": round(run.stats.mean_accepted_length, 5),
        "offline_mean_accepted_length": round(sim.mean_accepted_length, 5),
        "online_draft_time_s": round(run.stats.draft_time, 5),
        "online_target_time_s": round(run.stats.target_time, 5),
        "seconds": round(run.total_seconds, 3),
    }
    if reprofile:
        seconds = statistics.mean(predict(sim, lt, draft)[1] for lt in (before, after))
        result["reprofiled_predicted_tokens_per_s"] = round(tok / seconds, 4)
        result["reprofiled_relative_error"] = round(
            analytic.relative_error(tok / seconds, run.tokens_per_s), 5
        )
    summary = (
        f"{draft} k={k} b={b} {row['dataset']}: measured {run.tokens_per_s:.1f} tok/s, predicted "
        f"{predicted:.1f} ({result['relative_error']:.1%}); accepted/step online "
        f"{result['online_mean_accepted_length']:.2f} vs offline {result['offline_mean_accepted_length']:.2f}"
    )
    return result, summary


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
    """Median relative error (and of the reprofiled predictions when present)."""
    out = {"validated": len(online_rows)}
    if online_rows:
        out["median_relative_error"] = statistics.median(r["relative_error"] for r in online_rows)
        re = [r["reprofiled_relative_error"] for r in online_rows if "reprofiled_relative_error" in r]
        if re:
            out["median_reprofiled_relative_error"] = statistics.median(re)
    return out
