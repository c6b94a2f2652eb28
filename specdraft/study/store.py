"""Study results: one JSON object per line, keyed by a hash of the configuration and code version.

A sweep appends a row as soon as it is computed and fsyncs it, so a killed sweep loses at most the
row being written. On restart :class:`ResultStore` reads the rows already there, drops a truncated
last line (the one a kill can leave; a whole row that only lacks its newline is kept) and the sweep
skips every key it finds: no row is computed twice and none is lost. A malformed line anywhere
else is an error naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import specdraft
from specdraft.errors import SpecdraftError

# Files whose contents decide the numbers in a row: editing them changes the code version, so
# rows computed by older code are recomputed instead of being mixed with new ones.
_VERSIONED = (
    "analytic.py",
    "engine.py",
    "verify.py",
    "drafters/model.py",
    "drafters/prompt_lookup.py",
    "models/llama.py",
    "study/offline.py",
    "study/latency.py",
    "study/sweep.py",
)


def code_version() -> str:
    """``<package version>+<hash of the files that compute rows>``, e.g. ``0.1.0+3f2a9c1b7e``."""
    root = Path(specdraft.__file__).parent
    h = hashlib.sha256()
    for rel in _VERSIONED:
        path = root / rel
        h.update(rel.encode())
        if path.is_file():
            h.update(path.read_bytes())
    return f"{specdraft.__version__}+{h.hexdigest()[:10]}"


def row_key(config: dict, version: str) -> str:
    """A stable key: sha256 of the canonical JSON of the configuration and the code version."""
    text = json.dumps({"config": config, "code_version": version}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_rows(path: Path, *, tolerate_truncated_tail: bool = False) -> list[dict]:
    """Every row of a JSONL results file.

    Args:
        path: the file.
        tolerate_truncated_tail: ignore a last line that is cut short (no trailing newline and not
            valid JSON), as a killed writer leaves it.

    Raises:
        SpecdraftError: a missing file or a malformed line (naming the file and the line).
    """
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"results file not found: {path}")
    data = path.read_bytes()
    lines = data.split(b"\n")
    rows = []
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            last = lineno == len(lines) and not data.endswith(b"\n")
            if last and tolerate_truncated_tail:
                break
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise SpecdraftError(f"{path}:{lineno}: malformed JSON line ({msg})") from None
        if not isinstance(row, dict):
            raise SpecdraftError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def repair_tail(path: Path) -> None:
    """Make a JSONL file that a killed writer left end on a newline, fsynced.

    A last line without its newline is either a whole row (the kill came between the row and its
    newline, or another tool wrote it so): it is kept and the newline added, as :func:`read_rows`
    counts it; or a half-written row: it is cut.
    """
    path = Path(path)
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    try:
        whole = isinstance(json.loads(data[start:]), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        whole = False
    with path.open("r+b") as f:
        if whole:
            f.seek(len(data))
            f.write(b"\n")
        else:
            f.truncate(start)
        f.flush()
        os.fsync(f.fileno())


class ResultStore:
    """An append-only JSONL file of rows with unique ``key`` fields.

    Args:
        path: the results file (created with its folder if missing).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        if self.path.exists():
            self.rows = read_rows(self.path, tolerate_truncated_tail=True)
            self._cut_partial_tail()
        self.keys = {r["key"] for r in self.rows if "key" in r}

    def _cut_partial_tail(self) -> None:
        """Make the file end on a newline so appends start on a new line (see :func:`repair_tail`)."""
        repair_tail(self.path)

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def append(self, row: dict) -> bool:
        """Write one row (fsynced); returns False, writing nothing, when its key is already there."""
        key = row["key"]
        if key in self.keys:
            return False
        line = json.dumps(row, sort_keys=True, separators=(",", ":")) + "\n"
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.keys.add(key)
        self.rows.append(row)
        return True

    def extend(self, rows: Iterable[dict]) -> int:
        """Append several rows; returns how many were new."""
        return sum(self.append(r) for r in rows)

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.rows if r.get("kind") == kind]
