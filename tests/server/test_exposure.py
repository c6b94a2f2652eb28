"""The server's exposure: API key, request timeout, and a huge prompt that must not stall other streams."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

import httpx
import openai
import pytest

from specdraft.commands import serve
from specdraft.errors import SpecdraftError
from specdraft.server import ServerConfig

CONTEXT = 4096  # the tiny model's context window (conftest.CONTEXT)
KEY = "sk-test-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(launch):
    """A server whose key comes from $SPECDRAFT_API_KEY, with a 1 s request timeout."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDRAFT_API_KEY", KEY)  # the server process inherits it
        srv = launch("--draft", "prune:0", "--k", "3", "--request-timeout", "1")
    yield srv
    assert srv.terminate() == 0, srv.output()


def metric(server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------------------------------ API key
def test_api_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDRAFT_API_KEY", "from-env")
    assert serve.api_key(argparse.Namespace(api_key="from-flag")) == "from-flag"
    assert serve.api_key(argparse.Namespace(api_key=None)) == "from-env"
    monkeypatch.setenv("SPECDRAFT_API_KEY", "")
    assert serve.api_key(argparse.Namespace(api_key=None)) is None
    monkeypatch.delenv("SPECDRAFT_API_KEY")
    assert serve.api_key(argparse.Namespace(api_key=None)) is None
    with pytest.raises(SpecdraftError, match="API key is empty"):
        ServerConfig(model_name="m", api_key="")  # `--api-key "$UNSET"` must not serve without a key


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}],
    ids=["none", "wrong key", "no scheme", "basic"],
)
def test_v1_requests_without_the_key_are_401(guarded, headers):
    routes = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]
    for method, path in routes:
        body = {"prompt": "hi", "max_tokens": 2} if method == "POST" else None
        r = httpx.request(method, f"{guarded.url}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{guarded.url}/v1/no-such-route", headers=headers)
    assert r.status_code == 401  # the key is checked before anything else, unknown routes too


def test_the_key_opens_v1_and_health_and_metrics_stay_open(guarded):
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200
    model = httpx.get(f"{guarded.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    c = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    r = c.completions.create(model=model, prompt="let me in", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    unauthorized = 'specdraft:http_requests_total{endpoint="/v1/models",status="401"}'
    assert metric(guarded, unauthorized) >= 1


# ------------------------------------------------------------------------------- request timeout
def test_request_timeout_ends_a_stream_and_a_request_and_frees_their_rows(guarded):
    before = metric(guarded, 'specdraft:request_finished_total{finished_reason="timeout"}')
    # plain decoding of ~4000 tokens takes many seconds on the tiny model: the 1 s timeout ends it
    body = {"prompt": "too long", "max_tokens": CONTEXT - 64, "temperature": 0, "ignore_eos": True}
    body["speculation"] = "off"
    url = f"{guarded.url}/v1/completions"
    start = time.monotonic()
    with httpx.stream("POST", url, json=body | {"stream": True}, headers=AUTH, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    streamed_for = time.monotonic() - start
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert 0 < len(text.encode("utf-8", "surrogatepass")) < CONTEXT - 64  # tokens came, then it was cut
    assert 1 <= streamed_for < 30

    r = httpx.post(url, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"

    short = httpx.post(url, json={"prompt": "quick", "max_tokens": 4}, headers=AUTH, timeout=60)
    assert short.status_code == 200  # well within the timeout
    health = httpx.get(f"{guarded.url}/health").json()
    assert (health["running"], health["waiting"]) == (0, 0)
    assert metric(guarded, "specdraft:num_requests_running") == 0
    assert metric(guarded, 'specdraft:request_finished_total{finished_reason="timeout"}') == before + 2


# --------------------------------------------------------------------------------- a huge prompt
def test_a_huge_prompt_is_encoded_off_the_event_loop(server):
    """While a 1 MB prompt is parsed and encoded (about a second or more on the tiny byte-level
    tokenizer; 512 KB took 0.48 s on a quiet Zen 3, too close to the 0.5 s this test needs), other
    streams, one after another, keep receiving tokens: their longest gap is a fraction of the huge
    request's time. Encoded on the event loop, the gap would span the whole encoding."""
    huge = {"prompt": "hello world, " * (1024 * 1024 // 13), "max_tokens": 4}
    # streams of 512 tokens, one after another, so that one is live when the huge request ends however
    # fast this CPU decodes (a stream of the whole context ended first on a Xeon)
    other = {"prompt": "keep going", "max_tokens": 512, "temperature": 0, "stream": True}
    other |= {"ignore_eos": True, "speculation": "off"}  # one token per chunk

    async def main():
        arrivals: list[float] = []

        async def read(c):
            while True:
                async with c.stream("POST", "/v1/completions", json=other) as stream:
                    async for line in stream.aiter_lines():
                        if line.startswith("data: {"):
                            arrivals.append(time.monotonic())

        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            reader = asyncio.create_task(read(c))
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            r = await c.post("/v1/completions", json=huge)
            end = time.monotonic()
            while arrivals[-1] <= end and time.monotonic() < end + 5:  # the next token of a live stream
                await asyncio.sleep(0.01)
            reader.cancel()
        return r, arrivals, start, end

    r, arrivals, start, end = asyncio.run(main())
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert arrivals[-1] > end  # the other streams outlived the huge request
    during = [start] + [t for t in arrivals if start < t < end] + [end]
    longest, at = max((b - a, a - start) for a, b in itertools.pairwise(during))
    assert end - start > 0.5, end - start  # the encoding took long enough to be measured
    assert longest < (end - start) / 4, (longest, end - start, at)  # at: where the gap began
