"""``specdraft generate``: stream a completion with speculative decoding and print statistics."""

from __future__ import annotations

import argparse
import json
import sys

from specdraft.commands import (
    add_model_arguments,
    add_sampling_arguments,
    load_pipeline,
    positive_int,
    sampling_from_args,
)
from specdraft.errors import SpecdraftError

HELP = "generate text for a prompt with speculative decoding"

# accepted draft tokens get one colour per source (lookup, pool, model, a drafter's name), in the
# order the sources first appear; the target's own tokens stay plain
SOURCE_COLOURS = {"\033[32m": "green", "\033[36m": "cyan", "\033[33m": "yellow", "\033[35m": "magenta"}
RESET = "\033[0m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--color",
        action="store_true",
        help="colour tokens that came from the draft, one colour per source (lookup, pool, model...)",
    )
    p.add_argument("--json", action="store_true", help="print the result and statistics as JSON")


def run(args: argparse.Namespace) -> int:

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise SpecdraftError("empty prompt")
    params = sampling_from_args(args)
    pipe = load_pipeline(args)
    engine = pipe.engine(args.k)
    chat = False if args.no_chat else None
    text, tokens, palette = [], [], {}
    for d in pipe.stream(
        prompt, max_new_tokens=args.max_new_tokens, params=params, stop=args.stop, chat=chat, engine=engine
    ):
        text.append(d.text)
        tokens += d.tokens
        if args.json:
            continue
        if args.color and any(d.from_draft):
            sys.stdout.write(_coloured(pipe.tokenizer, d, palette))
        else:
            sys.stdout.write(d.text)
        sys.stdout.flush()
    if args.json:
        print(json.dumps({"text": "".join(text), "tokens": tokens, "stats": engine.stats.as_dict()}))
    else:
        print()
        if palette:
            legend = ", ".join(f"{src} {SOURCE_COLOURS[c]}" for src, c in palette.items())
            print(f"draft tokens by source: {legend}", file=sys.stderr)
        print(engine.stats.summary(), file=sys.stderr)
    return 0


def _coloured(tokenizer, delta, palette: dict[str, str]) -> str:
    """Colour the draft-accepted tokens of a step by their source (``palette``: source -> colour,
    grown as sources appear); falls back to plain text if pieces don't line up."""
    sources = delta.source or ["draft"] * len(delta.tokens)
    colours = list(SOURCE_COLOURS)
    for src, fd in zip(sources, delta.from_draft):
        if fd and src not in palette:
            palette[src] = colours[len(palette) % len(colours)]
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in delta.tokens]
    if "".join(pieces) != delta.text:
        return delta.text
    return "".join(
        f"{palette[src]}{s}{RESET}" if fd else s for s, fd, src in zip(pieces, delta.from_draft, sources)
    )
