"""Queueing and 429 on a batch-1 target (transformers adapter), and a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import openai
import pytest

from specdraft.verify import SamplingParams


@pytest.fixture(scope="module")
def serial_server(launch):
    """The transformers adapter cannot batch: one row decodes, one request may wait.

    No drafter: the adapter's rollback (``DynamicCache.crop``) fails on transformers 5.24."""
    srv = launch("--runtime", "hf", "--draft", "none", "--max-batch", "8", "--max-queue", "1")
    yield srv
    assert srv.terminate() == 0, srv.output()


async def _first_chunk(lines):
    async for line in lines:
        if line.startswith("data: {"):
            return json.loads(line[6:])
    raise AssertionError("stream ended before its first chunk")


async def _rest(lines) -> tuple[str, str | None, bool]:
    """Text and finish reason of the remaining chunks, and whether [DONE] ended the stream."""
    parts, reason, done = [], None, False
    async for line in lines:
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            parts.append(choice["text"])
            reason = choice["finish_reason"] or reason
    return "".join(parts), reason, done


def test_batch_one_target_queues_requests_and_matches_alone(serial_server, reference):
    assert httpx.get(f"{serial_server.url}/health").json()["max_batch"] == 1
    prompts = ["first in line", "second in line"]

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{serial_server.url}/v1", api_key="x", max_retries=0, timeout=120
        ) as c:
            rs = await asyncio.gather(
                *(
                    c.completions.create(
                        prompt=p, model=str(serial_server_model), max_tokens=20, temperature=0
                    )
                    for p in prompts
                )
            )
        return [r.choices[0].text for r in rs]

    serial_server_model = httpx.get(f"{serial_server.url}/v1/models").json()["data"][0]["id"]
    texts = asyncio.run(main())
    for p, text in zip(prompts, texts):
        assert text == reference.generate(p, max_new_tokens=20, k=0, params=SamplingParams(), chat=False).text


def test_full_queue_answers_429_with_retry_after(serial_server):
    body = {
        "prompt": "hold the row",
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }

    async def main():
        async with httpx.AsyncClient(base_url=serial_server.url, timeout=120) as c:
            async with c.stream("POST", "/v1/completions", json=body) as running:
                lines = running.aiter_lines()  # keep a reference: a collected iterator closes the response
                await _first_chunk(lines)  # decoding: holds the only row
                async with c.stream("POST", "/v1/completions", json=body) as waiting:
                    assert waiting.status_code == 200  # accepted: it waits for the row
                    rejected = await c.post("/v1/completions", json=body)
                    health = (await c.get("/health")).json()
            return rejected, health

    rejected, health = asyncio.run(main())
    assert (health["running"], health["waiting"]) == (1, 1)
    assert rejected.status_code == 429
    assert int(rejected.headers["retry-after"]) >= 1
    err = rejected.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "rate_limit_exceeded"
    # both streams were closed by the client: their rows and queue slot are free again
    r = httpx.post(
        f"{serial_server.url}/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60
    )
    assert r.status_code == 200


def test_sigterm_finishes_or_aborts_in_flight_streams_and_exits_0(launch):
    srv = launch("--draft", "prune:0", "--k", "3", "--shutdown-grace", "3")
    short = {"prompt": "short", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
    long = {"prompt": "long", "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}

    async def main():
        async with (
            httpx.AsyncClient(base_url=srv.url, timeout=120) as c,
            c.stream("POST", "/v1/completions", json=long) as a,
            c.stream("POST", "/v1/completions", json=short) as b,
        ):
            lines_a, lines_b = a.aiter_lines(), b.aiter_lines()
            await asyncio.gather(_first_chunk(lines_a), _first_chunk(lines_b))
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(_rest(lines_a), _rest(lines_b))

    try:
        (_, long_reason, long_done), (_, short_reason, short_done) = asyncio.run(main())
        rc = srv.proc.wait(60)
    finally:
        code = srv.terminate()
    assert (short_reason, short_done) == ("length", True)  # finished within the grace period
    assert (long_reason, long_done) == ("abort", True)  # cut at the end of the grace period
    assert rc == 0 and code == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()
