"""Building and loading the native kernels: the C compiler, the on-disk cache and its checks.

A C file beside this module is compiled once per source version (:func:`source_hash`: the file's
bytes and :data:`CFLAGS`) into the user cache (``~/.cache/specdraft/kernels``, or
``$SPECDRAFT_CACHE/kernels``). The library exports :data:`HASH_SYMBOL`, and the sha256 of its
bytes is written beside it; :func:`open_library` checks both and compiles again when either is
wrong. The ctypes wrappers over the loaded library are in :mod:`specdraft.kernels`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("specdraft")

CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]
HASH_SYMBOL = "specdraft_source_hash"  # every library built here exports it: const char *(void)


def cache_dir() -> Path:
    from specdraft.models.loading import cache_root  # at call time: loading imports transformers

    return cache_root() / "kernels"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_can_build() -> bool:
    """Whether the CPU runs what :data:`CFLAGS` targets (AVX2 and FMA)."""
    flags = cpu_flags()
    return "avx2" in flags and "fma" in flags


def source_hash(source: Path) -> str:
    """The version of ``source`` a library is built from: sha256 of the C file and the flags."""
    return hashlib.sha256(source.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]


def digest_file(path: Path) -> Path:
    """Where the sha256 of a built library's bytes is kept, beside it."""
    return path.with_name(path.name + ".sha256")


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def intact(path: Path) -> bool:
    """Whether ``path`` has the bytes recorded when it was built. Checked before dlopen, which
    maps a truncated library's missing pages and dies of SIGBUS touching them."""
    try:
        return digest_file(path).read_text().strip() == file_sha256(path)
    except OSError:
        return False


def build_library(source: Path, rebuild: bool = False) -> Path:
    """Compile ``source`` (a C file beside this module) into the cache once per version; its path.
    The library exports :data:`HASH_SYMBOL`, returning :func:`source_hash`, which
    :func:`open_library` checks; the sha256 of its bytes is written beside it (``.so.sha256``).
    ``rebuild``: compile again even if the file is there."""
    tag = source_hash(source)
    out = cache_dir() / f"{source.stem}-{tag}.so"
    if out.exists() and not rebuild:
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    # compile aside, then rename
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as d:
        stamp = Path(d) / "source_hash.c"
        stamp.write_text(f'const char *{HASH_SYMBOL}(void) {{ return "{tag}"; }}\n')
        tmp = Path(d) / out.name
        r = subprocess.run(
            [cc, *CFLAGS, str(source), str(stamp), "-o", str(tmp), "-lm"],
            check=False,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode
            raise RuntimeError(f"{cc} failed: {last}")
        digest = Path(d) / "digest"
        digest.write_text(file_sha256(tmp) + "\n")
        os.replace(digest, digest_file(out))  # a kill between the two renames: a mismatch, rebuilt
        os.replace(tmp, out)
    return out


def _open_checked(path: Path, tag: str, setup: Callable[[ctypes.CDLL], None] | None) -> ctypes.CDLL:
    """dlopen ``path``, check its :data:`HASH_SYMBOL` against ``tag``, run ``setup(lib)`` (which
    sets argument types: a missing symbol is an AttributeError there)."""
    lib = ctypes.CDLL(str(path))
    stamp = getattr(lib, HASH_SYMBOL)  # AttributeError: built before the hash was recorded
    stamp.restype, stamp.argtypes = ctypes.c_char_p, []
    got = stamp().decode()
    if got != tag:
        raise OSError(f"built from source {got}, not {tag}")
    if setup is not None:
        setup(lib)
    return lib


def open_library(source: Path, setup: Callable[[ctypes.CDLL], None] | None = None) -> ctypes.CDLL:
    """Build ``source`` if needed and load it. A cached library whose bytes are not those built
    (checked before dlopen), that fails to load, lacks a symbol or records another source hash
    (a damaged or foreign file under the right name) is compiled again, with a warning, and
    loaded under a private name (dlopen would hand back a library already loaded from the path).

    Raises:
        OSError, RuntimeError, AttributeError, subprocess.SubprocessError: no usable library,
            even after compiling it again.
    """
    tag = source_hash(source)
    path = build_library(source)
    try:
        if not digest_file(path).is_file():
            raise OSError("no sha256 recorded beside it: an older build")
        if not intact(path):
            raise OSError("its bytes do not match the sha256 recorded when it was built")
        return _open_checked(path, tag, setup)
    except (OSError, AttributeError) as e:
        log.warning("specdraft: the cached kernel library %s is unusable (%s); compiling it again", path, e)
    path = build_library(source, rebuild=True)
    private = path.with_name(f".{path.stem}-{os.getpid()}-{id(path):x}.so")
    os.link(path, private)
    try:
        return _open_checked(private, tag, setup)
    finally:
        private.unlink()  # the mapping stays
