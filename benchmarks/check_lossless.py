r"""Every drafter against plain greedy decoding on the whole Spec-Bench set (issue 15): 0 divergences?

The target's plain greedy answer to every turn of every question is computed once and stored; then
each drafter decodes the same prompts speculatively (greedy, batch 1, ``--k auto``) and its output
ids are compared with the plain ones (:mod:`specdraft.lossless`, "The whole Spec-Bench set").
Resumable: run the same command again after a kill and it continues at the next unchecked
(drafter, question); a drafter added to ``--drafters`` later is checked against the stored answers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/check_lossless.py --threads 1 \
        --out results/lossless-fullset-2026-12-02

writes ``reference.jsonl`` (plain answers), ``checks.jsonl`` (a line per drafter and question),
``report.json`` and ``report.md`` (per drafter: identical / tie-divergent / divergent, the first
differing token of each non-identical question) under ``--out``. Exit status 1 if any question is
divergent.
"""

from __future__ import annotations

import argparse
import sys
from functools import cache
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api, lossless, registry
from specdraft.bench.prompts import load_prompts, parse_categories
from specdraft.errors import SpecdraftError
from specdraft.models.loading import load_model

# every drafter that runs on the default quantized target with a committed draft, cheapest first
DRAFTERS = (
    "bigram",
    "suffix",
    "lookup-tree",
    "ouroboros:lookup",
    "designed:smollm2-135m-l2",
    "ouroboros",
    "tree:dyn,designed:smollm2-135m-l2",
    "self",
    "lookup",
    "designed:smollm2-135m-feature",
    "tree:dyn,designed:smollm2-135m-feature",
    "prune:0,1,2,29",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="the target's precision (auto: quantized for a GGUF)")
    p.add_argument("--draft-dtype", default="auto")
    p.add_argument(
        "--drafters", default=";".join(DRAFTERS), help="draft specs, ';'-separated, checked in order"
    )
    p.add_argument("--k", default="auto", help="draft length policy of every drafter")
    p.add_argument("--prompts", default=None, help="JSONL prompt file (default: Spec-Bench)")
    p.add_argument("--categories", default=None)
    p.add_argument("--limit", type=int, default=None, help="at most N questions per category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True, help="results directory (resumed when it exists)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def builders(pipe: api.Pipeline, specs: list[str], draft_dtype: str) -> list[tuple[str, object]]:
    """``(spec, build)`` per draft spec; a drafter that needs the target's transformers model gets it
    (loaded once, on first use). ``draft_dtype`` is resolved per drafter, as ``specdraft bench`` does
    (``auto``: GGUF blocks for a pruned view or a token-level designed draft beside a quantized target)."""

    @cache
    def with_model():
        return pipe.target if pipe.target.model is not None else load_model(pipe.target.name, torch.float32)

    def build(spec: str):
        needs_model = registry.DraftSpec.parse(spec).kind not in api.RUNS_WITHOUT_TRANSFORMERS_MODEL
        return api.make_drafter(spec, with_model() if needs_model else pipe.target, pipe.runtime, draft_dtype)

    return [(str(registry.DraftSpec.parse(s)), lambda s=s: build(s)) for s in specs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        specs = [s.strip() for s in args.drafters.split(";") if s.strip()]
        for s in specs:
            registry.DraftSpec.parse(s)  # a bad spec fails before the target loads
        options = lossless.FullsetOptions(args.k, args.max_new_tokens, progress=not args.no_progress)
        prompts = load_prompts(args.prompts, parse_categories(args.categories), args.limit)
        pipe = api.load(args.target, "none", dtype=args.dtype, threads=args.threads)
        print(f"target {pipe.target.name} ({pipe.runtime}); {len(prompts)} questions; drafters {specs}")
        report = lossless.run_fullset(
            pipe, builders(pipe, specs, args.draft_dtype), prompts, args.out, options
        )
    except SpecdraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(lossless.report_markdown(report), end="")
    print(f"wrote {args.out / lossless.REPORT_JSON} and {args.out / lossless.REPORT_MD}")
    return 1 if any(d["divergent"] for d in report["drafters"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
