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
from specdraft.durable import read_rows, repair_tail

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
        """End the file on a newline so appends start a new line (:func:`specdraft.durable.repair_tail`)."""
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
