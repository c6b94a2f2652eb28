"""``specdraft study``: sweep drafts x k x batch x datasets from offline acceptance and profiled
latencies, validate a few configurations online, and write the results (then ``specdraft report``)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from specdraft import dtypes
from specdraft.commands import positive_int
from specdraft.errors import SpecdraftError
from specdraft.models.loading import DEFAULT_TARGET

HELP = "run the study: drafts x k x batch x datasets, predicted throughput, online validation"


def _ints(text: str) -> list[int]:
    """``"1-8"`` or ``"1,2,4,8"`` -> list of ints."""
    out = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = part.split("-", 1)
                out += range(int(lo), int(hi) + 1)
            elif part:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1-8 or 1,2,4,8, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return sorted(set(out))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model alias, HF directory or GGUF path")
    p.add_argument(
        "--drafts",
        default=None,
        help="semicolon-separated draft specs replacing the defaults (layer-pruned self drafts and lookup)",
    )
    p.add_argument(
        "--draft",
        action="append",
        default=[],
        metavar="SPEC",
        help="add a draft (repeatable), e.g. a designed draft's directory",
    )
    p.add_argument("--k", type=_ints, default=list(range(1, 9)), help="draft lengths (default 1-8)")
    p.add_argument("--batch", type=_ints, default=[1, 2, 4, 8], help="batch sizes (default 1,2,4,8)")
    p.add_argument(
        "--datasets",
        default=None,
        help="comma-separated dataset names (Spec-Bench categories, hellaswag); default all",
    )
    p.add_argument(
        "--spec-bench",
        default=None,
        help="Spec-Bench question file (default: spec_bench/question.jsonl from $SPECDRAFT_DATA "
        "or ../shared/data, else the slice in specdraft/data); 'none' to leave out",
    )
    p.add_argument(
        "--hellaswag",
        default=None,
        help="HellaSwag prompt file (default: hellaswag_prompts.jsonl from $SPECDRAFT_DATA or "
        "../shared/data, else the slice in specdraft/data); 'none' to leave out",
    )
    p.add_argument("--prompts-per-dataset", type=int, default=8)
    p.add_argument(
        "--heldout", type=int, default=16, help="held-out HellaSwag prompts for draft perplexity/agreement"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="length of each cached target continuation")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=1024, help="longer prompts are truncated in the middle"
    )
    p.add_argument(
        "--contexts",
        type=_ints,
        default=None,
        help="context lengths at which latencies are profiled (default: 32 and max-prompt-tokens + "
        "max-new-tokens)",
    )
    p.add_argument("--profile-repeats", type=int, default=5)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=dtypes.choices("study-target"),
        help=dtypes.help_text("study-target"),
    )
    p.add_argument(
        "--draft-dtype",
        default="same",
        choices=dtypes.choices("study-draft"),
        help=dtypes.help_text("study-draft"),
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per process (default 1)")
    p.add_argument(
        "--executor", default="local", choices=["local", "ray"], help="local process pool or Ray tasks"
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (with --executor ray); default: start a local one",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes (local; 0 = in this process) or local Ray CPUs",
    )
    p.add_argument(
        "--validate", type=int, default=8, help="configurations to validate with real engine runs (0: none)"
    )
    p.add_argument(
        "--validate-prompts",
        type=int,
        default=None,
        help="prompts per validation run (default: the dataset's)",
    )
    p.add_argument(
        "--validate-reprofile",
        action="store_true",
        help="re-measure latencies right before and after each validation run as well (separates drift "
        "from model error)",
    )
    p.add_argument("--out", default="runs/study", help="output directory (results.jsonl goes there)")
    p.add_argument("--no-progress", action="store_true")


def reproducing_command(args: argparse.Namespace) -> str:
    """The ``specdraft study`` command line of this run, every option spelled out."""
    parts = ["specdraft", "study"]
    for name, value in vars(args).items():
        if name.startswith("_") or name == "command" or value is None or value is False or value == []:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif name == "draft":
            for v in value:
                parts += [flag, v]
        elif isinstance(value, list):
            parts += [flag, ",".join(map(str, value))]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from specdraft import api
    from specdraft.study.store import ResultStore, code_version, row_key
    from specdraft.study.sweep import (
        build_drafter,
        latency_rows,
        load_target,
        run_sweep,
    )
    from specdraft.study.validate import summarize, validate

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # rows record the name
    dtype = "fp32" if api.resolve_dtype(args.dtype) == dtypes.torch_dtype("fp32") else "bf16"
    if args.prompts_per_dataset < 1 or args.heldout < 0 or args.max_new_tokens < 2:
        raise SpecdraftError("need --prompts-per-dataset >= 1, --heldout >= 0 and --max-new-tokens >= 2")
    if max(args.batch or [1]) > args.prompts_per_dataset:  # a batch holds at most a dataset's prompts
        raise SpecdraftError(
            f"--batch {max(args.batch)} needs at least {max(args.batch)} prompts per dataset "
            f"(--prompts-per-dataset {args.prompts_per_dataset}): a batch of a dataset cannot hold more rows"
        )
    t0 = time.perf_counter()
    version = code_version()  # once: edits to the tree during a long run must not split its rows
    pipe = load_target(args.target, dtype, args.threads)
    config = _config(args, pipe, dtype)
    drafts = config.drafts

    for spec in drafts:  # a bad draft spec fails now, not after the target has generated continuations
        build_drafter(pipe, spec, config.draft_dtype)

    datasets, heldout = _datasets(args, pipe, config, log)
    out = Path(args.out)
    store = ResultStore(out / "results.jsonl")
    n_cfg = len(drafts) * len(config.ks) * len(config.batches) * len(datasets)
    log(
        f"study: {len(drafts)} drafts x {len(config.ks)} k x {len(config.batches)} batch sizes x "
        f"{len(datasets)} datasets = {n_cfg} configurations; code {version}; results {store.path}"
    )
    command = reproducing_command(args)
    store.append(
        {
            "key": row_key({"kind": "run", "command": command, "started": time.time()}, version),
            "kind": "run",
            "command": command,
            "code_version": version,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    )
    summary = run_sweep(
        config,
        datasets,
        heldout,
        store,
        executor=args.executor,
        address=args.address,
        workers=args.workers,
        progress=not args.no_progress,
        log=log,
        version=version,
    )
    log(
        f"sweep: {summary.configurations} configurations, {summary.computed} rows computed in "
        f"{summary.seconds:.0f} s ({summary.tasks} offline passes)"
    )
    online = []
    if args.validate > 0:
        lat = latency_rows(config, version, store, pipe, log)
        online = validate(
            config,
            {d.name: d for d in datasets},
            lat,
            store,
            args.validate,
            prompts=args.validate_prompts,
            reprofile=args.validate_reprofile,
            log=log,
            version=version,
        )
    s = summarize(online)
    _print_summary(summary, s, time.perf_counter() - t0, store.path, out)
    return 0


def _config(args: argparse.Namespace, pipe, dtype: str):
    """The study configuration: ``--drafts`` (default: layer-pruned drafts over the target's depth,
    or prompt lookup) plus each ``--draft``, and the grid and profiling settings."""
    from specdraft.study.sweep import StudyConfig, default_drafts

    if args.drafts:
        drafts = [d.strip() for d in args.drafts.split(";") if d.strip()]
    else:
        n_layers = len(getattr(pipe.runtime, "layers", []))
        drafts = default_drafts(n_layers) if n_layers else ["lookup"]
    drafts = list(dict.fromkeys(drafts + args.draft))
    contexts = args.contexts or [32, args.max_prompt_tokens + args.max_new_tokens]
    return StudyConfig(
        args.target,
        dtype,
        args.threads,
        drafts,
        args.k,
        args.batch,
        args.max_new_tokens,
        contexts,
        args.profile_repeats,
        args.draft_dtype,
    )


def _datasets(args: argparse.Namespace, pipe, config, log):
    """The datasets (prompts and the target's cached continuations) and the held-out texts."""
    from specdraft.study import datasets as ds

    def path_or_default(value, default):
        if value == "none":
            return None
        return Path(value) if value else default()

    names = [n.strip() for n in args.datasets.split(",") if n.strip()] if args.datasets else None
    texts, held = ds.select_prompts(
        path_or_default(args.spec_bench, ds.default_prompts_path),
        path_or_default(args.hellaswag, ds.default_hellaswag_path),
        names,
        args.prompts_per_dataset,
        args.heldout,
    )
    datasets, heldout = ds.build_datasets(
        pipe,
        texts,
        held,
        dtype=config.dtype,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        k_max=config.k_max,
        log=log,
    )
    return datasets, heldout


def _print_summary(summary, s: dict, total: float, results: Path, out: Path) -> None:
    """The closing lines on stdout: rows and times, the online validation error, what next."""
    print(
        f"configurations: {summary.configurations} (computed now: {summary.computed}); sweep "
        f"{summary.seconds:.0f} s; total {total:.0f} s"
    )
    if s["validated"]:
        line = (
            f"online validation: {s['validated']} configurations, median |predicted - measured| / "
            f"measured = {s['median_relative_error']:.1%}"
        )
        if "median_reprofiled_relative_error" in s:
            line += (
                " (with latencies re-measured right before and after each run: "
                f"{s['median_reprofiled_relative_error']:.1%})"
            )
        if "median_speedup_relative_error" in s:
            line += (
                "; of the speedup over plain decoding run interleaved: "
                f"{s['median_speedup_relative_error']:.1%}"
            )
            if "median_reprofiled_speedup_relative_error" in s:
                line += f" ({s['median_reprofiled_speedup_relative_error']:.1%} re-measured)"
        print(line)
    print(f"results: {results}\nnext: specdraft report {results} --out {out}")
