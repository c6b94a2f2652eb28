"""Bad input through raw HTTP: every refusal is an OpenAI-style error body, and the server stays up."""

from __future__ import annotations

import httpx
import pytest

CONTEXT = 4096  # the tiny model's context window (conftest.CONTEXT)

LONG_STOP = b'{"prompt": "hi", "stop": "' + b"x" * 257 + b'"}'

CASES = [
    # (name, path, raw body, status, param, code)
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi",', 400, None, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None, "model_type"),
    ("empty body", "/v1/completions", b"", 400, None, "invalid_json"),
    ("missing prompt", "/v1/completions", b'{"max_tokens": 5}', 400, "prompt", "missing"),
    ("prompt of wrong type", "/v1/completions", b'{"prompt": 5}', 400, "prompt", None),
    ("empty prompt", "/v1/completions", b'{"prompt": ""}', 400, "prompt", None),
    ("an empty prompt among several", "/v1/completions", b'{"prompt": ["a", " "]}', 400, "prompt", None),
    ("an empty id list among several", "/v1/completions", b'{"prompt": [[1, 2], []]}', 400, "prompt", None),
    ("token id outside vocab", "/v1/completions", b'{"prompt": [1, 99999]}', 400, "prompt", None),
    (
        "negative max_tokens",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": -3}',
        400,
        "max_tokens",
        "greater_than_equal",
    ),
    (
        "zero max_tokens on chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        400,
        "max_tokens",
        "greater_than_equal",
    ),
    (
        "string max_tokens",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": "7"}',
        400,
        "max_tokens",
        "int_type",
    ),
    (
        "oversized max_tokens",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 100000}',
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "temperature out of range",
        "/v1/completions",
        b'{"prompt": "hi", "temperature": 3}',
        400,
        "temperature",
        None,
    ),
    (
        "temperature of wrong type",
        "/v1/completions",
        b'{"prompt": "hi", "temperature": "hot"}',
        400,
        "temperature",
        None,
    ),
    ("top_p zero", "/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "top_p", None),
    ("stop of wrong type", "/v1/completions", b'{"prompt": "hi", "stop": [1]}', 400, "stop.0", None),
    ("n = 0", "/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "n", "greater_than_equal"),
    # the test server holds 64 + 64 sequences: more choices than that could never all be admitted
    (
        "more choices than the server holds",
        "/v1/completions",
        b'{"prompt": ["a", "b"], "n": 65}',
        400,
        "n",
        None,
    ),
    ("logprobs over 20", "/v1/completions", b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs", None),
    (
        "completion logprobs a bool",
        "/v1/completions",
        b'{"prompt": "hi", "logprobs": true}',
        400,
        "logprobs",
        None,
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
        400,
        "top_logprobs",
        None,
    ),
    (
        "max_tokens 0 without echo",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 0}',
        400,
        "max_tokens",
        None,
    ),
    (
        "bad speculation",
        "/v1/completions",
        b'{"prompt": "hi", "speculation": {"num_speculative_tokens": -1}}',
        400,
        "speculation.num_speculative_tokens",
        None,
    ),
    (
        "unknown speculation",
        "/v1/completions",
        b'{"prompt": "hi", "speculation": "sometimes"}',
        400,
        "speculation",
        None,
    ),
    (
        "unknown model",
        "/v1/completions",
        b'{"prompt": "hi", "model": "gpt-9"}',
        404,
        "model",
        "model_not_found",
    ),
    ("messages missing", "/v1/chat/completions", b'{"max_tokens": 3}', 400, "messages", "missing"),
    ("messages empty", "/v1/chat/completions", b'{"messages": []}', 400, "messages", None),
    ("messages a string", "/v1/chat/completions", b'{"messages": "hi"}', 400, "messages", None),
    (
        "unknown role",
        "/v1/chat/completions",
        b'{"messages": [{"role": "robot", "content": "x"}]}',
        400,
        "messages.0.role",
        None,
    ),
    (
        "tools",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
        400,
        "tools",
        None,
    ),
    ("stop string too long", "/v1/completions", LONG_STOP, 400, "stop", None),
    (
        "stop token outside vocab",
        "/v1/completions",
        b'{"prompt": "hi", "stop_token_ids": [99999]}',
        400,
        "stop_token_ids",
        None,
    ),
    # output-shaping fields the server cannot honour are refused, not silently dropped
    (
        "response_format json",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}',
        400,
        "response_format",
        None,
    ),
    (
        "tool_choice required",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
        400,
        "tool_choice",
        None,
    ),
    ("min_p", "/v1/completions", b'{"prompt": "hi", "min_p": 0.1}', 400, "min_p", None),
    (
        "presence_penalty",
        "/v1/completions",
        b'{"prompt": "hi", "presence_penalty": 0.5}',
        400,
        "presence_penalty",
        None,
    ),
    ("logit_bias", "/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": 10}}', 400, "logit_bias", None),
    (
        "repetition_penalty",
        "/v1/completions",
        b'{"prompt": "hi", "repetition_penalty": 1.2}',
        400,
        "repetition_penalty",
        None,
    ),
    (
        "guided_json",
        "/v1/completions",
        b'{"prompt": "hi", "guided_json": {"type": "object"}}',
        400,
        "guided_json",
        None,
    ),
    (
        "prediction",
        "/v1/completions",
        b'{"prompt": "hi", "prediction": {"type": "content", "content": "x"}}',
        400,
        "prediction",
        None,
    ),
    (
        "stream not a bool",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        400,
        "stream",
        None,
    ),
]


