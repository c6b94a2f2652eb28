"""Fixtures: the real server as a subprocess on a free loopback port, and in-process references.

Every server runs the tiny random Llama (byte-level tokenizer) saved with ``save_pretrained``, one
torch thread, so a whole module's server starts in seconds and decodes quickly on a shared CPU.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from specdraft.models.tiny import tiny_llama, tiny_tokenizer

CONTEXT = 4096  # the tiny model's context window in these tests (long enough to disconnect mid-way)
REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """``python -m specdraft.cli serve ...`` on port 0; the bound port is read from its stderr."""

    def __init__(self, args: list[str], log_path: Path, start_timeout: float = 180.0):
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until stop() closes it
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [
            sys.executable,
            "-m",
            "specdraft.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--threads",
            "1",
        ]
        self.proc = subprocess.Popen(cmd + args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if url is None:
                m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.output())
                url = m.group(1) if m else None
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-target")
    tiny_llama(max_position_embeddings=CONTEXT).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def reference(tiny_dir):
    """The target alone, in this process: plain decoding, batch 1 (what every output must equal)."""
    from specdraft import api

    threads = torch.get_num_threads()
    pipe = api.load(str(tiny_dir), draft="none", threads=1, dtype="fp32")
    yield pipe
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def launch(tmp_path_factory, tiny_dir):
    """``launch(*serve_args)`` starts a server on the tiny target; the caller terminates it."""

    def start(*args: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("server-log") / "server.log"
        # fp32: the same model on both runtimes (auto would give the compact runtime bf16 weights
        # and transformers' fp32); a later --target / --dtype wins
        return ServerProcess(
            ["--target", str(tiny_dir), "--dtype", "fp32", "--log-level", "warning", *args], log
        )

    return start


@pytest.fixture(scope="session")
def server(launch):
    """A batching server: layer-pruned self-draft (layer 0 of 2), k = 3, up to 64 rows. The draft in
    fp32, as the target: with ``--draft-dtype auto`` a CPU with native bf16 (an AVX512-BF16 Xeon) runs it
    in bf16 through torch, whose per-shape kernel caches grew the soak's RSS by 35% in 60 s (790 -> 1065
    MB, fp32 draft: flat), which is not the server's own memory the soak checks; elsewhere auto already
    meant fp32 arithmetic."""
    srv = launch(
        "--draft", "prune:0", "--draft-dtype", "fp32", "--k", "3", "--max-batch", "64", "--max-queue", "64"
    )
    yield srv
    assert srv.terminate() == 0, srv.output()


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: a bounded load test of about a minute (test_soak.py)")
