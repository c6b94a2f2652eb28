"""Warm phrase pool on a stream of similar requests: Ouroboros and suffix drafters against plain
decoding and prompt lookup, in one process.

A stream of 2 x ``--limit`` GSM8K-style questions (the ``gsm8k/train.jsonl`` data file), batch 1,
greedy. The drafters with a process-wide memory (``ouroboros:lookup,shared``: one phrase pool;
``suffix:shared``: a history of earlier outputs) are warmed, untimed, on the first half; every
method is then measured on the second half, each prompt running every method once in a rotating
order (:mod:`specdraft.bench.harness`), the shared memories going on learning as a server's would.
The per-request drafters (``ouroboros:lookup``, ``suffix``, ``lookup``) start empty on each
request. Every speculative output is checked against plain decoding token for token. Prints
tokens/s over plain, tokens per target forward and the outputs that differ.

    .venv/bin/python benchmarks/bench_pool.py --limit 50 --max-new-tokens 128 --threads 2

``--save-pool PATH`` writes the shared phrase pool afterwards; ``ouroboros:lookup,warm=PATH`` starts
a later run from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api, pool
from specdraft.bench import harness
from specdraft.bench.prompts import data_file, fit_context
from specdraft.errors import SpecdraftError
from specdraft.policy import make_policy

DRAFTS = "lookup,ouroboros:lookup,ouroboros:lookup#shared,suffix,suffix:shared"
WARMED = ("shared",)  # drafts whose spec holds this are warmed on the first half


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="the target's precision (api.load): auto, bf16, fp32, q")
    p.add_argument("--drafts", default=DRAFTS, help="comma-separated draft specs ('#' stands for ',')")
    p.add_argument("--k", default="auto", help="the policy of every draft: auto, heuristic or an integer")
    p.add_argument("--limit", type=int, default=50, help="questions measured (as many warm the pool first)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--save-pool", default=None, help="write the shared phrase pool here afterwards")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def gsm8k_questions(n: int) -> list[str]:
    """The first n questions of the GSM8K training data file."""
    path = data_file("gsm8k/train.jsonl")
    lines = path.read_text().splitlines()[:n]
    return [json.loads(line)["question"] for line in lines]


def build_methods(pipe, specs: list[str], k: str) -> list[harness.Method]:
    """plain, then one engine method per draft spec, each with its own policy for the whole run."""
    methods = [harness.engine_method("plain", pipe.runtime, None, eos_ids=pipe.eos_ids)]
    for spec in specs:
        drafter = api.make_drafter(spec, pipe.target, pipe.runtime, torch.float32)
        methods.append(harness.engine_method(spec, pipe.runtime, drafter, make_policy(k), pipe.eos_ids))
    return methods


def measure(pipe, methods, ids: list[list[int]], max_new_tokens: int) -> dict[str, harness.Totals]:
    """Every method on every prompt, interleaved; outputs checked against plain decoding."""
    totals = {m.name: harness.Totals() for m in methods}
    tol = harness.tolerance(pipe.runtime)
    for i, prompt in enumerate(ids):
        runs = harness.run_prompt(methods, prompt, i, max_new_tokens)
        plain = runs["plain"].tokens
        for name, run in runs.items():
            cls = None
            if name != "plain":
                check = (pipe.runtime, prompt, plain, run.tokens, max_new_tokens, pipe.eos_ids, tol)
                cls = harness.equality(*check)[0]
            totals[name].add(run, cls)
        print(f"\r{i + 1}/{len(ids)} measured", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return totals


def report(args, totals: dict[str, harness.Totals], n: int, runtime: str) -> dict:
    """Print the table; the numbers as a dict (for --json)."""
    plain = totals["plain"]
    print(
        f"\n{args.target} ({runtime}), {torch.get_num_threads()} threads, k {args.k}, {n} GSM8K "
        f"questions measured after {n} warming the shared drafters, {args.max_new_tokens} new tokens, "
        "batch 1, greedy; speedup = tokens/s over plain decoding in the same run"
    )
    print("| method | tok/s | speedup | decode speedup | tokens per target forward | outputs differing |")
    print("|---|---|---|---|---|---|")
    doc = {}
    for name, t in totals.items():
        per_forward = t.tokens / t.stats.target_forwards if t.stats.target_forwards else 0.0
        row = {
            "tokens_per_s": t.tokens_per_s,
            "speedup": t.tokens_per_s / plain.tokens_per_s,
            "decode_speedup": t.decode_tokens_per_s / plain.decode_tokens_per_s,
            "tokens_per_forward": per_forward,
            "mismatches": t.mismatches if name != "plain" else 0,
        }
        doc[name] = row
        print(
            f"| {name} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | {row['decode_speedup']:.2f}x "
            f"| {per_forward:.2f} | {row['mismatches']} |"
        )
    return doc


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_pool.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print("command:", command, flush=True)
    pipe = api.load(args.target, "none", dtype=args.dtype, threads=args.threads)
    specs = [s.strip().replace("#", ",") for s in args.drafts.split(",") if s.strip()]
    methods = build_methods(pipe, specs, args.k)
    budget = harness.prompt_budget(pipe.runtime, methods, args.max_new_tokens, args.max_prompt_tokens)
    questions = gsm8k_questions(2 * args.limit)
    ids = [fit_context(pipe.encode(q), budget).ids for q in questions]
    warm, measured = ids[: len(ids) // 2], ids[len(ids) // 2 :]

    harness.warm_up([m for m in methods if not any(w in m.name for w in WARMED)], warm[0], 16)
    for i, prompt in enumerate(warm):  # the shared memories see the first half, untimed
        for m in methods:
            if any(w in m.name for w in WARMED):
                m.run(prompt, args.max_new_tokens)
        print(f"\r{i + 1}/{len(warm)} warming", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    totals = measure(pipe, methods, measured, args.max_new_tokens)
    runtime = f"{type(pipe.runtime).__name__}, computing in {harness.runtime_precision(pipe.runtime)}"
    doc = report(args, totals, len(measured), runtime)
    if args.save_pool:
        pool.shared_pool("ouroboros").save(args.save_pool)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": command, "methods": doc}, indent=2))
    print(f"\nreproduce: {command}")
    return 1 if any(r["mismatches"] for r in doc.values()) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SpecdraftError as e:  # a bad spec or a missing data file: one line
        sys.exit(f"error: {e}")
