"""Subcommands of the ``specdraft`` CLI; shared argument helpers live here."""

from __future__ import annotations

import argparse

from specdraft.models.loading import DEFAULT_TARGET


def add_model_arguments(p: argparse.ArgumentParser, draft: bool = True) -> None:
    """--target, --draft, --k, --dtype, --threads, --runtime: the options every command shares."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="model alias (smollm2-135m, gemma3-270m), HF directory or GGUF path")
    if draft:
        p.add_argument("--draft", default="default", help="none | default | prune:0,1,2,29 | lookup[:N] | self | model alias/path")
        p.add_argument("--k", default="auto", help="draft length: 'auto' (cost-aware, the default: measures latency and acceptance and picks k, 0 included), an integer >= 0 or 'heuristic'")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="target precision; auto: bf16 where the CPU has native bf16, else fp32")
    p.add_argument("--draft-dtype", default="auto", choices=["auto", "bf16", "fp32", "int8"],
                   help="draft precision (never changes the output); auto: bf16 where native or run by the native kernels, else int8")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--runtime", default="auto", choices=["auto", "compact", "hf"], help="model runtime")


def sampling_from_args(args):
    from specdraft.verify import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
