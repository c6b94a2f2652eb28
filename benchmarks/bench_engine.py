"""The engine's performance figures (issue 2), as ratios measured in one run.

(a) own plain decoding tokens/s vs transformers ``generate`` (same dtype, threads and prompts;
    the two alternate prompt by prompt after a warm-up of each: :mod:`specdraft.bench.harness`);
(b) a target forward over 8 new tokens vs 1 token at a 200-token context (medians of interleaved
    rounds, :func:`specdraft.bench.profile.profile_latency`);
(c) speculative decoding with each candidate draft vs own plain decoding on Spec-Bench prompts, per
    category (:func:`specdraft.bench.runner.run_bench`, plain and speculative interleaved); the best
    draft is the one with the highest overall speedup.

Targets (issue 2): (a) >= 1.3x, (b) <= 1.2x, (c) >= 1.0x in every category.

    .venv/bin/python benchmarks/bench_engine.py --dtype fp32 --threads 1 --limit 1 --max-new-tokens 64

prints the command that reproduces it first, then the three figures; ``--json OUT`` keeps them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench import harness
from specdraft.bench.harness import runtime_precision
from specdraft.bench.hf_baselines import HFBaselines
from specdraft.bench.profile import profile_latency
from specdraft.bench.prompts import fit_context, load_prompts, parse_categories
from specdraft.bench.runner import BenchOptions, markdown_table, run_bench
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.registry import DraftSpec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="the target's precision")
    p.add_argument(
        "--draft-dtype",
        default="auto",
        choices=["auto", "bf16", "fp32", "int8"],
        help="the drafts' precision for (c)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--drafts",
        default="lookup,prune:0,1,2,29,designed",
        help="candidate drafts for (c) (a number joins the spec before it)",
    )
    p.add_argument("--k", default="5")
    p.add_argument("--limit", type=int, default=1, help="Spec-Bench questions per category for (a) and (c)")
    p.add_argument("--categories", default=None, help="Spec-Bench categories (default: all 13)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--max-prompt-tokens", type=int, default=512, help="longer prompts are truncated (middle cut)"
    )
    p.add_argument("--repeats", type=int, default=15, help="rounds for (b)")
    p.add_argument("--skip", default="", help="parts to skip, e.g. 'c' or 'a,b'")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def split_drafts(text: str) -> list[str]:
    """``"lookup,prune:0,1,2,29"`` -> ``["lookup", "prune:0,1,2,29"]`` (numbers join the spec before them)."""
    out: list[str] = []
    for part in (x.strip() for x in text.split(",")):
        if part.isdigit() and out:
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out


def part_a(pipe, prompts, max_new_tokens: int, max_prompt_tokens: int) -> dict:
    """Own plain decoding vs transformers generate, interleaved per prompt (greedy, first turns)."""
    hf = HFBaselines(pipe.target.model, pipe.eos_ids, None, None, "", methods=("hf_plain",))
    methods = [
        harness.engine_method("ours", pipe.runtime, None, eos_ids=pipe.eos_ids),
        harness.baseline_method("hf", partial(hf.run, "hf_plain")),
    ]
    budget = harness.prompt_budget(pipe.runtime, methods, max_new_tokens, max_prompt_tokens)
    prompt_ids = [fit_context(pipe.encode(p.turns[0]), budget).ids for p in prompts]
    harness.warm_up(methods, prompt_ids[0][:32], max_new_tokens)
    totals = {m.name: harness.Totals() for m in methods}
    same = 0
    for i, ids in enumerate(prompt_ids):
        runs = harness.run_prompt(methods, ids, i, max_new_tokens)
        for name, run in runs.items():
            totals[name].add(run)
        same += runs["ours"].tokens == runs["hf"].tokens
    ours_tps, hf_tps = totals["ours"].tokens_per_s, totals["hf"].tokens_per_s
    return {
        "prompts": len(prompt_ids),
        "ours_tokens_per_s": round(ours_tps, 2),
        "hf_tokens_per_s": round(hf_tps, 2),
        "ratio": round(ours_tps / hf_tps, 3),
        "same_tokens": same,
        "hf_dtype": str(next(pipe.target.model.parameters()).dtype).replace("torch.", ""),
    }


def part_b(pipe, repeats: int) -> dict:
    prof = profile_latency(
        pipe.runtime,
        None,
        new_tokens=(1, 8),
        context=200,
        repeats=repeats,
        warmup=3,
        target_name=pipe.target.name,
    )
    t1, t8 = prof.target_time(1), prof.target_time(8)
    return {
        "context": 200,
        "t1_ms": round(t1 * 1e3, 3),
        "t8_ms": round(t8 * 1e3, 3),
        "ratio": round(t8 / t1, 3),
        "repeats": repeats,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_engine.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"reproduce: {command}")
    api.set_threads(args.threads)
    skip = set(parse_categories(args.skip) or [])
    prompts = load_prompts(None, parse_categories(args.categories), args.limit)
    drafts = split_drafts(args.drafts)
    kinds = {d: DraftSpec.parse(d).kind for d in drafts}  # a bad spec fails before the target loads
    pipe = api.load(args.target, "none", dtype=args.dtype)
    draft_precision = api.resolve_dtype(args.draft_dtype, draft=True)
    precision = runtime_precision(pipe.runtime)
    print(
        f"target {args.target} ({precision}), {torch.get_num_threads()} threads, {len(prompts)} "
        f"Spec-Bench questions, {args.max_new_tokens} new tokens"
    )
    results: dict = {"command": command, "threads": torch.get_num_threads(), "dtype": precision}

    if "a" not in skip:
        a = results["a"] = part_a(pipe, prompts, args.max_new_tokens, args.max_prompt_tokens)
        print(
            f"\n(a) own plain decoding {a['ours_tokens_per_s']:.1f} tok/s vs transformers generate "
            f"{a['hf_tokens_per_s']:.1f} tok/s ({a['hf_dtype']}): {a['ratio']:.2f}x (target >= 1.3x); "
            f"same tokens on {a['same_tokens']}/{a['prompts']} prompts"
        )
    if "b" not in skip:
        b = results["b"] = part_b(pipe, args.repeats)
        print(
            f"\n(b) target forward at a 200-token context: 8 new tokens {b['t8_ms']:.2f} ms vs 1 token "
            f"{b['t1_ms']:.2f} ms: {b['ratio']:.2f}x (target <= 1.2x)"
        )
    if "c" not in skip:
        results["c"] = {}
        options = BenchOptions(
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            progress=sys.stderr.isatty(),
        )
        for draft in drafts:
            drafter = api.make_drafter(draft, pipe.target, pipe.runtime, draft_precision)
            if kinds[draft] == "designed" and isinstance(drafter, PromptLookupDrafter):
                print(
                    f"\n(c) {draft}: no designed draft for this target, so it would be prompt lookup "
                    "again; skipped"
                )
                continue
            dpipe = api.Pipeline(pipe.target, pipe.runtime, drafter, draft)
            res = run_bench(dpipe, prompts, options, log=lambda msg: None)
            results["c"][draft] = {"overall": res.overall, "categories": res.categories}
            print(
                f"\n(c) draft {draft} ({res.config['draft_dtype'] or 'no model'}), k {args.k}: "
                f"speculative vs own plain decoding per Spec-Bench category\n{markdown_table(res)}"
            )
        best = max(results["c"], key=lambda d: results["c"][d]["overall"]["speedup"] or 0)
        cats = results["c"][best]["categories"]
        worst = min(cats, key=lambda c: cats[c]["speedup"] or 0)
        print(
            f"\n(c) best draft {best}: overall {results['c'][best]['overall']['speedup']:.2f}x; "
            f"lowest category {worst} {cats[worst]['speedup']:.2f}x (target >= 1.0x in every category)"
        )
        results["best_draft"] = best
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nreproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
