"""The study's sweep: drafts x k x batch x datasets, from offline acceptance and profiled latencies.

The costly parts are shared, so hundreds of configurations take minutes, not hours:

1. the target's greedy continuation of every prompt, generated once and cached on disk
   (:func:`specdraft.study.offline.cached_continuations`);
2. one latency profile of the target, ``T_target(b, n)``, and one per draft, ``T_draft(b)``, at a
   few context lengths (:mod:`specdraft.study.latency`, measured by :mod:`specdraft.bench.profile`
   before any worker starts, so the workers do not disturb it);
3. one offline pass per (draft, dataset), proposing k_max tokens at every position: a *task*.
   Each task replays speculative decoding for every (k, batch) from that pass
   (:func:`specdraft.study.offline.simulate`) and predicts throughput with the analytic model,
   giving one row per configuration. A task per draft on held-out HellaSwag text measures the
   draft's perplexity and top-1 agreement.

Tasks run in a local process pool (default), in this process (``workers=0``) or as Ray tasks
(``executor="ray"``). Rows go to a :class:`specdraft.study.store.ResultStore` as tasks finish, so
a killed sweep resumes where it stopped.

Row kinds (``kind`` field): ``config`` (one per configuration), ``quality`` (one per draft),
``latency`` (the profiles), ``online`` (a configuration validated by a real engine run; see
:mod:`specdraft.study.validate`).

Throughput conventions: predictions are *steady-state decode* tokens/s: prefill and the first
step of each batch (where a draft model also reads the whole prompt) are left out, on both the
predicted and the measured side. ``predicted_tokens_per_s`` replays every step with its own batch
size, draft width and context length; ``analytic_tokens_per_s`` is the closed form
``b * E[tokens | k] / (k T_draft(b) + T_target(b, k + 1))`` at the mean context.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from specdraft import analytic, dtypes
from specdraft.errors import SpecdraftError
from specdraft.registry import DraftSpec
from specdraft.study.latency import Latencies
from specdraft.study.offline import (
    OfflineProposals,
    Sequence,
    Simulation,
    draft_quality,
    offline_proposals,
    simulate,
)
from specdraft.study.store import ResultStore, code_version, row_key

HELLASWAG = "hellaswag"


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------


def default_drafts(n_layers: int) -> list[str]:
    """Layer-pruned self drafts of several depths and layer choices, and prompt lookup.

    For a 30-layer target: the first 1-4 layers plus the last (``prune:0,29`` .. ``prune:0,1,2,3,29``),
    four and eight evenly spaced layers (ending with the last), and early exits that keep the first
    4, 15, 24 or 28 layers (no last layer), then ``lookup``. Untrained, the shallow ones are fast
    and the deep early exits accurate: the range the latency-vs-quality question needs.
    """
    last = n_layers - 1
    shapes = [
        [0, last],
        [0, 1, last],
        [0, 1, 2, last],
        [0, 1, 2, 3, last],
        [round(i * last / 3) for i in range(4)],
        [round(i * last / 7) for i in range(8)],
        *[list(range(n)) for n in (4, n_layers // 2, (4 * n_layers) // 5, n_layers - 2)],
    ]
    specs = []
    for layers in shapes:
        layers = sorted({x for x in layers if 0 <= x <= last})
        if 0 < len(layers) < n_layers:  # a draft with every layer is the target itself
            specs.append("prune:" + ",".join(map(str, layers)))
    return list(dict.fromkeys(specs)) + ["lookup"]


@dataclass
class StudyConfig:
    """What a sweep measures.

    Attributes:
        target: the target model (alias, directory or GGUF).
        dtype: resolved compute dtype name (``fp32``/``bf16``).
        threads: torch threads in every process (profiling, workers, validation).
        drafts: draft specs (``prune:...``, ``lookup[:N]``, a draft model).
        ks: draft lengths.
        batches: batch sizes.
        max_new_tokens: length of each cached target continuation.
        contexts: context lengths at which latencies are profiled.
        profile_repeats: timed rounds per latency (medians are used).
        draft_dtype: ``same`` (the target's; layer-pruned drafts then share its tensors), ``fp32``,
            ``bf16`` or ``int8``.
    """

    target: str
    dtype: str
    threads: int
    drafts: list[str]
    ks: list[int] = field(default_factory=lambda: list(range(1, 9)))
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    max_new_tokens: int = 64
    contexts: list[int] = field(default_factory=lambda: [32, 1088])
    profile_repeats: int = 5
    draft_dtype: str = "same"

    def __post_init__(self):
        if not self.drafts:
            raise SpecdraftError("the study needs at least one draft")
        if not self.ks or min(self.ks) < 1:
            raise SpecdraftError(f"draft lengths must be >= 1, got {self.ks}")
        if not self.batches or min(self.batches) < 1:
            raise SpecdraftError(f"batch sizes must be >= 1, got {self.batches}")
        if self.max_new_tokens < 2:
            raise SpecdraftError(f"max_new_tokens must be >= 2, got {self.max_new_tokens}")
        if self.threads < 1:
            raise SpecdraftError(f"threads must be >= 1, got {self.threads}")
        if self.draft_dtype not in dtypes.choices("study-draft"):
            names = ", ".join(dtypes.choices("study-draft"))
            raise SpecdraftError(f"unknown draft dtype {self.draft_dtype!r}: use {names}")
        for draft in self.drafts:  # a bad spec fails here, before anything loads
            DraftSpec.parse(draft)

    @property
    def k_max(self) -> int:
        return max(self.ks)


@dataclass
class Dataset:
    """A named prompt set, tokenized (after fitting the context window) and continued by the target.

    Attributes:
        name: Spec-Bench category, ``hellaswag``, or ``hellaswag-heldout`` (draft quality only).
        sequences: prompts with the target's cached continuations.
        fingerprint: hash of the prompts' token ids (part of every row's configuration).
    """

    name: str
    sequences: list[Sequence]
    fingerprint: str

    @staticmethod
    def fingerprint_of(prompts: list[list[int]]) -> str:
        h = hashlib.sha256()
        for p in prompts:
            h.update(b"|" + ",".join(map(str, p)).encode())
        return h.hexdigest()[:12]


# ------------------------------------------------------------------------------------------------
# Tasks
# ------------------------------------------------------------------------------------------------


@dataclass
class Task:
    """One offline pass: a draft over one dataset, and every row computed from it.

    Attributes:
        kind: ``config`` (rows for every (k, batch)) or ``quality`` (one draft-quality row).
        config: the study configuration.
        draft: the draft spec.
        dataset: the dataset name.
        fingerprint: the dataset's prompt fingerprint.
        sequences: prompts and cached continuations, as lists of ids (they travel to workers).
        latencies: :meth:`Latencies.as_dict`.
        version: code version the keys are made with.
        threads: torch threads of the process that runs it (an offline pass times nothing, so a
            pool of workers splits the cores; not part of any key).
    """

    kind: str
    config: StudyConfig
    draft: str
    dataset: str
    fingerprint: str
    sequences: list[tuple[list[int], list[int]]]
    latencies: dict
    version: str
    threads: int = 1

    def row_keys(self) -> list[str]:
        """The keys of every row this task writes."""
        return [r[0] for r in self.planned()]

    def planned(self) -> list[tuple[str, dict]]:
        """``(key, configuration)`` of every row this task writes."""
        c = self.config
        base = {
            "target": c.target,
            "dtype": c.dtype,
            "draft_dtype": c.draft_dtype,
            "threads": c.threads,
            "draft": self.draft,
            "dataset": self.dataset,
            "prompts": self.fingerprint,
            "max_new_tokens": c.max_new_tokens,
        }
        if self.kind == "quality":
            cfg = {"kind": "quality", **base}
            return [(row_key(cfg, self.version), cfg)]
        out = []
        for k in c.ks:
            for b in c.batches:
                cfg = {"kind": "config", **base, "k": k, "batch": b}
                out.append((row_key(cfg, self.version), cfg))
        return out


_LOADED: dict = {}


def load_target(target: str, dtype: str, threads: int):
    """The target pipeline (no drafter), loaded once per process."""
    import torch

    from specdraft import api

    torch.set_num_threads(threads)
    key = (target, dtype)
    if key not in _LOADED:
        _LOADED[key] = api.load(target, "none", dtype=dtype, threads=threads)
    return _LOADED[key]


def build_drafter(pipe, spec: str, draft_dtype: str = "same"):
    """The drafter for ``spec`` over a loaded target, built once per process."""
    from specdraft import api

    key = (pipe.target.name, spec, draft_dtype)
    if key not in _LOADED:
        weights = getattr(pipe.runtime, "w", None)  # compact runtime: share the target's weight dtype
        same = getattr(weights, "dtype", pipe.runtime.dtype)
        if api.is_quantized(pipe.runtime):  # its own GGUF blocks (a prune: draft is a view of them)
            same = dtypes.QUANT
        dtype = same if draft_dtype == "same" else dtypes.torch_dtype(draft_dtype)
        drafter = api.make_drafter(spec, pipe.target, pipe.runtime, dtype)
        if drafter is None:
            raise SpecdraftError(f"draft {spec!r} is no drafter; the study needs a draft")
        _LOADED[key] = drafter
    return _LOADED[key]


def predict(sim: Simulation, lat: Latencies, draft: str) -> tuple[float, float]:
    """Replay a simulation's steps against the latencies: (tokens, seconds) of steady-state decode."""
    tokens, seconds = 0, 0.0
    calls = lat.draft_calls(draft, sim.k) if sim.k else 0
    engine = draft if sim.k else None  # whose engine overhead: a speculative or a plain step
    for s in sim.steps:
        if s.first:
            continue
        tokens += s.emitted
        seconds += analytic.batch_step_time(
            s.width,
            s.rows,
            lambda b, c, ctx=s.context: lat.draft_time(draft, b, ctx, c),
            lambda b, n, ctx=s.context: lat.target_time(b, n, ctx),
            draft_calls=calls if s.draft_steps is None else s.draft_steps,  # a gated draft stops early
            t_engine=lambda b: lat.engine_time(engine, b),
        )
    return tokens, seconds


