"""``specdraft demo`` (what ``make demo`` runs): a small Spec-Bench run and its report.

On the embedded default model and the default draft: one question per Spec-Bench category (13
categories; the 8 MT-bench ones have two turns), short answers, long prompts truncated, plain and
speculative decoding interleaved (``--baselines`` adds the transformers baselines); then a latency
profile of the target and the draft, and the report. ``--time-budget`` (270 s) bounds the whole
demo: the bench starts no new question once the profile and the report (about 45 s kept for them)
would not fit, so a busy machine gives a shorter bench rather than a late demo; the questions left
out are listed in ``bench.json`` under ``skipped``. Without ``--threads`` the demo uses every core
when the machine is idle and one thread when it is busy (:func:`demo_threads`). Everything goes to
``runs/demo/`` (git-ignored):

- ``bench.json`` / ``bench.md``: the ``specdraft bench`` results and table;
- ``profile.json``: T_target(1, n) and T_draft(1) and the draft-step breakdown;
- ``REPORT.md`` and its plots, written by :func:`specdraft.study.report.write_report`, ending
  with the verdicts on the seed paper's claims of the committed studies (the REPORT.md of
  ``results/study-smollm2-135m/`` and of each other study folder there), linked.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from specdraft.commands import add_model_arguments, load_pipeline, positive_int

RESERVE_S = 45.0  # seconds kept for the profile and the report after the bench
STUDIES = Path(__file__).resolve().parents[2] / "results"  # the committed studies (a source checkout)

HELP = "run the main job on the embedded default model: a small Spec-Bench bench, a profile and the report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--limit", type=int, default=1, help="questions per Spec-Bench category")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="generation budget per turn")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=256, help="longer prompts (rag, summarization) are truncated"
    )
    p.add_argument("--prompts", default=None, help="JSONL prompt file (default: Spec-Bench)")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--baselines",
        dest="baselines",
        action="store_true",
        default=False,
        help="also run the transformers baselines (generate, assisted generation, prompt lookup): three "
        "more runs of each question, so on 2 cores only part of the 13 questions fit the time budget",
    )
    g.add_argument("--no-baselines", dest="baselines", action="store_false", help="skip them (the default)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=270.0,
        help="seconds for the whole demo: the bench starts no new question once the profile and report "
        "would not fit",
    )


def run(args: argparse.Namespace) -> int:
    from specdraft.bench.profile import profile_pipeline
    from specdraft.bench.prompts import load_prompts
    from specdraft.bench.runner import BenchOptions, markdown_table, run_bench

    t0 = time.perf_counter()
    if args.threads is None:
        args.threads = demo_threads()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.prompts, None, args.limit)
    pipe = load_pipeline(args, needs=("hf",) if args.baselines else ())
    print(
        f"target {pipe.target.name} ({pipe.target.source}); draft {pipe.draft_spec}; k {args.k}; "
        f"{pipe.runtime}; "
        f"{args.threads} thread(s)",
        file=sys.stderr,
    )
    print(f"bench: {len(prompts)} questions, {args.max_new_tokens} new tokens per turn", file=sys.stderr)

    options = BenchOptions(
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        baselines=("hf",) if args.baselines else (),
        max_prompt_tokens=args.max_prompt_tokens,
        progress=True,
        time_budget_s=max(args.time_budget - (time.perf_counter() - t0) - RESERVE_S, 0.0),
    )
    notes: list[str] = []
    result = run_bench(pipe, prompts, options, log=notes.append)
    if result.skipped:
        print(
            f"note: {len(result.skipped)} of {len(prompts)} questions not run "
            f"({notes[-1] if notes else 'skipped'})",
            file=sys.stderr,
        )
    result.config["command"] = _command(args)
    table = markdown_table(result)
    bench_json = out / "bench.json"
    bench_json.write_text(json.dumps(result.as_dict(), indent=2))
    (out / "bench.md").write_text(table + "\n")
    print(table)

    k = options.fixed_k or 8
    profile = profile_pipeline(
        pipe, batch_sizes=(1,), new_tokens=(1, 2, k + 1), context=200, repeats=5, warmup=1
    )
    profile_json = out / "profile.json"
    profile.save(profile_json)
    print("\n" + profile.table())

    report = _write_report(out, bench_json, profile_json)
    took = time.perf_counter() - t0
    print(f"\ndemo finished in {took:.0f} s")
    print(f"bench results: {bench_json} (table: {out / 'bench.md'}); latency profile: {profile_json}")
    if report is not None:
        print(f"report: {report}")
    return 0


def demo_threads() -> int:
    """All cores on an idle machine; one thread when others are running (load average >= 1).

    Several threads per process on a machine whose cores are already busy make every thread
    wait for the others, so a busy machine gets one.
    """
    import os

    import torch

    try:
        busy = os.getloadavg()[0] >= 1.0
    except OSError:
        busy = False
    return 1 if busy else torch.get_num_threads()


def _command(args: argparse.Namespace) -> str:
    parts = [
        "specdraft",
        "demo",
        "--target",
        args.target,
        "--draft",
        args.draft,
        "--k",
        str(args.k),
        "--dtype",
        args.dtype,
        "--draft-dtype",
        args.draft_dtype,
    ]
    parts += [
        "--limit",
        str(args.limit),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--max-prompt-tokens",
        str(args.max_prompt_tokens),
    ]
    parts += ["--time-budget", f"{args.time_budget:g}"]
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    if args.prompts:
        parts += ["--prompts", args.prompts]
    if args.baselines:
        parts.append("--baselines")
    return shlex.join(parts)


def _write_report(out: Path, bench_json: Path, profile_json: Path) -> Path | None:
    """The study's report (REPORT.md and plots) over this run's bench and profile JSON."""
    try:
        from specdraft.study.report import write_report
    except ImportError:  # the study package is optional for the bench itself
        print(
            "report: specdraft.study.report is not available; the bench table is in bench.md", file=sys.stderr
        )
        return None
    report = Path(write_report([bench_json, profile_json], out))
    _link_studies(report)
    return report


def _link_studies(report: Path) -> None:
    """Append the committed studies' seed-claim verdicts, each study linked, to ``report``."""
    from specdraft.study.claims import verdicts

    lines = []
    for path in sorted(STUDIES.glob("study-*/REPORT.md")):
        rows = verdicts(path.read_text())
        if rows:
            lines.append(f"- [{path.parent.name}]({path}): " + "; ".join(f"{c}: {v}" for c, v in rows))
    if lines:
        with report.open("a") as f:
            f.write("\n## The seed's claims in the committed studies\n\n" + "\n".join(lines) + "\n")
