"""``specdraft report``: REPORT.md with PNG plots from study results, bench JSON and latency profiles."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "write REPORT.md with plots from study results (JSONL), bench, profile and attack JSON files"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "results",
        nargs="+",
        help="study results.jsonl, `specdraft bench --json` files, profile JSON files, attack.json files",
    )
    p.add_argument("--out", default=None, help="output directory (default: the first input's directory)")


def run(args: argparse.Namespace) -> int:
    from specdraft.study.report import write_report

    inputs = [Path(r) for r in args.results]
    out = Path(args.out) if args.out else inputs[0].parent
    path = write_report(inputs, out)
    print(f"report: {path}")
    return 0
