"""``specdraft attack``: craft prompts that collapse a drafter's acceptance (issue 17)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from specdraft.commands import add_model_arguments, int_at_least, load_pipeline, positive_int

HELP = "craft inputs that make the draft's proposals rejected while the target's answer stays the same"


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _unit(text: str) -> float:
    value = _non_negative(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be <= 1, got {value}")
    return value


METHOD_OPTIONS = {
    "continuous": ("steps", "lam", "eps", "time_budget", "window"),
    "discrete": ("steps", "lam", "suffix_len", "topk", "candidates", "seed"),
    "lookup": ("max_decoys", "min_rouge"),
}
"""The options each method reads: the command recorded in attack.json names them (it reproduces the run)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.set_defaults(k="5")
    p.add_argument("--method", required=True, choices=["continuous", "discrete", "lookup"])
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL prompt file, Spec-Bench or {'prompt': ...} lines (default: Spec-Bench); "
        "only each prompt's first turn is attacked",
    )
    p.add_argument("--limit", type=positive_int, default=None, help="attack the first N prompts of the file")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="generation budget per prompt")
    p.add_argument("--out", required=True, help="directory for attacked.jsonl and attack.json")
    p.add_argument(
        "--prefix-tokens",
        type=positive_int,
        default=32,
        help="identical-prefix check over the first N tokens",
    )
    p.add_argument(
        "--steps", type=positive_int, default=None, help="attack steps (continuous 30, discrete 20)"
    )
    p.add_argument("--lam", type=_non_negative, default=1.0, help="weight of the preservation term")
    p.add_argument(
        "--eps", type=_non_negative, default=0.5, help="continuous: per-token L2 bound (x mean |row|)"
    )
    p.add_argument(
        "--time-budget",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="continuous: stop the search before a step that would end past this (default: none)",
    )
    p.add_argument(
        "--window",
        type=int_at_least(0),
        default=128,
        metavar="N",
        help="continuous: perturb only the message's last N tokens, the text before them run once "
        "(0: the whole message)",
    )
    p.add_argument("--suffix-len", type=positive_int, default=8, help="discrete: suffix tokens")
    p.add_argument("--topk", type=positive_int, default=32, help="discrete: swap tokens per position")
    p.add_argument("--candidates", type=positive_int, default=32, help="discrete: swaps evaluated per step")
    p.add_argument("--max-decoys", type=positive_int, default=8, help="lookup: decoy phrases at most")
    p.add_argument(
        "--min-rouge",
        type=_unit,
        default=0.5,
        help="lookup: keep a decoy only if the answer keeps this ROUGE-L to the clean one",
    )
    p.add_argument("--seed", type=int, default=0, help="discrete: seeds the sampling of swaps")
    p.add_argument("--no-progress", action="store_true", help="no line per prompt on stderr")


def run(args: argparse.Namespace) -> int:
    from specdraft.attack.continuous import ContinuousConfig
    from specdraft.attack.discrete import DiscreteConfig
    from specdraft.attack.run import AttackOptions, run_attack
    from specdraft.bench.profile import cpu_name
    from specdraft.bench.prompts import default_prompts_path, read_prompts
    from specdraft.errors import SpecdraftError

    if not str(args.k).isdigit() or int(args.k) < 1:
        raise SpecdraftError(
            f"--k {args.k}: the attack measures an undefended fixed k >= 1 (the defense runs --k auto itself)"
        )
    continuous = ContinuousConfig(
        steps=args.steps or 30,
        eps=args.eps,
        lam=args.lam,
        seconds=args.time_budget,
        window=args.window or None,
    )
    discrete = DiscreteConfig(
        steps=args.steps or 20, topk=args.topk, candidates=args.candidates, lam=args.lam, seed=args.seed
    )
    options = AttackOptions(
        method=args.method,
        k=int(args.k),
        max_new_tokens=args.max_new_tokens,
        prefix_tokens=args.prefix_tokens,
        continuous=continuous,
        discrete=discrete,
        suffix_len=args.suffix_len,
        max_decoys=args.max_decoys,
        min_rouge=args.min_rouge,
        progress=not args.no_progress,
    )
    prompts = read_prompts(args.prompts or default_prompts_path())[: args.limit]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SpecdraftError(f"--out {out} exists and is not a directory")
    pipe = load_pipeline(args, needs=("attack",))
    result = run_attack(pipe, prompts, options)
    argv = ["specdraft", "attack", "--target", args.target, "--draft", args.draft, "--k", str(args.k)]
    argv += ["--method", args.method, "--max-new-tokens", str(args.max_new_tokens), "--out", str(out)]
    for flag, value in (("--prompts", args.prompts), ("--limit", args.limit), ("--threads", args.threads)):
        if value is not None:
            argv += [flag, str(value)]
    for name in METHOD_OPTIONS[args.method]:
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.dtype != "auto":
        argv += ["--dtype", args.dtype]
    result.result["config"] |= {
        "command": shlex.join(argv),
        "target": args.target,
        "draft": args.draft,
        "cpu": cpu_name(),
        "threads": args.threads,
    }
    out.mkdir(parents=True, exist_ok=True)
    with (out / "attacked.jsonl").open("w", encoding="utf-8") as f:
        for row in result.rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "attack.json").write_text(json.dumps(result.result, indent=1) + "\n", encoding="utf-8")
    o = result.result["overall"]
    print(
        f"mean accepted {o['clean_mean_accepted']} -> {o['attacked_mean_accepted']}, identical prefix "
        f"{o['identical_prefix_rate']}, ROUGE-L {o['rouge_l']}; wrote {out}/attacked.jsonl, {out}/attack.json"
    )
    return 0
