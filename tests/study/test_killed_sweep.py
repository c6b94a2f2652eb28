"""A real ``specdraft study`` sweep killed (SIGKILL) at random points, then rerun to the end, holds
the same rows as an uninterrupted sweep: none lost, none twice, none different."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from specdraft.cli import main
from specdraft.durable import read_rows

REPO = Path(__file__).resolve().parents[2]
KILLS = 2


def _study(data_files, out: Path) -> list[str]:
    return [
        "study",
        "--target",
        "tiny",
        "--drafts",
        "prune:0;prune:1;lookup",
        "--k",
        "1-6",
        "--batch",
        "1,2,4",
        "--spec-bench",
        str(data_files[0]),
        "--hellaswag",
        str(data_files[1]),
        "--prompts-per-dataset",
        "4",
        "--heldout",
        "2",
        "--max-new-tokens",
        "40",
        "--contexts",
        "16,64",
        "--profile-repeats",
        "1",
        "--threads",
        "1",
        "--workers",
        "0",
        "--validate",
        "0",
        "--no-progress",
        "--out",
        str(out),
    ]


def _by_key(path: Path) -> dict[str, dict]:
    """The rows a sweep computes (its "run" rows record when each invocation started)."""
    rows = [r for r in read_rows(path) if r["kind"] != "run"]
    assert len({r["key"] for r in rows}) == len(rows)  # no row twice
    return {r["key"]: r for r in rows}


def _config_rows(path: Path) -> int:
    """Config rows on disk now (a row's text holds ``"kind":"config"`` more than once: parse it)."""
    return sum(r["kind"] == "config" for r in read_rows(path, tolerate_truncated_tail=True))


def test_killed_sweeps_resume_to_the_uninterrupted_rows(tmp_path, data_files, capsys):
    assert main(_study(data_files, tmp_path / "a")) == 0  # uninterrupted; fills the continuation cache
    full = _by_key(tmp_path / "a" / "results.jsonl")
    total = sum(r["kind"] == "config" for r in full.values())
    assert total == 3 * 6 * 3 * 3

    # Latencies are measured, not computed: the killed sweep starts from the same ones, so every
    # prediction is comparable with the uninterrupted sweep's, to the last digit.
    results = tmp_path / "b" / "results.jsonl"
    results.parent.mkdir()
    results.write_text("".join(json.dumps(r) + "\n" for r in full.values() if r["kind"] == "latency"))
    cmd = [sys.executable, "-m", "specdraft.cli", *_study(data_files, tmp_path / "b")]
    env = dict(os.environ)  # SPECDRAFT_CACHE: the conftest's, which holds the continuations
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    killed_with = []
    for _ in range(KILLS):
        have = _config_rows(results)
        if have >= total - 1:
            break
        # kill once this many rows are in (within the first half of those left, so that a kill lands
        # inside the sweep even when the rows come fast), plus up to 5 ms (rows come at about 1 ms
        # each once the continuations are cached: 50 ms overshot by 45-90 rows)
        target = rng.randrange(have + 1, have + 1 + max(1, (total - have) // 2))
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                if _config_rows(results) >= target:
                    break
                time.sleep(0.005)
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(rng.uniform(0, 0.005))
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        killed_with.append(_config_rows(results))
    # A kill aimed near the end may land after the last row (rows take microseconds once the
    # continuations are cached): that kill tests nothing, but at least one must land inside.
    assert killed_with and all(0 < n <= total for n in killed_with), (seed, killed_with)
    assert any(n < total for n in killed_with), (seed, killed_with)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming" in done.stderr

    resumed = _by_key(results)
    assert resumed.keys() == full.keys(), (seed, killed_with)
    assert all(resumed[k] == full[k] for k in full), (seed, killed_with)
    assert len([r for r in read_rows(results) if r["kind"] == "run"]) == len(killed_with) + 1
