"""``specdraft check``: is greedy speculative decoding lossless for these prompts?

For each prompt: plain greedy decoding (k = 0) with its top-2 logit margins, then the speculative
run, classified by :func:`specdraft.lossless.classify` as identical / tie-divergent / divergent.
Exit status 1 if any prompt is divergent. ``--drift`` also measures how far logits move between
single-token and (k + 1)-token forwards (:func:`specdraft.lossless.logit_drift`), the measurement
behind the default bf16 tolerance.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdraft.commands import add_model_arguments, load_pipeline, positive_int
from specdraft.errors import SpecdraftError

HELP = "check that greedy speculative output equals plain greedy output (bf16: up to near-ties)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompts",
        help="prompt file: JSONL (Spec-Bench 'turns' or 'prompt'; first turn used) or one prompt per line",
    )
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts of the file")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="near-tie margin (default: 0 in fp32, lossless.DEFAULT_TOLERANCE otherwise)",
    )
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--drift",
        action="store_true",
        help="also measure the logit drift of (k + 1)-token vs 1-token forwards",
    )


def read_prompt_file(path: str, limit: int | None = None) -> list[str]:
    """Prompts from a JSONL file (first turn of each line) or a text file (one per non-empty line)."""
    f = Path(path)
    if not f.is_file():
        raise SpecdraftError(f"prompt file not found: {path}")
    if f.suffix == ".jsonl":
        from specdraft.bench.prompts import read_prompts

        prompts = [p.turns[0] for p in read_prompts(f)]
    else:
        prompts = [line.strip() for line in f.read_text().splitlines() if line.strip()]
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise SpecdraftError(f"no prompts in {path}")
    return prompts


def run(args: argparse.Namespace) -> int:
    from specdraft import lossless
    from specdraft.engine import Request, decode_requests

    prompts = read_prompt_file(args.prompts, args.limit) if args.prompts else args.prompt
    if any(not p.strip() for p in prompts):
        raise SpecdraftError("empty prompt")
    pipe = load_pipeline(args)
    if pipe.drafter is None:
        raise SpecdraftError("--draft none has nothing to check: give a drafter")
    tol = args.tol if args.tol is not None else lossless.default_tolerance(pipe.runtime.dtype)
    print(
        f"target {pipe.target.source}; draft {pipe.draft_spec}; k {args.k}; {pipe.runtime}; tolerance {tol}"
    )

    counts = {c: 0 for c in (lossless.IDENTICAL, lossless.TIE_DIVERGENT, lossless.DIVERGENT)}
    drift_abs = drift_shift = None
    for i, prompt in enumerate(prompts):
        ids = pipe.encode(prompt, chat=False if args.no_chat else None)
        plain, margins = lossless.plain_greedy_margins(pipe.runtime, ids, args.max_new_tokens, pipe.eos_ids)
        engine = pipe.engine(args.k)
        [spec] = decode_requests(engine, [Request(ids, args.max_new_tokens, eos_ids=pipe.eos_ids)])
        verdict = lossless.classify(spec, plain, margins, tol)
        counts[verdict] += 1
        line = (
            f"[{i}] {verdict:<13} {len(spec):>4} tokens, mean accepted length "
            f"{engine.stats.mean_accepted_length:.2f}"
        )
        at = lossless.first_difference(spec, plain)
        if at is not None:
            margin = f"{margins[at]:.4g}" if at < len(margins) else "n/a (one run stopped)"
            line += f"; first difference at token {at}, plain margin {margin}"
        if args.drift:
            k = max(engine.stats.k_history or [1])
            d = lossless.logit_drift(pipe.runtime, ids, plain, max(k, 1))
            drift_abs = max(d.max_abs, drift_abs or 0.0)
            drift_shift = max(d.max_margin_shift, drift_shift or 0.0)
            line += (
                f"; drift(k={d.k}) max |dlogit| {d.max_abs:.4g}, max margin shift "
                f"{d.max_margin_shift:.4g}, argmax flips {d.argmax_flips}"
            )
        print(line + f"  | {prompt[:50]!r}", flush=True)

    summary = ", ".join(f"{n} {c}" for c, n in counts.items())
    print(f"summary: {len(prompts)} prompts: {summary} (tolerance {tol})")
    if drift_abs is not None:
        print(f"largest drift: max |dlogit| {drift_abs:.4g}, max margin shift {drift_shift:.4g}")
    return 1 if counts[lossless.DIVERGENT] else 0
