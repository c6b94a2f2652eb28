"""Writes that survive a kill: fsync, atomic file replacement and atomic directory replacement.

A file is written beside its destination under a temporary name, fsynced and renamed over it
(``os.replace`` is atomic on POSIX), then the folder is fsynced so the new name is on disk too.
A reader sees the old file or the new one, never a mix or a half.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temporary file, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
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