def closed_form(sim: Simulation, lat: Latencies, draft: str, k: int, b: int, ctx: float) -> float:
    """The closed-form batch throughput at one context ``ctx`` (no step-by-step replay): the
    simulation's mean accepted length over one step of k draft steps (one for a lookup or block
    draft) and a target forward over k + 1 tokens."""
    return analytic.batch_throughput(
        sim.mean_accepted_length,
        k,
        b,
        lambda bb, c: lat.draft_time(draft, bb, ctx, c),
        lambda bb, n: lat.target_time(bb, n, ctx),
        draft_calls=lat.draft_calls(draft, k),
        t_engine=lambda bb: lat.engine_time(draft, bb),
    )


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _round(x, digits=6):
    """``digits`` significant digits (None stays None)."""
    return None if x is None else float(f"{float(x):.{digits}g}")


def config_row(
    key: str,
    cfg: dict,
    version: str,
    sim: Simulation,
    plain: Simulation,
    lat: Latencies,
    draft: str,
    proposals: list[OfflineProposals],
) -> dict:
    """One configuration's row: offline acceptance, latencies and predicted throughput."""
    k, b = cfg["k"], cfg["batch"]
    tok, sec = predict(sim, lat, draft)
    ptok, psec = predict(plain, lat, draft)
    contexts = [s.context for s in sim.steps if not s.first] or [s.context for s in sim.steps]
    ctx = statistics.mean(contexts) if contexts else 0
    t_draft = lat.draft_time(draft, b, ctx)
    calls = lat.draft_calls(draft, k)
    closed = closed_form(sim, lat, draft, k, b, ctx)
    plain_closed = analytic.batch_throughput(
        1.0,
        0,
        b,
        lambda bb, c: 0.0,
        lambda bb, n: lat.target_time(bb, n, ctx),
        t_engine=lambda bb: lat.engine_time(None, bb),
    )
    rate, plain_rate = _rate(tok, sec), _rate(ptok, psec)
    quality = draft_quality(proposals)
    return {
        "key": key,
        "kind": "config",
        "code_version": version,
        "config": cfg,
        "target": cfg["target"],
        "draft": draft,
        "draft_kind": lat.draft_kinds.get(draft, "model"),
        "dataset": cfg["dataset"],
        "k": k,
        "batch": b,
        "sequences": len(proposals),
        "generated": sim.generated,
        "row_steps": sim.row_steps,
        "batched_steps": len(sim.steps),
        "mean_accepted_length": _round(sim.mean_accepted_length),
        "acceptance_rate": _round(sim.acceptance_rate),
        "alpha": _round(analytic.alpha_from_mean_accepted(sim.mean_accepted_length, k)),
        "mean_context": round(ctx, 1),
        "t_draft_s": _round(t_draft),
        "t_draft_step_total_s": _round(lat.draft_time(draft, b, ctx, calls)),
        "t_target_s": _round(lat.target_time(b, k + 1, ctx)),
        "t_target_plain_s": _round(lat.target_time(b, 1, ctx)),
        "predicted_tokens_per_s": _round(rate),
        "predicted_plain_tokens_per_s": _round(plain_rate),
        "predicted_speedup": _round(rate / plain_rate if rate and plain_rate else None),
        "analytic_tokens_per_s": _round(closed),
        "analytic_speedup": _round(closed / plain_closed if plain_closed else None),
        "draft_perplexity_dataset": _round(quality.perplexity) if quality else None,
        "draft_zero_prob_dataset": _round(quality.zero_prob_fraction) if quality else None,
        "draft_top1_dataset": _round(quality.top1_agreement) if quality else None,
    }


