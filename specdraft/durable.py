"""Writes that survive a kill: fsync, atomic file replacement and atomic directory replacement.

A file is written beside its destination under a temporary name, fsynced and renamed over it
(``os.replace`` is atomic on POSIX), then the folder is fsynced so the new name is on disk too.
A reader sees the old file or the new one, never a mix or a half. Append-only JSONL files are
read back with :func:`read_rows` and mended after a kill with :func:`repair_tail`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from specdraft.errors import SpecdraftError


def fsync(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temporary file, fsync, rename). The temporary
    name carries the process id: two processes writing the same file (two trainings sharing a data
    cache) each rename their own whole copy, the last one wins."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def replace_file(tmp: str | Path, path: str | Path) -> None:
    """Move the finished file ``tmp`` over ``path`` atomically (fsync, rename, fsync the folder)."""
    fsync(tmp)
    os.replace(tmp, path)
    fsync(Path(path).parent)


def replace_dir(new: str | Path, dest: str | Path) -> None:
    """Put the finished directory ``new`` at ``dest``, replacing what is there as a whole.

    Every file under ``new`` is fsynced first. POSIX cannot rename a directory over a non-empty one,
    so an existing ``dest`` is first renamed aside to ``.<name>.old`` and removed after ``new`` is in
    place: a kill leaves ``dest`` old or new and complete (or, between the two renames, absent, with
    both complete copies beside it).
    """
    new, dest = Path(new), Path(dest)
    for root, _, files in os.walk(new):
        for name in files:
            fsync(Path(root) / name)
        fsync(root)
    old = dest.with_name(f".{dest.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        os.replace(dest, old)
    os.replace(new, dest)
    fsync(dest.parent)
    if old.exists():
        shutil.rmtree(old)


def read_rows(path: Path, *, tolerate_truncated_tail: bool = False) -> list[dict]:
    """Every row of a JSONL file of objects (results, caches).

    Args:
        path: the file.
        tolerate_truncated_tail: ignore a last line that is cut short (no trailing newline and not
            valid JSON), as a killed writer leaves it.

    Raises:
        SpecdraftError: a missing file or a malformed line (naming the file and the line).
    """
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"file not found: {path}")
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
