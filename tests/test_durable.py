"""Atomic writes (:mod:`specdraft.durable`) from several processes at once."""

from __future__ import annotations

import subprocess
import sys


def test_two_processes_replacing_one_file_both_succeed(tmp_path):
    """Two trainings sharing a data cache rewrite its meta.json at the same moment: each writes its
    own temporary file (a shared temporary name made one rename fail with FileNotFoundError)."""
    path = tmp_path / "meta.json"
    code = (
        "import sys\nfrom specdraft.durable import write_text\n"
        "for _ in range(300): write_text(sys.argv[1], sys.argv[2] * 1000)\n"
    )
    run = [sys.executable, "-c", code, str(path)]
    procs = [subprocess.Popen([*run, c], stderr=subprocess.PIPE) for c in "ab"]
    errors = [p.communicate()[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert path.read_text() in ("a" * 1000, "b" * 1000)
    assert [f.name for f in tmp_path.iterdir()] == ["meta.json"]  # no temporary file left behind
