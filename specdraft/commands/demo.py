"""``specdraft demo``: the main job on the embedded default model (a first look, in a minute or two)."""

from __future__ import annotations

import argparse
import time

from specdraft.commands import add_model_arguments

HELP = "run the main job on the embedded default model"

PROMPTS = [
    "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden.",
    "List three facts about the planet Mars.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=64)


def run(args: argparse.Namespace) -> int:
    from specdraft import api

    pipe = api.load(args.target, args.draft, dtype=args.dtype, runtime=args.runtime, threads=args.threads)
    print(f"target {pipe.target.source}; draft {pipe.draft_spec}; runtime {pipe.runtime}")
    for prompt in PROMPTS:
        plain = pipe.engine(0)
        t = time.perf_counter()
        ref = pipe.generate(prompt, max_new_tokens=args.max_new_tokens, engine=plain)
        t_plain = time.perf_counter() - t
        spec = pipe.engine(args.k)
        t = time.perf_counter()
        res = pipe.generate(prompt, max_new_tokens=args.max_new_tokens, engine=spec)
        t_spec = time.perf_counter() - t
        same = "identical to plain decoding" if res.tokens == ref.tokens else "DIFFERS from plain decoding"
        print(f"\n> {prompt}\n{res.text.strip()}\n")
        print(res.stats.summary())
        print(f"plain {len(ref.tokens) / t_plain:.1f} tok/s, speculative {len(res.tokens) / t_spec:.1f} tok/s "
              f"({t_plain / t_spec:.2f}x); output {same}")
    return 0