def run_task(task: Task) -> list[dict]:
    """Compute a task's rows (runs in a worker: loads the target and the draft once per process)."""
    c = task.config
    pipe = load_target(c.target, c.dtype, task.threads)
    drafter = build_drafter(pipe, task.draft, c.draft_dtype)
    seqs = [Sequence(p, cont) for p, cont in task.sequences]
    k_max = 1 if task.kind == "quality" else c.k_max
    proposals = [offline_proposals(drafter, s, k_max) for s in seqs if s.continuation]
    planned = task.planned()
    if task.kind == "quality":
        ((key, cfg),) = planned
        q = draft_quality(proposals)
        return [
            {
                "key": key,
                "kind": "quality",
                "code_version": task.version,
                "config": cfg,
                "target": c.target,
                "draft": task.draft,
                "dataset": task.dataset,
                "tokens": q.tokens if q else sum(len(s.continuation) for s in seqs),
                "perplexity": _round(q.perplexity) if q else None,
                "top1_agreement": _round(q.top1_agreement) if q else None,
                "zero_prob_fraction": _round(q.zero_prob_fraction) if q else None,
                "first_token_acceptance": _round(
                    statistics.mean(min(m, 1) for p in proposals for m in p.matched)
                )
                if proposals
                else None,
            }
        ]
    lat = Latencies.from_dict(task.latencies)
    plains = {b: simulate(proposals, 0, b) for b in c.batches}
    rows = []
    for key, cfg in planned:
        sim = simulate(proposals, cfg["k"], cfg["batch"])
        rows.append(config_row(key, cfg, task.version, sim, plains[cfg["batch"]], lat, task.draft, proposals))
    return rows


