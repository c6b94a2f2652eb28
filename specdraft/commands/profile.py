"""``specdraft profile``: T_target(b, n), T_draft(b) and the draft-step time breakdown."""

from __future__ import annotations

import argparse
import sys

from specdraft.commands import add_model_arguments, load_pipeline
from specdraft.errors import SpecdraftError

HELP = "measure target/draft forward latencies (T_target(b, n), T_draft(b)) and a draft-step breakdown"


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` or ``"1-9"`` (or a mix, ``"1-4,8"``) -> sorted unique ints."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.update(range(int(lo), int(hi) + 1))
            elif part:
                out.add(int(part))
    except ValueError:
        raise SpecdraftError(f"expected integers like 1,2,4 or 1-9, got {text!r}") from None
    if not out:
        raise SpecdraftError(f"expected integers like 1,2,4 or 1-9, got {text!r}")
    return sorted(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--batch", default="1", help="batch sizes, e.g. 1,2,4,8")
    p.add_argument("--new-tokens", default="1-9", help="new tokens per target forward (k + 1), e.g. 1-9")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--repeats", type=int, default=9, help="timed rounds (medians over them)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--no-breakdown", action="store_true", help="skip the draft-step breakdown")
    p.add_argument("--json", default=None, metavar="OUT", help="write the profile as JSON to OUT")


def run(args: argparse.Namespace) -> int:
    from specdraft.bench.profile import profile_pipeline

    batch, new_tokens = int_list(args.batch), int_list(args.new_tokens)
    pipe = load_pipeline(args)
    prof = profile_pipeline(
        pipe,
        batch_sizes=batch,
        new_tokens=new_tokens,
        context=args.context,
        repeats=args.repeats,
        warmup=args.warmup,
        breakdown=not args.no_breakdown,
    )
    print(prof.table())
    if args.json:
        prof.save(args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
