"""Building and loading the native kernels (specdraft.kernels.build): a damaged or foreign library in
the cache is compiled again with a warning, and a library that cannot be had leaves torch's ops."""

import ctypes
import logging
import shutil
import subprocess

import pytest
import torch

from specdraft import kernels
from specdraft.kernels import build

needs_cc = pytest.mark.skipif(
    not kernels.available() or shutil.which("gcc") is None, reason=f"native kernel: {kernels.status()}"
)


def _compile(tmp_path, c_code: str, out) -> None:
    """A whole, loadable library at ``out`` with its digest beside it, as if built there: only
    loading it can tell it is not this source's kernels."""
    src = tmp_path / "other.c"
    src.write_text(c_code)
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    build.digest_file(out).write_text(build.file_sha256(out))


@needs_cc
@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign", "other-hash", "missing-symbol"])
def test_a_damaged_cached_library_is_compiled_again(tmp_path, monkeypatch, caplog, damage):
    """The cache holds a file under the library's name that is not the library: it is compiled
    again (with a warning) and the new one is loaded, records this source's hash and computes.
    Damaged bytes are caught by the recorded sha256 before dlopen (a truncated library would
    die of SIGBUS there); a whole library of another source by the hash it exports."""
    good = build.build_library(kernels.SOURCE)  # this session's library, in the real cache
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    tag = build.source_hash(kernels.SOURCE)
    path = build.cache_dir() / f"fewrows-{tag}.so"
    path.parent.mkdir(parents=True)
    if damage == "garbage":
        path.write_bytes(b"\x7fELF but not really")
    elif damage == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        shutil.copy(build.digest_file(good), build.digest_file(path))
    elif damage == "foreign":  # loads, has no hash
        _compile(tmp_path, "int other(void) { return 1; }\n", path)
    elif damage == "other-hash":  # loads, built from another source
        _compile(tmp_path, 'const char *specdraft_source_hash(void) { return "0123456789abcdef"; }\n', path)
    else:  # loads, this hash, but not the kernels
        _compile(tmp_path, f'const char *specdraft_source_hash(void) {{ return "{tag}"; }}\n', path)

    with caplog.at_level(logging.WARNING, logger="specdraft"):
        lib = build.open_library(kernels.SOURCE, kernels._setup_fewrows)
    assert f"the cached kernel library {path} is unusable" in caplog.text
    stamp = getattr(lib, build.HASH_SYMBOL)
    stamp.restype = ctypes.c_char_p
    assert stamp().decode() == tag
    assert sorted(p.name for p in path.parent.iterdir()) == [
        path.name,
        f"{path.name}.sha256",
    ]  # nothing else left
    x, w = torch.randn(3, 64), torch.randn(40, 64)
    y = torch.empty(3, 40)
    lib.fewrows_f32(x.data_ptr(), w.data_ptr(), y.data_ptr(), 3, 64, 40, 1)
    torch.testing.assert_close(y, x @ w.T)
    assert build.intact(path)  # the next process loads the rebuilt file as it is


@needs_cc
def test_a_library_that_cannot_be_rebuilt_falls_back_to_torch_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_why", None)
    path = build.cache_dir() / f"fewrows-{build.source_hash(kernels.SOURCE)}.so"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        assert not kernels.available()
    assert kernels.status().startswith("build failed:")
    assert "native kernels unavailable" in caplog.text and "using torch's matmuls" in caplog.text
    assert not kernels.supports(torch.randn(2, 32), torch.randn(64, 32))
