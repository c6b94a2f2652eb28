"""The real server through the official ``openai`` client and raw HTTP: outputs, streaming format,
per-request speculation, metrics, concurrency, disconnects."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from specdraft.engine import Engine, prompt_logprobs
from specdraft.verify import SamplingParams
from tests.helpers import decode_logprobs

CONTEXT = 4096  # the tiny model's context window (conftest.CONTEXT)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def model_id(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def expected(reference, prompt, max_tokens, chat=False, **params):
    """What the target alone produces (plain decoding, batch 1)."""
    r = reference.generate(prompt, max_new_tokens=max_tokens, k=0, params=SamplingParams(**params), chat=chat)
    return r.text, r.finish_reason, len(r.tokens)


def metrics(server) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (histogram buckets skipped)."""
    out = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line and not line.startswith("#") and "_bucket{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(f"{server.url}/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {timeout} s: {h}")


# ------------------------------------------------------------------------ endpoints and formats
def test_models_and_health(server, tiny_dir):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [str(tiny_dir)]
    assert models["data"][0]["max_model_len"] == CONTEXT
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 64 and health["max_queue"] == 64


def test_completion_equals_the_target_alone(server, reference):
    c = client(server)
    r = c.completions.create(model=model_id(server), prompt="The cat", max_tokens=40, temperature=0)
    text, reason, n = expected(reference, "The cat", 40)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == reason
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.completion_tokens == n
    assert r.usage.prompt_tokens == len(reference.encode("The cat", chat=False))
    assert r.usage.total_tokens == r.usage.prompt_tokens + n


