"""A bounded soak test on loopback: 64 concurrent streams for about a minute, some clients hanging up
mid-stream and some reading slowly. Afterwards: no server errors, every finished stream equals the
request run alone (greedy), no rows leaked, and the server's memory did not grow.

``SPECDRAFT_SOAK_SECONDS`` sets the duration (default 60); ``-m "not soak"`` leaves it out.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

import httpx
import pytest

from specdraft.verify import SamplingParams

CLIENTS = 64
DISCONNECT, SLOW = 0.2, 0.1  # shares of the requests whose client hangs up mid-stream / reads slowly
PROMPTS = [f"soak {i}: " + "lorem ipsum " * (i % 5) for i in range(16)]
MAX_TOKENS = [16 + 8 * (i % 5) for i in range(16)]
SPECULATION = [None, "off", {"num_speculative_tokens": 1}, {"num_speculative_tokens": 2}]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmRSS:")))


def _metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line and not line.startswith("#") and "_bucket{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait_idle(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(f"{server.url}/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {timeout} s: {h}")


async def _one(c: httpx.AsyncClient, rng: random.Random, tally: dict, mismatches: list, want: list):
    i = rng.randrange(len(PROMPTS))
    body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0, "stream": True}
    if SPECULATION[i % 4] is not None:
        body["speculation"] = SPECULATION[i % 4]
    roll = rng.random()
    hang_up_after = rng.randint(1, 4) if roll < DISCONNECT else None
    pause = rng.uniform(0.02, 0.1) if DISCONNECT <= roll < DISCONNECT + SLOW else 0.0
    parts, reason, chunks = [], None, 0
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            tally["bad_status"].append((r.status_code, (await r.aread())[:200]))
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                tally["error_events"].append(payload["error"])
                return
            chunks += 1
            parts.append(payload["choices"][0]["text"])
            reason = payload["choices"][0]["finish_reason"] or reason
            if hang_up_after is not None and chunks >= hang_up_after and reason is None:
                tally["disconnected"] += 1
                return  # leaving the block closes the connection mid-stream
            if pause:
                await asyncio.sleep(pause)
    tally["finished"] += 1
    tally["slow"] += bool(pause)
    if ("".join(parts), reason) != want[i]:
        mismatches.append((i, SPECULATION[i % 4], "".join(parts), reason, want[i]))


async def _traffic(server, seconds: float, seed: int, want: list) -> tuple[dict, list]:
    tally = {"finished": 0, "disconnected": 0, "slow": 0, "bad_status": [], "error_events": []}
    mismatches: list = []
    stop_at = time.monotonic() + seconds
    # a connection per request: a kept-alive one that idles past uvicorn's keep-alive timeout (5 s,
    # easily reached on a loaded machine) can be closed by the server just as the client reuses it
    limits = httpx.Limits(max_connections=2 * CLIENTS, max_keepalive_connections=0)

    async def client(k: int):
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < stop_at:
            await _one(c, rng, tally, mismatches, want)

    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
        await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    return tally, mismatches


@pytest.mark.soak
def test_soak_64_streams_with_disconnects_and_slow_readers(server, reference):
    seconds = float(os.environ.get("SPECDRAFT_SOAK_SECONDS", "60"))
    want = []
    for p, n in zip(PROMPTS, MAX_TOKENS):  # each request run alone: plain greedy decoding, batch 1
        r = reference.generate(p, max_new_tokens=n, k=0, params=SamplingParams(), chat=False)
        want.append((r.text, r.finish_reason))
    log_start = len(server.output())
    before = _metrics(server)

    # warm-up (a sixth of the time): the batch reaches full size, caches and allocators settle
    warm, warm_bad = asyncio.run(_traffic(server, seconds / 6, 1, want))
    _wait_idle(server)
    rss_before = _rss_kib(server.proc.pid)
    tally, mismatches = asyncio.run(_traffic(server, seconds * 5 / 6, 2, want))
    _wait_idle(server)
    rss_after = _rss_kib(server.proc.pid)
    after = _metrics(server)
    print(f"soak {seconds:g} s: {tally} (warm-up {warm}); server RSS {rss_before} -> {rss_after} KiB")

    for t in (warm, tally):
        assert not t["bad_status"] and not t["error_events"], (t["bad_status"][:3], t["error_events"][:3])
    assert not warm_bad and not mismatches, (warm_bad + mismatches)[:3]
    # the mix really happened: many finished streams, slow readers among them, and hang-ups
    assert tally["finished"] >= 2 * CLIENTS and tally["slow"] >= 1, tally
    assert tally["disconnected"] >= CLIENTS // 8, tally
    # the server saw no errors and leaked no rows
    errors = sum(v - before.get(k, 0.0) for k, v in after.items() if re.search(r'status="5\d\d"', k))
    assert errors == 0
    assert after.get('specdraft:request_finished_total{finished_reason="error"}', 0.0) == before.get(
        'specdraft:request_finished_total{finished_reason="error"}', 0.0
    )
    cancelled = after.get('specdraft:request_finished_total{finished_reason="cancelled"}', 0.0) - before.get(
        'specdraft:request_finished_total{finished_reason="cancelled"}', 0.0
    )
    assert 0 < cancelled <= warm["disconnected"] + tally["disconnected"]
    assert after["specdraft:num_requests_running"] == 0 and after["specdraft:num_requests_waiting"] == 0
    log = server.output()[log_start:]
    assert not re.search(r"Traceback|ERROR", log), log[-3000:]
    assert rss_after < 1.05 * rss_before, (rss_before, rss_after)
