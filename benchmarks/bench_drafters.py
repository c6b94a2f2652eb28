r"""Several drafters against plain decoding on Spec-Bench: batch 1, greedy, one process, one run.

Each prompt runs every method once, in a rotating order (:func:`specdraft.bench.harness.interleave`),
after an untimed warm-up. tokens/s is new tokens / wall time, prefill included; tokens per forward
is the engine's mean accepted length (accepted drafts + the target's own token per target forward;
for a token tree, per tree step). Every output is checked against plain decoding
(:func:`specdraft.bench.harness.equality`); the script exits 1 if any differs. Per category: each
drafter's tok/s over plain's on the same prompts. First acc.: of the steps that drafted, the share
whose first draft token (a tree: a depth-1 node) was accepted. ``--drafts`` takes ``spec@k``
items separated by ``;`` (a spec may hold commas: ``ouroboros:lookup,chain@auto``).

    .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --limit 2 --max-new-tokens 128 \
        --drafts "lookup@auto;lookup-tree@auto;suffix@auto;ouroboros:lookup@auto" \
        --json runs/drafters/bench.json --plot runs/drafters/speedup.png

Spec-Bench is evaluation-only here; nothing is trained on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api, dtypes
from specdraft.bench import harness
from specdraft.bench.profile import cpu_name
from specdraft.bench.prompts import fit_context, load_prompts, parse_categories
from specdraft.policy import make_policy
from specdraft.stats import SpecStats


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="the target's precision (auto: quantized for a GGUF)")
    p.add_argument("--drafts", default="lookup@auto;lookup-tree@auto", help="'spec@k' items, ';'-separated")
    p.add_argument(
        "--draft-dtype", default="auto", choices=dtypes.choices("draft"), help=dtypes.help_text("draft")
    )
    p.add_argument(
        "--prompts", type=Path, default=None, help="a Spec-Bench-format JSONL instead of Spec-Bench itself"
    )
    p.add_argument("--limit", type=int, default=2, help="prompts per category")
    p.add_argument("--categories", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="bar plot of speedup per category (PNG)")
    return p.parse_args()


def draft_items(args) -> list[tuple[str, str, str]]:
    """``(item, spec, k)`` per ``spec@k`` of ``--drafts`` (k: ``auto`` when absent)."""
    items = []
    for item in filter(None, (s.strip() for s in args.drafts.split(";"))):
        spec, _, k = item.rpartition("@") if "@" in item else (item, "", "auto")
        items.append((item, spec, k))
    return items


def build_methods(args, pipe) -> list[harness.Method]:
    """Plain decoding and one engine method per ``spec@k`` (one policy each for the whole run)."""
    methods = [harness.engine_method("plain", pipe.runtime, None, None, eos_ids=pipe.eos_ids)]
    for item, spec, k in draft_items(args):
        drafter = api.make_drafter(spec, pipe.target, pipe.runtime, args.draft_dtype)
        methods.append(
            harness.engine_method(item, pipe.runtime, drafter, make_policy(k), eos_ids=pipe.eos_ids)
        )
    return methods


def run(args, pipe, methods, prompts):
    """Every method on every prompt; totals per (method, category) and acceptance per method/category."""
    totals = defaultdict(harness.Totals)
    stats: dict[str, dict[str, SpecStats]] = defaultdict(lambda: defaultdict(SpecStats))
    tol = harness.tolerance(pipe.runtime)
    budget = harness.prompt_budget(pipe.runtime, methods, args.max_new_tokens, args.max_prompt_tokens)
    harness.warm_up(methods, pipe.encode("Say hello."), args.max_new_tokens)
    for i, prompt in enumerate(prompts):
        ids = fit_context(pipe.encode(prompt.turns[0]), budget).ids
        runs = harness.run_prompt(methods, ids, i, args.max_new_tokens)
        plain = runs["plain"].tokens
        for name, r in runs.items():
            check = (pipe.runtime, ids, plain, r.tokens, args.max_new_tokens, pipe.eos_ids, tol)
            cls = None if name == "plain" else harness.equality(*check)[0]
            for key in (prompt.category, "all"):
                totals[name, key].add(r, cls)
                if r.stats is not None:
                    stats[name][key].merge(r.stats)
        line = "  ".join(f"{m.name} {totals[m.name, 'all'].tokens_per_s:.1f}" for m in methods)
        print(f"[{i + 1}/{len(prompts)}] {prompt.category:<15} {line} tok/s", flush=True)
    return totals, stats


def summary(methods, totals, stats, categories) -> dict:
    """Per drafter and category: tok/s, speedup over plain, tokens per forward, outputs that differ,
    acceptance per position and the draft's time per target forward."""
    out = {}
    for m in methods[1:]:
        rows = {}
        for c in [*categories, "all"]:
            t, p = totals[m.name, c], totals["plain", c]
            rows[c] = {
                "tokens_per_s": round(t.tokens_per_s, 2),
                "plain_tokens_per_s": round(p.tokens_per_s, 2),
                "speedup": round(t.tokens_per_s / p.tokens_per_s, 3),
                "decode_speedup": round(t.decode_tokens_per_s / p.decode_tokens_per_s, 3),
                "tokens_per_forward": round(stats[m.name][c].mean_accepted_length, 3),
                "first_acceptance": round(next(iter(stats[m.name][c].per_position_acceptance()), 0.0), 3),
                "mismatches": t.mismatches,
            } | _draft_costs(stats[m.name][c])
        out[m.name] = rows
    return out