def test_streamed_completion_concatenates_to_the_same_text(server, reference):
    c = client(server)
    stream = c.completions.create(
        model=model_id(server),
        prompt="Once upon",
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text, reason, n = expected(reference, "Once upon", 30)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_chat_streaming_and_not(server, reference):
    c = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    text, reason, n = expected(reference, messages, 25)
    r = c.chat.completions.create(model=model_id(server), messages=messages, max_tokens=25, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == reason
    assert r.usage.completion_tokens == n

    chunks = list(
        c.chat.completions.create(
            model=model_id(server), messages=messages, max_tokens=25, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason and chunks[-1].object == "chat.completion.chunk"


def test_sse_wire_format(server):
    body = {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    reasons = [p["choices"][0]["finish_reason"] for p in payloads]
    assert reasons[-1] in ("length", "stop") and set(reasons[:-1]) == {None}
    assert len({p["id"] for p in payloads}) == 1


def test_token_id_prompt(server, reference):
    ids = reference.encode("tokens!", chat=False)
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 10, "temperature": 0}, timeout=60
    ).json()
    assert r["choices"][0]["text"] == expected(reference, "tokens!", 10)[0]


def test_stop_string_cuts_the_text_and_reports_stop(server, reference):
    full, _, _ = expected(reference, "Stop me", 60)
    # a short piece of the greedy output, taken from its middle, as the stop string
    stop = next(
        full[i : i + 2]
        for i in range(8, len(full) - 2)
        if "\ufffd" not in full[i : i + 2] and full[i : i + 2].strip()
    )
    c = client(server)
    r = c.completions.create(
        model=model_id(server), prompt="Stop me", max_tokens=60, temperature=0, stop=[stop, "never-there"]
    )
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = list(
        c.completions.create(
            model=model_id(server), prompt="Stop me", max_tokens=60, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in streamed) == full[: full.find(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert wait_idle(server)["running"] == 0  # the stopped row left the batch


def test_ignore_eos_runs_to_max_tokens(server, reference):
    text, reason, n = expected(reference, "abc", 12)
    assert reason == "stop" and n < 12  # this prompt meets EOS early with the tiny model
    r = client(server).completions.create(
        model=model_id(server), prompt="abc", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.choices[0].text.startswith(text)


def test_stop_token_ids_end_the_output_at_that_token(server, reference):
    """vLLM's ``stop_token_ids``: the output is the target's up to and including the first such token."""
    ids = reference.generate(
        "Stop me", max_new_tokens=40, k=0, params=SamplingParams(temperature=0), chat=False
    ).tokens
    stop_id = ids[5]
    cut = ids[: ids.index(stop_id) + 1]
    r = client(server).completions.create(
        model=model_id(server),
        prompt="Stop me",
        max_tokens=40,
        temperature=0,
        logprobs=0,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(cut)
    assert r.choices[0].text == reference.tokenizer.decode(cut)


def test_seeded_sampling_is_reproducible(server):
    c = client(server)
    kw = {"model": model_id(server), "prompt": "Random", "max_tokens": 32, "temperature": 0.9, "top_p": 0.95}
    a = c.completions.create(seed=7, **kw).choices[0].text
    b = c.completions.create(seed=7, **kw).choices[0].text
    other = c.completions.create(seed=8, **kw).choices[0].text
    assert a == b
    assert a != other


def test_n_choices_sample_with_seed_plus_their_index(server, reference):
    c = client(server)
    kw = {"model": model_id(server), "prompt": "Several", "max_tokens": 24, "temperature": 0.9}
    r = c.completions.create(n=3, seed=11, **kw)
    alone = [c.completions.create(seed=11 + j, **kw) for j in range(3)]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [a.choices[0].text for a in alone]
    assert len({ch.text for ch in r.choices}) > 1
    assert r.usage.prompt_tokens == len(reference.encode("Several", chat=False))  # once, whatever n
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_a_list_of_prompts_gets_n_choices_each_in_order(server, reference):
    prompts, n = ["The cat", "Once upon", "abc"], 2
    r = client(server).completions.create(
        model=model_id(server), prompt=prompts, n=n, max_tokens=20, temperature=0
    )
    assert [ch.index for ch in r.choices] == list(range(len(prompts) * n))
    for ch in r.choices:
        text, reason, _ = expected(reference, prompts[ch.index // n], 20)
        assert (ch.text, ch.finish_reason) == (text, reason)
    assert r.usage.prompt_tokens == sum(len(reference.encode(p, chat=False)) for p in prompts)


def test_streamed_chat_choices_reassemble_by_index(server, reference):
    messages = [{"role": "user", "content": "two answers"}]
    text, reason, tokens = expected(reference, messages, 18, chat=True)
    chunks = list(
        client(server).chat.completions.create(
            model=model_id(server),
            messages=messages,
            max_tokens=18,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks.pop()
    assert usage.choices == [] and usage.usage.completion_tokens == 2 * tokens
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == text
        assert [m.finish_reason for m in mine][-1] == reason and mine[-1].delta.content is None
    assert wait_idle(server)["running"] == 0


def expected_logprobs(reference, prompt_ids: list[int], max_tokens: int, top: int) -> list:
    """The target alone's logprobs of its greedy output (plain decoding, in this process)."""
    params = [SamplingParams(logprobs=top)]
    return decode_logprobs(Engine(reference.runtime), [prompt_ids], max_tokens, params)[0]


def test_completion_logprobs_are_the_targets(server, reference):
    want = expected_logprobs(reference, reference.encode("The cat", chat=False), 16, 3)
    r = client(server).completions.create(
        model=model_id(server), prompt="The cat", max_tokens=16, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [reference.tokenizer.decode([w.token]) for w in want]
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-4)
    for top, w in zip(lp.top_logprobs, want):  # greedy: the chosen token is the most likely
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(w.logprob, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]


def test_echo_with_max_tokens_0_scores_the_prompt(server, reference):
    prompt = "The cat sat on the mat."
    ids = reference.encode(prompt, chat=False)
    want = prompt_logprobs(reference.runtime, ids, 2)
    r = client(server).completions.create(
        model=model_id(server), prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    ch = r.choices[0]
    assert ch.text == prompt and ch.finish_reason == "length" and r.usage.completion_tokens == 0
    assert ch.logprobs.tokens == [reference.tokenizer.decode([t]) for t in ids]
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    assert ch.logprobs.token_logprobs[1:] == pytest.approx([w.logprob for w in want[1:]], abs=1e-4)


def test_echo_returns_the_prompt_before_the_completion(server, reference):
    text, _, n = expected(reference, "Echo me", 10)
    r = client(server).completions.create(
        model=model_id(server), prompt="Echo me", max_tokens=10, temperature=0, echo=True, logprobs=0
    )
    assert r.choices[0].text == "Echo me" + text
    assert len(r.choices[0].logprobs.token_logprobs) == len(reference.encode("Echo me", chat=False)) + n
    streamed = client(server).completions.create(
        model=model_id(server), prompt="Echo me", max_tokens=10, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == "Echo me" + text


def test_streamed_chat_logprobs_are_the_targets(server, reference):
    messages = [{"role": "user", "content": "log probs"}]
    want = expected_logprobs(reference, reference.encode(messages, chat=True), 14, 2)
    chunks = client(server).chat.completions.create(
        model=model_id(server),
        messages=messages,
        max_tokens=14,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    records = [c for ch in chunks if ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in records] == pytest.approx([w.logprob for w in want], abs=1e-4)
    for c, w in zip(records, want):
        assert c.token == reference.tokenizer.decode([w.token]) and c.bytes == list(c.token.encode())
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in w.top], abs=1e-4)


def test_top_k_one_is_greedy(server, reference):
    r = client(server).completions.create(
        model=model_id(server),
        prompt="top k",
        max_tokens=20,
        temperature=1.0,
        extra_body={"top_k": 1, "seed": 3},
    )
    assert r.choices[0].text == expected(reference, "top k", 20)[0]


# --------------------------------------------------------------------- speculation and metrics
def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_speculation_counters_and_per_request_settings(server, reference):
    c = client(server)
    text, _, n = expected(reference, "Speculate", 40)

    before = metrics(server)
    r = c.completions.create(model=model_id(server), prompt="Speculate", max_tokens=40, temperature=0)
    after = metrics(server)
    assert r.choices[0].text == text
    drafts = _delta(after, before, "specdraft:spec_decode_num_drafts_total")
    draft_tokens = _delta(after, before, "specdraft:spec_decode_num_draft_tokens_total")
    accepted = _delta(after, before, "specdraft:spec_decode_num_accepted_tokens_total")
    per_pos = [
        _delta(after, before, f'specdraft:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
        for i in range(3)
    ]
    assert drafts > 0 and draft_tokens == 3 * drafts  # server k = 3, every step drafts
    assert 0 < accepted <= draft_tokens and sum(per_pos) == accepted
    assert per_pos[0] >= per_pos[1] >= per_pos[2]
    assert _delta(after, before, "specdraft:generation_tokens_total") == n

    # "speculation": "off" -> no drafts at all, same text
    before = metrics(server)
    r = c.completions.create(
        model=model_id(server),
        prompt="Speculate",
        max_tokens=40,
        temperature=0,
        extra_body={"speculation": "off"},
    )
    after = metrics(server)
    assert r.choices[0].text == text
    assert _delta(after, before, "specdraft:spec_decode_num_drafts_total") == 0
    assert _delta(after, before, "specdraft:engine_steps_total") == n  # one target forward per token

    # at most one draft token per step for this request
    before = metrics(server)
    r = c.completions.create(
        model=model_id(server),
        prompt="Speculate",
        max_tokens=40,
        temperature=0,
        extra_body={"speculation": {"num_speculative_tokens": 1}},
    )
    after = metrics(server)
    assert r.choices[0].text == text
    drafts = _delta(after, before, "specdraft:spec_decode_num_drafts_total")
    assert drafts > 0 and _delta(after, before, "specdraft:spec_decode_num_draft_tokens_total") == drafts


def test_latency_histograms_and_request_counters(server):
    before = metrics(server)
    client(server).completions.create(model=model_id(server), prompt="count me", max_tokens=16, temperature=0)
    after = metrics(server)
    assert _delta(after, before, "specdraft:time_to_first_token_seconds_count") == 1
    assert _delta(after, before, "specdraft:e2e_request_latency_seconds_count") == 1
    assert _delta(after, before, "specdraft:inter_token_latency_seconds_count") >= 1
    assert (
        _delta(after, before, 'specdraft:http_requests_total{endpoint="/v1/completions",status="200"}') == 1
    )
    assert _delta(after, before, 'specdraft:request_finished_total{finished_reason="length"}') == 1
    assert _delta(after, before, "specdraft:prompt_tokens_total") == len("count me")


def test_a_chats_second_turn_reuses_the_first_turns_cache(server, reference):
    """The second request carries the first turn and its answer: its prompt's cached tokens are not
    prefilled again (``prefix_cache_hits``), and its answer is still the target's alone."""
    c = client(server)
    turn = [{"role": "user", "content": "Tell me a long story about a cat " * 4}]
    r1 = c.chat.completions.create(model=model_id(server), messages=turn, max_tokens=30, temperature=0)
    turn += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    before = metrics(server)
    r2 = c.chat.completions.create(model=model_id(server), messages=turn, max_tokens=20, temperature=0)
    reused = _delta(metrics(server), before, "specdraft:prefix_cache_hits_total")
    assert reused >= len(reference.encode(turn[:1], chat=True)) - 1  # the first turn's prompt at least
    assert r2.choices[0].message.content == expected(reference, turn, 20, chat=True)[0]


# -------------------------------------------------------------------------------- concurrency
PROMPTS = [f"request {i}: " + "xyz" * (i % 7) for i in range(64)]
SPECULATION = [None, "off", {"num_speculative_tokens": 1}, {"num_speculative_tokens": 2}]


def test_64_concurrent_streams_equal_each_request_served_alone(server, reference):
    """Greedy, ragged prompts, different lengths and speculation settings; half of the requests
    start only once the first half is decoding, so rows join a running batch."""
    model = model_id(server)
    max_tokens = [8 + (i * 5) % 41 for i in range(64)]
    first_wave_started = None

    async def one(i: int, c: openai.AsyncOpenAI) -> tuple[str, str | None]:
        if i >= 32:
            await first_wave_started.wait()
        extra = {} if SPECULATION[i % 4] is None else {"speculation": SPECULATION[i % 4]}
        stream = await c.completions.create(
            model=model,
            prompt=PROMPTS[i],
            max_tokens=max_tokens[i],
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        parts, reason = [], None
        async for ch in stream:
            first_wave_started.set()
            parts.append(ch.choices[0].text)
            reason = ch.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def main():
        nonlocal first_wave_started
        first_wave_started = asyncio.Event()
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
        ) as c:
            return await asyncio.gather(*(one(i, c) for i in range(64)), return_exceptions=True)

    before = metrics(server)
    results = asyncio.run(main())
    after = metrics(server)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for i, (text, reason) in enumerate(results):
        want_text, want_reason, _ = expected(reference, PROMPTS[i], max_tokens[i])
        assert (text, reason) == (want_text, want_reason), f"request {i} ({SPECULATION[i % 4]})"
    # they really were decoded together: far fewer batched steps than tokens
    steps = _delta(after, before, "specdraft:engine_steps_total")
    tokens = _delta(after, before, "specdraft:generation_tokens_total")
    assert steps < tokens / 4, (steps, tokens)
    assert wait_idle(server)["running"] == 0


# -------------------------------------------------------------------------------- disconnects
def test_streaming_client_disconnect_frees_its_row(server):
    before = metrics(server)
    body = {
        "prompt": "long one",
        "max_tokens": CONTEXT - 64,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    wait_idle(server)
    after = metrics(server)
    assert _delta(after, before, 'specdraft:request_finished_total{finished_reason="cancelled"}') == 1
    assert _delta(after, before, "specdraft:generation_tokens_total") < CONTEXT - 64


def test_non_streaming_client_disconnect_frees_its_row(server):
    before = metrics(server)
    body = {"prompt": "long two", "max_tokens": CONTEXT - 64, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    wait_idle(server)
    after = metrics(server)
    assert _delta(after, before, 'specdraft:request_finished_total{finished_reason="cancelled"}') == 1
    assert _delta(after, before, "specdraft:generation_tokens_total") < CONTEXT - 64


def test_server_log_has_no_tracebacks(server):
    """Runs last in this module: nothing above made the server log an exception."""
    assert not re.search(r"Traceback|ERROR", server.output()), server.output()[-3000:]
