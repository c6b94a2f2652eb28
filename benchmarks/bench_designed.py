r"""The designed default draft against plain decoding, the best untrained layer-pruned draft and
transformers' plain ``generate``: Spec-Bench prompts, batch 1, greedy, all in one process.

After an untimed warm-up of every method (which also lets the gated designed draft measure its
cost model once), for each prompt every method runs once, in a rotating order (A B C D, then B C D
A, ...: :mod:`specdraft.bench.harness`), so slow phases of a shared machine hit all methods alike;
tokens/s is total new tokens / total wall time (prefill included, as a user waits for it), and
decode tokens/s leaves the engine's prefill out of the wall time for the engine's methods. Every
output is checked against plain decoding (greedy is lossless; :func:`specdraft.bench.harness.equality`
classifies a difference) and ``mismatches`` counts those that differ.
Acceptance (mean accepted length with the bonus token, acceptance rate) is reported per Spec-Bench
category.

    .venv/bin/python benchmarks/bench_designed.py --limit 2 --max-new-tokens 64 \
        --json runs/bench_designed.json

Spec-Bench is evaluation-only here; nothing is trained on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench import harness
from specdraft.bench.hf_baselines import HFBaselines
from specdraft.bench.prompts import fit_context, load_prompts, parse_categories
from specdraft.policy import make_policy
from specdraft.stats import SpecStats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="default", help="the designed draft (default: the project default)")
    p.add_argument(
        "--pruned",
        default="prune:0",
        help="the untrained layer-pruned baseline (the best one from `specdraft design search`)",
    )
    p.add_argument("--k", default="4", help="draft length of the designed draft")
    p.add_argument("--k-pruned", default="1", help="draft length of the pruned baseline")
    p.add_argument("--limit", type=int, default=2, help="prompts per Spec-Bench category")
    p.add_argument("--categories", default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=768,
        help="longer prompts are cut in the middle (same for all methods)",
    )
    p.add_argument("--dtype", default="auto", help="the target's precision")
    p.add_argument(
        "--draft-dtype",
        default="auto",
        help="every draft's precision (auto: bf16 where native or run by the native kernels, else int8)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' plain generate")
    p.add_argument(
        "--also", default="", help="more drafts to run alongside, comma-separated 'spec@k' (e.g. lookup@4)"
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    pipe = api.load(
        args.target, args.draft, dtype=args.dtype, threads=args.threads, draft_dtype=args.draft_dtype
    )
    draft_dtype = api.resolve_dtype(args.draft_dtype, draft=True)
    pruned = api.make_drafter(args.pruned, pipe.target, pipe.runtime, draft_dtype)
    prompts = load_prompts(None, parse_categories(args.categories), args.limit)
    print(
        f"target {pipe.target.name} ({pipe.runtime}); designed {pipe.drafter.name} k={args.k}; "
        f"pruned {args.pruned} k={args.k_pruned}; {len(prompts)} Spec-Bench prompts (first turn), "
        f"{args.max_new_tokens} new tokens, threads {args.threads}",
        flush=True,
    )

    def engine_method(name, drafter, k):
        # one policy per method for the whole run, as `specdraft bench` keeps one
        policy = make_policy(k) if drafter is not None else None
        return harness.engine_method(name, pipe.runtime, drafter, policy, eos_ids=pipe.eos_ids)

    methods = [
        engine_method("plain", None, "0"),
        engine_method("designed", pipe.drafter, args.k),
        engine_method("pruned", pruned, args.k_pruned),
    ]
    for item in filter(None, args.also.split(",")):
        spec, _, k = item.partition("@")
        drafter = api.make_drafter(spec, pipe.target, pipe.runtime, draft_dtype)
        methods.append(engine_method(spec, drafter, k or args.k))
    if not args.no_hf:
        hf = HFBaselines(pipe.target.model, pipe.eos_ids, None, None, "", methods=("hf_plain",))
        methods.append(harness.baseline_method("hf_plain", partial(hf.run, "hf_plain")))
    names = [m.name for m in methods]
    totals = {n: harness.Totals() for n in names}
    per_cat: dict[str, dict[str, SpecStats]] = defaultdict(lambda: defaultdict(SpecStats))
    tol = harness.tolerance(pipe.runtime)
    budget = harness.prompt_budget(pipe.runtime, methods, args.max_new_tokens, args.max_prompt_tokens)
    # warm-up, untimed: first calls, and the gated draft's one-time cost measurement
    harness.warm_up(methods, pipe.encode("Say hello."), args.max_new_tokens)
    for i, prompt in enumerate(prompts):
        ids = fit_context(pipe.encode(prompt.turns[0]), budget).ids
        runs = harness.run_prompt(methods, ids, i, args.max_new_tokens)
        plain = runs["plain"].tokens
        for name, run in runs.items():
            cls = None
            if name != "plain":
                check = (pipe.runtime, ids, plain, run.tokens, args.max_new_tokens, pipe.eos_ids, tol)
                cls = harness.equality(*check)[0]
            totals[name].add(run, cls)
            if run.stats is not None:
                per_cat[name][prompt.category].merge(run.stats)
        rate = {n: totals[n].tokens_per_s for n in names}
        rates = "  ".join(f"{n} {rate[n]:.1f}" for n in names)
        print(f"[{i + 1}/{len(prompts)}] {prompt.category:<15} {rates} tok/s", flush=True)

    tps = {n: totals[n].tokens_per_s for n in names}
    dec = {m.name: totals[m.name].decode_tokens_per_s for m in methods if m.new_engine is not None}
    mismatches = {n: t.mismatches for n, t in totals.items() if t.mismatches}
    ratios = {
        "designed_vs_plain": tps["designed"] / tps["plain"],
        "designed_vs_pruned": tps["designed"] / tps["pruned"],
        "pruned_vs_plain": tps["pruned"] / tps["plain"],
        "designed_vs_plain_decode": dec["designed"] / dec["plain"],
        "designed_vs_pruned_decode": dec["designed"] / dec["pruned"],
    }
    if "hf_plain" in tps:
        ratios["designed_vs_hf_plain"] = tps["designed"] / tps["hf_plain"]
    categories = {}
    for name in [n for n in names if n not in ("plain", "hf_plain")]:
        categories[name] = {
            c: {
                "mean_accepted_length": round(s.mean_accepted_length, 3),
                "acceptance_rate": round(s.acceptance_rate, 3),
                "generated": s.generated,
            }
            for c, s in sorted(per_cat[name].items())
        }
        total = SpecStats()
        for s in per_cat[name].values():
            total.merge(s)
        categories[name]["all"] = {
            "mean_accepted_length": round(total.mean_accepted_length, 3),
            "acceptance_rate": round(total.acceptance_rate, 3),
            "generated": total.generated,
        }

    print("\nmethod      tok/s  decode tok/s  (prefill included in tok/s; same prompts, interleaved)")
    for n in names:
        print(f"{n:<10} {tps[n]:6.2f}  {dec.get(n, float('nan')):12.2f}")
    print("\nratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(
        "outputs differing from plain decoding: "
        + (", ".join(f"{k} {v}" for k, v in mismatches.items()) or "none")
    )
    print("\nacceptance per category (mean accepted length incl. bonus / acceptance rate):")
    for c in categories["designed"]:
        print(
            f"  {c:<15} "
            + "   ".join(
                f"{n} {categories[n][c]['mean_accepted_length']:.2f} / "
                f"{categories[n][c]['acceptance_rate']:.1%}"
                for n in categories
            )
        )
    cost = getattr(pipe.drafter, "cost", None)
    needed = None
    if cost is not None:
        print(
            "designed draft's measured cost model: T_target(n)/T_target(1) = "
            + ", ".join(f"{x:.2f}" for x in cost.target)
            + f"; T_draft/T_target(1) = {cost.draft:.3f}"
        )
        needed = acceptance_needed(
            cost, categories["designed"]["all"]["mean_accepted_length"], args.k, ratios
        )
        print(
            "per-token acceptance the designed draft would need for 2.0x plain decoding "
            "with this cost model: "
            + (
                f"{needed['alpha_for_2x']:.2f} (at k = {needed['k_for_2x']})"
                if needed["alpha_for_2x"] is not None
                else "unreachable"
            )
            + (
                f"; measured here: {needed['alpha_measured']:.2f}"
                if needed["alpha_measured"] is not None
                else ""
            )
        )
    cmd = "python " + " ".join(sys.argv)
    print(f"\nreproduce: {cmd}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "command": cmd,
                    "target": args.target,
                    "designed": pipe.drafter.name,
                    "pruned": args.pruned,
                    "k": args.k,
                    "k_pruned": args.k_pruned,
                    "prompts": len(prompts),
                    "max_new_tokens": args.max_new_tokens,
                    "threads": args.threads,
                    "tokens_per_s": tps,
                    "decode_tokens_per_s": dec,
                    "ratios": ratios,
                    "mismatches": mismatches,
                    "acceptance_per_category": categories,
                    "cost_model": None if cost is None else {"target": cost.target, "draft": cost.draft},
                    "acceptance_needed": needed,
                },
                indent=1,
            )
        )
    return 0


def acceptance_needed(cost, mean_accepted: float, k, ratios: dict) -> dict:
    """The per-token acceptance (analytic model, :mod:`specdraft.analytic`) that 2.0x plain needs
    with the measured cost model, and the one measured (from the mean accepted length at fixed k)."""
    from specdraft.analytic import alpha_from_mean_accepted, alpha_needed

    def t_target(n: int) -> float:
        return cost.target[min(n, len(cost.target)) - 1]

    need = alpha_needed(2.0, cost.draft, t_target, k_max=len(cost.target) - 1)
    fixed = str(k).isdigit() and int(k) > 0
    return {
        "alpha_for_2x": None if need is None else round(need[0], 3),
        "k_for_2x": None if need is None else need[1],
        "alpha_measured": round(alpha_from_mean_accepted(mean_accepted, int(k)), 3) if fixed else None,
    }


if __name__ == "__main__":
    sys.exit(main())
