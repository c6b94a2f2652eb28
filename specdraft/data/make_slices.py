"""Cut the small prompt slices shipped in ``specdraft/data`` from the full data files.

The full prompt sets are read-only inputs kept outside the project (``../shared/data`` beside the
repository, or ``$SPECDRAFT_DATA``); the project ships only these slices, so that a clone with
neither runs ``specdraft demo``, the default bench and the tests. Each slice is whole lines of its
upstream file, byte for byte, chosen by a fixed rule (:data:`SLICES`), so it is reproducible::

    python -m specdraft.data.make_slices            # from ../shared/data into specdraft/data
    python -m specdraft.data.make_slices DIR [OUT]  # from another copy of the full files

The full file's sha256 is checked first: a slice is only ever cut from the upstream file it names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from specdraft import durable
from specdraft.errors import SpecdraftError

HERE = Path(__file__).resolve().parent  # specdraft/data


@dataclass(frozen=True)
class Slice:
    """One shipped slice and the rule that cuts it from its upstream file.

    Attributes:
        path: relative path, the same in the full data folder and in ``specdraft/data``.
        name: what the note on stderr calls the set.
        unit: what one line is (``question``, ``prompt``, ``problem``).
        rule: ``first`` (the first ``keep`` lines), ``last`` (the last ``keep``) or
            ``per_category`` (the first ``keep`` of each ``category``, in file order).
        keep: lines kept (per category for ``per_category``).
        lines: lines in the slice.
        full_lines: lines in the upstream file.
        full_sha256: sha256 of the upstream file.
        why: why this rule and size (README).
    """

    path: str
    name: str
    unit: str
    rule: str
    keep: int
    lines: int
    full_lines: int
    full_sha256: str
    why: str


SLICES = (
    Slice(
        "spec_bench/question.jsonl",
        "Spec-Bench",
        "question",
        "per_category",
        4,
        52,
        480,
        "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04",
        "the questions that `--limit 4` (the runs in results/) and `specdraft demo` (`--limit 1`) read",
    ),
    Slice(
        "gsm8k/train.jsonl",
        "GSM8K train",
        "problem",
        "first",
        400,
        400,
        7473,
        "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
        "200 training prompts and the 200 that `specdraft design` holds out for validation "
        "(so a draft builds from up to 400 prompts, 200 per source)",
    ),
    Slice(
        "hellaswag_prompts.jsonl",
        "HellaSwag prompts",
        "prompt",
        "last",
        400,
        400,
        10003,
        "e2b759b55ac03b9d47f415880a9bfae2c80cea12f81753d480f95e743069263f",
        "as GSM8K; the last lines, because the study's workload and held-out prompts are the file's tail",
    ),
)
BY_PATH = {s.path: s for s in SLICES}


def cut(s: Slice, data: bytes) -> bytes:
    """The slice of the upstream file's bytes ``data`` (whole lines, in file order)."""
    lines = data.splitlines(keepends=True)
    if s.rule == "first":
        kept = lines[: s.keep]
    elif s.rule == "last":
        kept = lines[-s.keep :]
    elif s.rule == "per_category":
        seen: dict[str, int] = {}
        kept = []
        for line in lines:
            category = json.loads(line)["category"]
            seen[category] = seen.get(category, 0) + 1
            if seen[category] <= s.keep:
                kept.append(line)
    else:
        raise ValueError(f"unknown rule {s.rule!r}")
    return b"".join(kept)


def make_slices(source: Path, out: Path = HERE) -> list[Path]:
    """Write every slice of :data:`SLICES` under ``out``, cut from the full files under ``source``.

    Raises:
        SpecdraftError: a full file is missing or is not the upstream file (sha256).
    """
    written = []
    for s in SLICES:
        full = source / s.path
        if not full.is_file():
            raise SpecdraftError(f"full data file not found: {full}")
        data = full.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != s.full_sha256:
            raise SpecdraftError(f"{full}: sha256 {digest} is not the upstream file's {s.full_sha256}")
        piece = cut(s, data)
        if len(piece.splitlines()) != s.lines:
            raise SpecdraftError(f"{full}: the slice has {len(piece.splitlines())} lines, expected {s.lines}")
        dest = out / s.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp")
        tmp.write_bytes(piece)
        durable.replace_file(tmp, dest)
        written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    from specdraft.bench.prompts import SHARED_DATA

    p = argparse.ArgumentParser(
        prog="python -m specdraft.data.make_slices", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "source",
        nargs="?",
        default=str(SHARED_DATA),
        help="folder of the full data files (default ../shared/data)",
    )
    p.add_argument(
        "out", nargs="?", default=str(HERE), help="where to write the slices (default specdraft/data)"
    )
    args = p.parse_args(argv)
    try:
        for path in make_slices(Path(args.source), Path(args.out)):
            print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path}")
    except SpecdraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