def check_error_body(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    return err


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_an_openai_error(server, name, path, body, status, param, code):
    r = httpx.post(
        f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    err = check_error_body(r, status)
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert err["type"] == "invalid_request_error"


def test_prompt_beyond_the_context_window(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * (CONTEXT + 10)}, timeout=30)
    err = check_error_body(r, 400)
    assert err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    # fits alone, but not with the completion it asks for
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x" * (CONTEXT - 10), "max_tokens": 20}, timeout=30
    )
    assert check_error_body(r, 400)["code"] == "context_length_exceeded"
    # without max_tokens the completion is bounded by what is left of the window
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "x" * (CONTEXT - 10), "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10


def test_oversized_body_is_413(server):
    body = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    r = httpx.post(
        f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert check_error_body(r, 413)["code"] == "request_too_large"


def test_unknown_route_and_wrong_method(server):
    check_error_body(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    check_error_body(httpx.get(f"{server.url}/v1/completions"), 405)


def test_neutral_values_of_unhonoured_fields_are_accepted(server):
    """What leaves the output as it is passes: a text response format, min_p 0, no tool choice, a user."""
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 3,
        "response_format": {"type": "text"},
        "min_p": 0,
        "repetition_penalty": 1.0,
        "tool_choice": "none",
        "user": "someone",
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_server_still_serves_after_bad_input(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "still here", "max_tokens": 5, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_a_body_not_declared_json_is_415_and_not_run(server, content_type):
    """A web page can POST text/plain (or a form) to a loopback server without a CORS preflight."""
    before = httpx.get(f"{server.url}/metrics").text
    body = b'{"prompt": "from a web page", "max_tokens": 5}'
    headers = {} if content_type is None else {"content-type": content_type}
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=30)
        assert check_error_body(r, 415)["code"] == "unsupported_media_type"
    after = httpx.get(f"{server.url}/metrics").text
    tokens = [ln for ln in (before + after).splitlines() if ln.startswith("specdraft:prompt_tokens_total")]
    assert len(tokens) == 2 and tokens[0] == tokens[1]  # nothing was admitted


def test_json_with_a_charset_and_a_256_character_stop_string_are_accepted(server):
    body = b'{"prompt": "hi", "max_tokens": 2, "stop": "' + b"x" * 256 + b'"}'
    headers = {"content-type": "application/json; charset=utf-8"}
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
