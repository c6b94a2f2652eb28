"""The Ray executor on a real local Ray cluster (`ray start --head`), reached by its address."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from specdraft.durable import read_rows
from specdraft.study.store import ResultStore
from specdraft.study.sweep import run_sweep
from tests.study.conftest import small_config, small_datasets

ray = pytest.importorskip("ray")


@pytest.fixture()
def ray_cluster(tmp_path):
    """A two-CPU Ray head in its own process group; yields its address; stopped by its pid."""
    ray_bin = Path(sys.executable).with_name("ray")
    log = tmp_path / "ray.log"
    temp = tempfile.mkdtemp(prefix="sdray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("w") as f:
        proc = subprocess.Popen(
            [
                str(ray_bin),
                "start",
                "--head",
                "--block",
                "--port",
                str(port),
                "--num-cpus",
                "2",
                "--include-dashboard",
                "false",
                "--disable-usage-stats",
                "--temp-dir",
                temp,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        address = None
        while time.monotonic() < deadline and proc.poll() is None and address is None:
            m = re.search(r"ray start --address='([^']+)'", log.read_text())
            address = m.group(1) if m else None
            time.sleep(0.2)
        assert address, log.read_text()[-3000:]
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` drains and stops the processes it started
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_sweep_on_a_ray_cluster(ray_cluster, tmp_path, tiny_pipe, data_files, sweep_results, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    config = small_config()
    datasets, heldout = small_datasets(tiny_pipe, data_files, cache_dir=tmp_path / "cache")
    store = ResultStore(tmp_path / "results.jsonl")
    # same profile as the inline sweep
    store.extend(r for r in read_rows(sweep_results) if r["kind"] == "latency")
    summary = run_sweep(
        config,
        datasets,
        heldout,
        store,
        executor="ray",
        address=ray_cluster,
        progress=False,
        log=lambda m: None,
    )
    assert summary.computed == 36 + 2 and summary.tasks == 8
    assert not ray.is_initialized()  # the driver disconnected
    ray_rows = {r["key"]: r for r in read_rows(store.path) if r["kind"] in ("config", "quality")}
    inline = {r["key"]: r for r in read_rows(sweep_results) if r["kind"] in ("config", "quality")}
    assert ray_rows.keys() == inline.keys()
    for key, r in ray_rows.items():  # the same numbers as computed in this process, up to rounding:
        # tasks batch the held-out rows differently, so a forward may take the few-row kernel in one
        # process and torch's GEMM in the other (last-bit differences, ~1e-5 in a perplexity)
        for field in ("mean_accepted_length", "predicted_tokens_per_s", "perplexity"):
            want = inline[key].get(field)
            assert r.get(field) == (None if want is None else pytest.approx(want, rel=1e-4)), (key, field)
