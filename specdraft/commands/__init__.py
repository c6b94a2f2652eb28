"""Subcommands of the ``specdraft`` CLI; shared argument helpers live here."""

from __future__ import annotations

import argparse

from specdraft import dtypes, registry
from specdraft.errors import SpecdraftError
from specdraft.models.loading import DEFAULT_TARGET

# Argument types: argparse calls them while parsing, so a bad value is refused before anything
# loads; the CLI shows the ArgumentTypeError as one line (specdraft.cli).


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # what argparse names in its own messages
    return parse


positive_int = int_at_least(1)


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value}")
    return value


def k_spec(text: str) -> str:
    """An argparse type: a --k that :func:`specdraft.policy.make_policy` accepts, kept as given."""
    from specdraft.policy import make_policy

    try:
        make_policy(text)
    except SpecdraftError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def draft_spec(text: str) -> str:
    """An argparse type: a --draft that :class:`specdraft.registry.DraftSpec` parses, kept as given."""
    try:
        registry.DraftSpec.parse(text)
    except SpecdraftError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_model_arguments(p: argparse.ArgumentParser, draft: bool = True) -> None:
    """--target, --draft, --k, --dtype, --threads, --runtime: the options every command shares."""
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="model alias (smollm2-135m, gemma3-270m), HF directory or GGUF path",
    )
    if draft:
        p.add_argument("--draft", type=draft_spec, default="default", help=registry.usage())
        p.add_argument(
            "--k",
            type=k_spec,
            default="auto",
            help="draft length: 'auto' (cost-aware, the default: measures latency and acceptance and "
            "picks k, 0 included), an integer >= 0 or 'heuristic'",
        )
    p.add_argument(
        "--dtype", default="auto", choices=dtypes.choices("target"), help=dtypes.help_text("target")
    )
    p.add_argument(
        "--draft-dtype", default="auto", choices=dtypes.choices("draft"), help=dtypes.help_text("draft")
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    p.add_argument("--runtime", default="auto", choices=["auto", "compact", "hf"], help="model runtime")


def sampling_from_args(args):
    from specdraft.verify import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def load_pipeline(args: argparse.Namespace, needs: tuple[str, ...] = ()):
    """``api.load`` with the arguments :func:`add_model_arguments` defined (``needs``: what the run
    needs besides the runtime, as :func:`specdraft.api.load` takes it)."""
    from specdraft import api

    return api.load(
        args.target,
        args.draft,
        dtype=args.dtype,
        runtime=args.runtime,
        threads=args.threads,
        draft_dtype=args.draft_dtype,
        needs=needs,
    )
