"""The OpenAI wire format: request models (validated with pydantic), response bodies, errors.

Requests are parsed from the raw body with ``model_validate_json`` in strict mode, so ``"5"`` is
not an integer and ``true`` is not a number, as the OpenAI API behaves. Unknown fields are ignored
(clients send fields this server has no use for, like ``user``); known fields the server cannot
honour (penalties, ``logit_bias``, ``response_format``, ``prediction``, ``tool_choice``, vLLM's
``min_p``, ``repetition_penalty``, ``min_tokens`` and guided decoding: :data:`_NEUTRAL`) are refused
with 400 unless their value leaves the output as it is, instead of being silently dropped.

Log-probabilities (``logprobs``: an int on ``/v1/completions``, ``true`` with ``top_logprobs`` on
chat): the target's, read from the logits that verified each token (drafted or not), before
temperature, top-k and top-p (vLLM's default ``raw_logprobs``), with up to
:data:`~specdraft.verify.MAX_LOGPROBS` alternatives. A token's text is its own decode (a token that
holds part of a UTF-8 character shows ``"\ufffd"``); ``text_offset`` sums those texts' lengths.
``echo`` (completions) returns the prompt before the completion, with its tokens' logprobs when
``logprobs`` is set (the first token's null, as OpenAI's); ``max_tokens: 0`` with ``echo`` scores the
prompt and decodes nothing, which is how evaluation harnesses (lm-evaluation-harness's
``local-completions``) read a text's log-likelihood.

Several choices per request, as OpenAI and vLLM answer them: ``n`` samples of each prompt, and on
``/v1/completions`` a list of prompts (texts or token-id lists); choice ``prompt_index * n + j`` is
the j-th sample of that prompt, and with a ``seed`` it samples with ``seed + j`` (so ``n = 1`` keeps
the seed's output). Each choice is its own row in the engine's batch.

Extensions beyond the OpenAI API:

- ``top_k`` (int, 0 or -1 = off), as vLLM and llama.cpp accept it.
- ``ignore_eos`` (bool), as vLLM accepts it: keep generating past EOS up to ``max_tokens``
  (benchmarks use it for outputs of a fixed length).
- ``stop_token_ids`` (list of ids), as vLLM accepts it: generation also ends after any of these
  tokens (which is part of the output, as EOS is), with ``ignore_eos`` too.
- ``speculation``: ``"off"`` (plain decoding for this request) or
  ``{"num_speculative_tokens": N}`` (at most N draft tokens per step for this request; an upper
  bound on the server's own choice, see :mod:`specdraft.server.scheduler`).
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdraft.verify import MAX_LOGPROBS, TokenLogprob

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters per stop string: each is searched in the text at every step
MAX_STOP_TOKEN_IDS = 64

# Fields of the OpenAI API and of vLLM's extensions that would shape the output if honoured, with
# the values that leave it as it is: any other value is refused (400) rather than silently dropped.
# Fields that change nothing in the output (``user``, ``metadata``, ``parallel_tool_calls``) stay
# ignored.
_NEUTRAL = {
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "logit_bias": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "prediction": lambda v: v is None,
    "min_p": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "min_tokens": lambda v: v in (None, 0),
    "use_beam_search": lambda v: v in (None, False),
    "bad_words": lambda v: not v,
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "structured_outputs": lambda v: v is None,
}
_NEUTRAL_CHAT = {
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
}


class APIError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``.

    Args:
        status: HTTP status code.
        message: one human-readable line.
        type: OpenAI error type (``invalid_request_error``, ``rate_limit_error``, ...).
        param: the request field at fault, if any.
        code: a machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class Speculation(BaseModel):
    """Per-request speculation settings (extension)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    num_speculative_tokens: int = Field(ge=0, le=64)


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions. ``None`` means "the default"."""

    model_config = ConfigDict(extra="allow", strict=True)  # extras are read by check_supported only

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculation: Literal["off"] | Speculation | None = None
    ignore_eos: bool | None = False
    NEUTRAL: ClassVar[dict] = _NEUTRAL  # the output-shaping fields refused unless neutral

    def check_supported(self) -> None:
        """Refuse options this server does not implement (rather than ignoring them)."""
        extra = self.model_extra or {}
        for name, neutral in self.NEUTRAL.items():
            if not neutral(extra.get(name)):
                raise APIError(400, f"{name} is not supported", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    @property
    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        if any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise APIError(400, f"a stop string may have at most {MAX_STOP_LENGTH} characters", param="stop")
        return [s for s in stop if s]

    @property
    def k_cap(self) -> int | None:
        """Upper bound on this request's draft length; None = the server's policy decides."""
        if self.speculation == "off":
            return 0
        return None if self.speculation is None else self.speculation.num_speculative_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is text or token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, score the prompt and decode nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400, "max_tokens must be >= 1 (0 only with echo: scoring the prompt)", param="max_tokens"
            )
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    @property
    def logprob_count(self) -> int | None:
        """Alternatives to report per token (:attr:`SamplingParams.logprobs`); None: no logprobs."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (a list of texts or of id lists: several)."""
        p = self.prompt
        several = isinstance(p, list) and p and isinstance(p[0], (str, list))
        prompts = list(p) if several else [p]
        for i, one in enumerate(prompts):
            if not one or (isinstance(one, str) and not one.strip()):
                where = f" (prompt {i})" if several else ""
                raise APIError(400, f"prompt is empty{where}", param="prompt")
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None

    NEUTRAL: ClassVar[dict] = {**_NEUTRAL, **_NEUTRAL_CHAT}

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def logprob_count(self) -> int | None:
        """Alternatives to report per token (:attr:`SamplingParams.logprobs`); None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body; malformed JSON and bad fields become a 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))  # the deepest error is the most specific
        if err["type"] == "json_invalid":
            raise APIError(400, f"malformed JSON body: {err['msg']}", code="invalid_json") from None
        param = ".".join(str(x) for x in err["loc"] if not _is_union_tag(x)) or None
        where = f"{param}: " if param else "request body: "
        raise APIError(400, f"{where}{err['msg']}", param=param, code=err["type"]) from None


def _is_union_tag(loc_part) -> bool:
    """Pydantic names the union member in error locations (``str``, ``list[str]``, ``Speculation``)."""
    if not isinstance(loc_part, str):
        return False
    return (
        "[" in loc_part
        or loc_part[:1].isupper()
        or loc_part in {"str", "int", "float", "bool", "list", "dict"}
    )


# --------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict,
    finish_reason: str | None,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_response(rid, model, created, choices: list[tuple], prompt_tokens, completion_tokens) -> dict:
    """``choices``: (text, finish_reason, logprobs) per choice index."""
    body = {"id": rid, "object": "text_completion", "created": created, "model": model}
    body["choices"] = [
        {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        for i, (text, reason, logprobs) in enumerate(choices)
    ]
    body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def chat_response(rid, model, created, choices: list[tuple], prompt_tokens, completion_tokens) -> dict:
    """``choices``: (text, finish_reason, logprobs) per choice index."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            for i, (text, reason, logprobs) in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_logprobs(entries: list[TokenLogprob], decode, offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object of ``entries``; ``decode(id) -> str``, ``offset``
    the text's length before them."""
    tokens = [decode(e.token) for e in entries]
    offsets = [offset + sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.logprob is None else _by_text(e.top, decode) for e in entries],
        "text_offset": offsets,
    }


def _by_text(top: tuple[tuple[int, float], ...], decode) -> dict[str, float]:
    """``{text: logprob}`` of a token's alternatives (most likely first); of tokens with the same text
    (bytes of split characters all read "\ufffd") the most likely one's."""
    out: dict[str, float] = {}
    for t, lp in top:
        out.setdefault(decode(t), lp)
    return out


def chat_logprobs(entries: list[TokenLogprob], decode) -> dict:
    """The chat ``logprobs`` object (``content``: a record per token) of ``entries``."""

    def record(token: int, logprob: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            record(e.token, e.logprob) | {"top_logprobs": [record(*t) for t in e.top]} for e in entries
        ]
    }


def now() -> int:
    return int(time.time())
