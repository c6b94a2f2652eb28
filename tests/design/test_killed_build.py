"""A real ``specdraft design build`` killed (SIGKILL) at random points of its training, then rerun
to the end, makes the same draft as an uninterrupted build."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdraft.cli import main
from specdraft.design.train import CHECKPOINT, load_checkpoint
from tests.helpers import TINY_BUILD

REPO = Path(__file__).resolve().parents[2]
STEPS = 80
BUILD = [
    *TINY_BUILD,
    "--layers",
    "1",
    "--head",
    "64",
    "--steps",
    str(STEPS),
    "--batch-size",
    "2",
    "--lr",
    "3e-3",
    "--checkpoint-every",
    "3",
    "--eval-every",
    "40",
]
KILLS = 2


def _inode(path: Path) -> int | None:
    """Each checkpoint is a new file renamed over the last: a new inode says a step was saved."""
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _meta(d: Path) -> dict:
    meta = json.loads((d / "specdraft.json").read_text())
    for k in ("command", "time_s", "date"):  # where and when it ran, not what it made
        meta["recipe"].pop(k)
    return meta


def test_killed_builds_resume_to_the_uninterrupted_draft(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    cache = tmp_path / "cache"  # shared: both builds train on the same cached target answers
    monkeypatch.setenv("SPECDRAFT_CACHE", str(cache))
    assert main([*BUILD, "--out", str(tmp_path / "a")]) == 0  # uninterrupted (it also fills the cache)
    recipe = json.loads((tmp_path / "a" / "specdraft.json").read_text())["recipe"]
    train_s = max(recipe["time_s"]["train_s"], 0.2)

    out, work = tmp_path / "b", tmp_path / "b.work"
    cmd = [sys.executable, "-m", "specdraft.cli", *BUILD, "--out", str(out)]
    env = {**os.environ, "SPECDRAFT_CACHE": str(cache)}
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    killed_at, first = [], None
    ckpt = work / CHECKPOINT
    for _ in range(KILLS):
        done, seen = load_checkpoint(ckpt)["step"] if ckpt.exists() else 0, _inode(ckpt)
        if done == STEPS:  # the last kill landed after training: the rerun below only saves
            break
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline and _inode(ckpt) == seen:
                time.sleep(0.02)  # until training has (re)started
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(rng.uniform(0.0, 0.7) * train_s * (STEPS - done) / STEPS)  # a random point of the rest
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
            proc.stderr.close()
        if proc.returncode != -signal.SIGKILL:  # it finished first: no later kill can land
            break
        killed_at.append(load_checkpoint(ckpt)["step"])
        first = first or load_checkpoint(ckpt)["model"]
    # (a kill after the last step lands in validation or in saving the draft: a fine test too)
    assert killed_at and all(0 < s <= STEPS for s in killed_at) and killed_at[0] < STEPS, (seed, killed_at)
    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert rerun.returncode == 0, rerun.stderr[-2000:]

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (seed, killed_at)
    assert _meta(tmp_path / "a") == _meta(out)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads(
        (out / "config.json").read_text()
    )
    # the first kill landed mid-training: the weights moved on after it
    assert any(not torch.equal(v, load_checkpoint(ckpt)["model"][k]) for k, v in first.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.work", "b", "b.work", "cache"]