# ------------------------------------------------------------------------------------------------
# Executors
# ------------------------------------------------------------------------------------------------


def _init_worker() -> None:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_inline(tasks: list[Task]) -> Iterable[list[dict]]:
    for t in tasks:
        yield run_task(t)


def run_pool(tasks: list[Task], workers: int) -> Iterable[list[dict]]:
    """A local process pool ('spawn': torch and fork do not mix); yields rows as tasks finish."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(
        max_workers=workers, mp_context=mp.get_context("spawn"), initializer=_init_worker
    ) as pool:
        futures = [pool.submit(run_task, t) for t in tasks]
        try:
            for f in as_completed(futures):
                yield f.result()
        finally:
            for f in futures:
                f.cancel()


def run_ray(tasks: list[Task], address: str | None, workers: int) -> Iterable[list[dict]]:
    """Ray tasks on the cluster at ``address`` (``ray.init(address=...)``), or on a local
    ``workers``-CPU cluster started here when address is None. Every node needs specdraft
    installed (as it is in this virtual environment)."""
    try:
        import ray
    except ImportError:
        raise SpecdraftError("--executor ray needs Ray: pip install 'ray>=2.60'") from None
    started = False
    if not ray.is_initialized():
        env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}
        try:
            if address:
                ray.init(address=address, runtime_env=env, log_to_driver=False)
            else:
                ray.init(
                    num_cpus=max(workers, 1), runtime_env=env, log_to_driver=False, include_dashboard=False
                )
        except ConnectionError as e:
            raise SpecdraftError(f"cannot connect to the Ray cluster at {address}: {e}") from None
        started = True
    remote = ray.remote(num_cpus=1, max_retries=1)(run_task)
    pending = [remote.remote(t) for t in tasks]
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


# ------------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------------


@dataclass
class SweepSummary:
    """What a sweep did.

    Attributes:
        configurations: configuration rows the sweep covers.
        computed: rows computed by this run (the rest were already in the results file).
        tasks: offline passes run by this run.
        seconds: wall time of this run.
        results: the results file.
    """

    configurations: int
    computed: int
    tasks: int
    seconds: float
    results: Path


def latency_rows(
    config: StudyConfig, version: str, store: ResultStore, pipe, log: Callable[[str], None]
) -> Latencies:
    """Profiled latencies from the results file, measuring (and appending) whatever is missing."""
    from specdraft.study.latency import draft_kind, draft_shape, measure_draft, measure_target

    base = {
        "kind": "latency",
        "target": config.target,
        "dtype": config.dtype,
        "draft_dtype": config.draft_dtype,
        "threads": config.threads,
        "batches": sorted(config.batches),
        "contexts": sorted(config.contexts),
        "repeats": config.profile_repeats,
    }
    by_key = {r["key"]: r for r in store.of_kind("latency")}
    tcfg = {**base, "draft": None, "k_max": config.k_max}
    tkey = row_key(tcfg, version)
    if tkey not in by_key:
        log(
            f"profiling the target: batches {sorted(config.batches)}, n = 1..{config.k_max + 1}, "
            f"contexts {sorted(config.contexts)}"
        )
        prof = measure_target(
            pipe.runtime,
            batch_sizes=config.batches,
            k_max=config.k_max,
            contexts=config.contexts,
            repeats=config.profile_repeats,
            name=config.target,
        )
        store.append(
            {
                "key": tkey,
                "kind": "latency",
                "code_version": version,
                "config": tcfg,
                "draft": None,
                "profiles": {str(c): p.as_dict() for c, p in prof.items()},
            }
        )
        by_key = {r["key"]: r for r in store.of_kind("latency")}
    from specdraft.bench.profile import LatencyProfile

    lat = Latencies(target={int(c): LatencyProfile.from_dict(p) for c, p in by_key[tkey]["profiles"].items()})
    for spec in config.drafts:
        dcfg = {**base, "draft": spec}
        dkey = row_key(dcfg, version)
        drafter = build_drafter(pipe, spec, config.draft_dtype)
        if dkey not in by_key:
            log(f"profiling draft {spec}")
            prof = measure_draft(
                pipe.runtime,
                drafter,
                spec,
                batch_sizes=config.batches,
                contexts=config.contexts,
                repeats=config.profile_repeats,
                name=config.target,
            )
            row = {
                "key": dkey,
                "kind": "latency",
                "code_version": version,
                "config": dcfg,
                "draft": spec,
                "draft_kind": draft_kind(drafter),
                "draft_shape": draft_shape(drafter),
                "profiles": {str(c): p.as_dict() for c, p in prof.items()},
            }
            store.append(row)
            by_key[dkey] = row
        row = by_key[dkey]
        lat.drafts[spec] = {int(c): LatencyProfile.from_dict(p) for c, p in row["profiles"].items()}
        lat.draft_kinds[spec] = row["draft_kind"]
    return lat


def plan_tasks(
    config: StudyConfig, datasets: list[Dataset], heldout: Dataset | None, lat: Latencies, version: str
) -> list[Task]:
    """Every task of the sweep: a quality task per draft (on ``heldout``) and a config task per
    (draft, dataset)."""
    tasks = []
    latd = lat.as_dict()
    for spec in config.drafts:
        if heldout is not None:
            tasks.append(
                Task(
                    "quality",
                    config,
                    spec,
                    heldout.name,
                    heldout.fingerprint,
                    [(s.prompt, s.continuation) for s in heldout.sequences],
                    latd,
                    version,
                )
            )
        for ds in datasets:
            tasks.append(
                Task(
                    "config",
                    config,
                    spec,
                    ds.name,
                    ds.fingerprint,
                    [(s.prompt, s.continuation) for s in ds.sequences],
                    latd,
                    version,
                )
            )
    return tasks


def run_sweep(
    config: StudyConfig,
    datasets: list[Dataset],
    heldout: Dataset | None,
    store: ResultStore,
    *,
    executor: str = "local",
    address: str | None = None,
    workers: int = 2,
    progress: bool = True,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    version: str | None = None,
) -> SweepSummary:
    """Profile, then run every task whose rows are not in ``store`` yet, appending rows as they come.

    Args:
        config: what to sweep.
        datasets: the evaluation datasets (with cached continuations).
        heldout: held-out target text for draft quality (None: skip quality rows).
        store: the results file; rows already there are not recomputed.
        executor: ``local`` (process pool; ``workers=0`` runs in this process) or ``ray``.
        address: Ray cluster address (``executor="ray"``); None starts a local cluster.
        workers: processes (local) or CPUs of a local Ray cluster.
        progress: show a progress bar with ETA.
        log: where status lines go.
        version: code version for the keys (default :func:`code_version` now); a caller that
            runs several phases passes the one it computed at its start.
    """
    t0 = time.perf_counter()
    version = version or code_version()
    pipe = load_target(config.target, config.dtype, config.threads)
    lat = latency_rows(config, version, store, pipe, log)
    tasks = plan_tasks(config, datasets, heldout, lat, version)
    total = sum(len(t.row_keys()) for t in tasks if t.kind == "config")
    todo = [t for t in tasks if any(k not in store for k in t.row_keys())]
    pending_rows = sum(len([k for k in t.row_keys() if k not in store]) for t in todo)
    all_rows = sum(len(t.row_keys()) for t in tasks)
    if pending_rows < all_rows:  # a killed run left rows behind (whole tasks or part of one)
        log(
            f"resuming: {all_rows - pending_rows} of {all_rows} rows already in {store.path} "
            f"({len(tasks) - len(todo)} of {len(tasks)} tasks complete)"
        )
    if executor not in ("local", "ray"):
        raise SpecdraftError(f"unknown executor {executor!r}: use local or ray")
    inline = executor == "local" and (workers <= 0 or len(todo) <= 1)
    for t in todo:  # a Ray task holds one CPU; pool workers share config.threads cores
        t.threads = (
            config.threads if inline else 1 if executor == "ray" else max(1, config.threads // workers)
        )
    if executor == "ray":
        results = run_ray(todo, address, workers)
    else:
        results = run_inline(todo) if inline else run_pool(todo, workers)

    from tqdm import tqdm

    computed = 0
    with tqdm(
        total=pending_rows,
        unit="row",
        desc="study",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        for rows in results:
            n = store.extend(rows)
            computed += n
            bar.update(n)
            if rows:
                bar.set_postfix_str(f"{rows[0]['draft']} / {rows[0]['dataset']}", refresh=False)
    return SweepSummary(total, computed, len(todo), time.perf_counter() - t0, store.path)
