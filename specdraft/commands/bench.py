"""``specdraft bench``: Spec-Bench-style evaluation of a draft against plain decoding (and transformers)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specdraft.commands import (
    add_model_arguments,
    add_sampling_arguments,
    load_pipeline,
    positive_int,
    sampling_from_args,
)

HELP = "benchmark speculative vs plain decoding on Spec-Bench prompts (optionally vs transformers)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL prompt file (default: Spec-Bench spec_bench/question.jsonl from "
        "$SPECDRAFT_DATA or ../shared/data, else the 52-question slice in specdraft/data)",
    )
    p.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="generation budget per turn")
    p.add_argument(
        "--baselines",
        default="",
        help="'hf': also transformers generate plain, assisted and prompt lookup; 'llamacpp': also "
        "llama.cpp plain and prompt lookup on the target's GGUF (needs llama-cpp-python: make peers); "
        "'bf16': also the target's bf16 runtime, plain (greedy agreement with a quantized one); "
        "several: 'hf,llamacpp'",
    )
    p.add_argument(
        "--long-prompts",
        default="truncate",
        choices=["truncate", "skip"],
        help="prompts longer than the context window",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="truncate/skip prompts longer than this (default: context window)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="near-tie margin for the equality check (default: 0 in fp32, 1.0 in bf16)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON to OUT")
    p.add_argument("--markdown", default=None, metavar="OUT", help="also write the markdown table to OUT")


def reproducing_command(args: argparse.Namespace) -> str:
    """The ``specdraft bench`` command line that reproduces this run (options spelled out)."""
    parts = ["specdraft", "bench", "--target", args.target, "--draft", args.draft, "--k", str(args.k)]
    parts += [
        "--dtype",
        args.dtype,
        "--draft-dtype",
        args.draft_dtype,
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]
    for flag, value in (
        ("--threads", args.threads),
        ("--prompts", args.prompts),
        ("--categories", args.categories),
        ("--limit", args.limit),
        ("--baselines", args.baselines or None),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--tolerance", args.tolerance),
    ):
        if value is not None:
            parts += [flag, str(value)]
    if args.runtime != "auto":
        parts += ["--runtime", args.runtime]
    if args.long_prompts != "truncate":
        parts += ["--long-prompts", args.long_prompts]
    if args.temperature:
        parts += [
            "--temperature",
            str(args.temperature),
            "--top-k",
            str(args.top_k),
            "--top-p",
            str(args.top_p),
        ]
        if args.seed is not None:
            parts += ["--seed", str(args.seed)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from specdraft.bench.prompts import load_prompts, parse_categories
    from specdraft.bench.runner import BenchOptions, markdown_table, run_bench

    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    options = BenchOptions(
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        params=sampling_from_args(args),
        baselines=baselines,
        long_prompts=args.long_prompts,
        max_prompt_tokens=args.max_prompt_tokens,
        tolerance=args.tolerance,
        progress=not args.no_progress,
    )
    prompts = load_prompts(args.prompts, parse_categories(args.categories), args.limit)
    # --baselines hf keeps --dtype auto on bf16 (the transformers model)
    pipe = load_pipeline(args, needs=baselines)
    result = run_bench(pipe, prompts, options)
    result.config["command"] = reproducing_command(args)
    table = markdown_table(result)
    print(table)
    for path, text in ((args.json, json.dumps(result.as_dict(), indent=2)), (args.markdown, table + "\n")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}", file=sys.stderr)
    return 0
