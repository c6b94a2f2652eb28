"""The ``specdraft`` command: one table from subcommand to the module that implements it.

Each module in :mod:`specdraft.commands` defines ``add_arguments(parser)`` and ``run(args) -> int``
and a one-line ``HELP``. Errors a user can cause (:class:`SpecdraftError`, and arguments argparse
refuses, which are checked while parsing, before any model loads) print as one line on stderr with
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys

from specdraft.errors import SpecdraftError

COMMANDS = {
    "generate": "specdraft.commands.generate",
    "demo": "specdraft.commands.demo",
    "study": "specdraft.commands.study",
    "report": "specdraft.commands.report",
    "bench": "specdraft.commands.bench",
    "profile": "specdraft.commands.profile",
    "check": "specdraft.commands.check",
    "serve": "specdraft.commands.serve",
    "design": "specdraft.commands.design",
    "attack": "specdraft.commands.attack",
}


class BadArguments(Exception):
    """What :class:`Parser` raises instead of printing the usage and exiting."""

    def __init__(self, prog: str, message: str):
        super().__init__(f"{prog}: error: {message} (see '{prog} --help')")


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line: :func:`main` prints them and returns 2."""

    def error(self, message: str):
        raise BadArguments(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specdraft", description="Speculative decoding: run it, measure it, design drafts.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _build_parser_frozen() -> argparse.ArgumentParser:
    """:func:`build_parser` with the cyclic garbage collector off, and what it imported frozen out
    of its reach (``gc.freeze``). The command modules import torch: millions of objects that the
    collector would otherwise traverse again and again while they load and after
    (``specdraft generate --max-new-tokens 1``, measured under a load of 10 on 2 cores: 390
    collections taking 1.1-1.4 s, against 18 taking 0.03 s; issue 15). Only for the ``specdraft``
    command itself (``main()`` without arguments): a process that calls :func:`main` with its own
    arguments (tests) would keep whatever it holds then out of the collector's reach for good."""
    gc.disable()
    try:
        return build_parser()
    finally:
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers' "Loading weights" bar: stderr stays one line
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = _build_parser_frozen() if argv is None else build_parser()
    try:
        args = parser.parse_args(argv)
    except BadArguments as e:
        print(e, file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except SpecdraftError as e:
        print(f"specdraft {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specdraft {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