def _draft_costs(s: SpecStats) -> dict:
    """Acceptance at each draft position, and draft and target milliseconds per target forward."""
    ms_per_forward = 1e3 / max(s.target_forwards, 1)  # seconds in total -> ms per target forward
    return {
        "acceptance_per_position": [round(a, 3) for a in s.per_position_acceptance()],
        "draft_ms_per_forward": round(s.draft_time * ms_per_forward, 3),
        "target_ms_per_forward": round(s.target_time * ms_per_forward, 3),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result)
    cats = list(next(iter(result.values())))
    fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4))
    width = 0.8 / max(len(names), 1)
    for j, n in enumerate(names):
        xs = [i + j * width for i in range(len(cats))]
        ax.bar(xs, [result[n][c]["speedup"] for c in cats], width, label=n)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=40, ha="right")
    ax.set_ylabel("tok/s over plain decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # a quantized target loads its transformers model only for a draft built from it (designed, tree:)
    needs_model = [
        s for _, s, _ in draft_items(args) if api.model_kind(s) not in api.RUNS_WITHOUT_TRANSFORMERS_MODEL
    ]
    # prune: drafts at a dense --draft-dtype run the target's layers in bf16: the target too
    dense = args.draft_dtype not in ("auto", "q")
    prune = dense and any(api.model_kind(s) == "prune" for _, s, _ in draft_items(args))
    pipe = api.load(
        args.target,
        needs_model[0] if needs_model else None,
        dtype=args.dtype,
        threads=args.threads,
        draft_dtype=args.draft_dtype,
        needs=("prune",) if prune else (),
    )
    methods = build_methods(args, pipe)
    prompts = load_prompts(args.prompts, parse_categories(args.categories), args.limit)
    cpu = cpu_name()
    source = args.prompts or "Spec-Bench"
    print(f"target {pipe.target.name} ({pipe.runtime}); {len(prompts)} {source} prompts (first turn)")
    print(f"{args.max_new_tokens} new tokens, threads {args.threads}, CPU {cpu}", flush=True)
    totals, stats = run(args, pipe, methods, prompts)
    categories = sorted({p.category for p in prompts})
    result = summary(methods, totals, stats, categories)
    print("\ndrafter                       speedup  tokens/forward  first acc.  worst category   mismatches")
    for name, rows in result.items():
        worst = min(categories, key=lambda c: rows[c]["speedup"])
        a = rows["all"]
        print(
            f"{name:<29} {a['speedup']:6.2f}x  {a['tokens_per_forward']:13.2f}  "
            f"{a['first_acceptance']:10.2f}  "
            f"{worst} {rows[worst]['speedup']:.2f}x  {a['mismatches']}"
        )
    print(f"plain decoding: {totals['plain', 'all'].tokens_per_s:.1f} tok/s")
    cmd = "python " + " ".join(sys.argv)
    print(f"reproduce: {cmd}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": cmd, "cpu": cpu, "runtime": str(pipe.runtime), "prompts": len(prompts)}
        doc |= {"max_new_tokens": args.max_new_tokens, "threads": args.threads, "drafters": result}
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 1 if any(r["all"]["mismatches"] for r in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
