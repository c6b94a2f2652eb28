"""The HTTP layer: FastAPI routes over the scheduler, SSE streaming, errors, and running uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Status codes: 400 for any bad request (malformed JSON, missing or mistyped field, unsupported
option, prompt or ``max_tokens`` beyond the context window: code ``context_length_exceeded``), 401
for a missing or wrong API key (with ``api_key`` set), 404 for an unknown model or route, 408 when a
request outlives ``request_timeout``, 413 for a body over ``max_body_bytes``, 415 for a body that is
not ``application/json``, 429 (with ``Retry-After``) when ``max_batch`` requests are decoding and
``max_queue`` are waiting, 500 for an internal error, 503 while shutting down or after the
scheduler thread died. Every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

Exposure. With ``api_key`` set, every ``/v1/*`` request needs ``Authorization: Bearer <key>``, as
vLLM's ``--api-key``; ``/health`` and ``/metrics`` stay open. A JSON body is required with its
Content-Type: a web page can POST ``text/plain`` to a loopback server without a CORS preflight,
and such a request is refused before anything runs. Parsing and tokenization run in a worker
thread, so a huge prompt does not hold up other streams on the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdraft.api import Pipeline
from specdraft.errors import SpecdraftError
from specdraft.policy import make_policy
from specdraft.prefix_cache import PrefixCache
from specdraft.server import protocol as P
from specdraft.server.metrics import Metrics
from specdraft.server.scheduler import Job, Output, Scheduler
from specdraft.verify import SamplingParams

log = logging.getLogger("specdraft.server")


@dataclass
class ServerConfig:
    """How the server runs.

    Attributes:
        model_name: the id clients pass as ``model`` and ``/v1/models`` lists.
        k: the server's draft-length policy: an integer, ``auto`` or ``heuristic`` (``--k``).
        max_batch: requests decoded together (1 for targets without batched runtime).
        max_queue: requests allowed to wait for a batch row before 429.
        default_max_tokens: ``max_tokens`` when a request gives none (bounded by the context).
        max_body_bytes: larger request bodies get 413.
        shutdown_grace: seconds in-flight requests may keep decoding after SIGTERM before they
            end with ``finish_reason: "abort"``.
        api_key: when set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>`` (401
            otherwise); None: no authentication.
        request_timeout: seconds a request may wait and decode before it ends with a 408 and its
            row is freed; None: no limit.
        prefix_cache_mb: megabytes of earlier requests' keys and values kept for prompts that begin
            with the same tokens (a chat's earlier turns; :mod:`specdraft.prefix_cache`); 0: none.
    """

    model_name: str
    k: str = "5"
    max_batch: int = 16
    max_queue: int = 64
    default_max_tokens: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_grace: float = 5.0
    api_key: str | None = None
    request_timeout: float | None = None
    prefix_cache_mb: int = 512

    def __post_init__(self):
        if self.max_batch < 1:
            raise SpecdraftError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise SpecdraftError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.default_max_tokens < 1:
            raise SpecdraftError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.shutdown_grace < 0:
            raise SpecdraftError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        if self.api_key is not None and not self.api_key.strip():
            raise SpecdraftError("the API key is empty; give a non-empty key or none")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise SpecdraftError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.prefix_cache_mb < 0:
            raise SpecdraftError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")


_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class _CountRequests:
    """ASGI middleware counting /v1 requests by endpoint and status (streams pass untouched)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
            self.metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()


class _RequireKey:
    """ASGI middleware: ``/v1`` requests without ``Authorization: Bearer <key>`` get a 401."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["path"] + "/").startswith("/v1/") or self._authorized(scope):
            return await self.app(scope, receive, send)
        err = P.APIError(
            401,
            "missing or invalid API key: send the header Authorization: Bearer <key>",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await JSONResponse(err.body(), status_code=401, headers=err.headers)(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key)


def create_app(pipe: Pipeline, config: ServerConfig) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the scheduler thread."""
    metrics = Metrics()
    scheduler = Scheduler(
        pipe,
        make_policy(config.k),
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        metrics=metrics,
        request_timeout=config.request_timeout,
        prefix_cache=PrefixCache(config.prefix_cache_mb << 20) if config.prefix_cache_mb else None,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="specdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.config = scheduler, metrics, config
    if config.api_key is not None:
        app.add_middleware(_RequireKey, key=config.api_key)
    app.add_middleware(_CountRequests, metrics=metrics)  # the outer one: 401s are counted too
    ctx = _Context(pipe, config, scheduler, metrics, created=P.now())
    _add_error_handlers(app)
    _add_status_routes(app, ctx)
    _add_completion_routes(app, ctx)
    return app


@dataclass
class _Context:
    """What the routes of one app share."""

    pipe: Pipeline
    config: ServerConfig
    scheduler: Scheduler
    metrics: Metrics
    created: int  # when the app was made: the model card's ``created``


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body: API errors as raised, HTTP errors (404, 405) and, logged,
    anything unexpected as a 500."""

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        err = P.APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s", request.url.path)
        err = P.APIError(500, f"internal error: {type(e).__name__}", type="server_error")
        return JSONResponse(err.body(), status_code=500)


def _add_status_routes(app: FastAPI, ctx: _Context) -> None:
    """``GET /health``, ``GET /metrics`` and ``GET /v1/models``."""
    scheduler, config = ctx.scheduler, ctx.config

    @app.get("/health")
    async def health():
        running, waiting = scheduler.load()
        body = {
            "status": "ok" if scheduler.accepting else "unavailable",
            "model": config.model_name,
            "running": running,
            "waiting": waiting,
            "max_batch": scheduler.max_batch,
            "max_queue": scheduler.max_queue,
        }
        if scheduler.dead is not None:
            body["error"] = f"the scheduler stopped: {scheduler.dead}"
        return JSONResponse(body, status_code=200 if scheduler.accepting else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": config.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "specdraft",
            "max_model_len": ctx.pipe.runtime.max_context,
        }
        return {"object": "list", "data": [card]}


def _add_completion_routes(app: FastAPI, ctx: _Context) -> None:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming and not.

    Parsing and tokenization run in a worker thread: a multi-megabyte prompt takes seconds to
    encode, and the event loop must keep streaming the other requests' tokens meanwhile.
    """

    async def handle(request: Request, chat: bool):
        _check_content_type(request)
        body = await _read_body(request, ctx.config.max_body_bytes)
        if chat:
            req, prompts = await asyncio.to_thread(_prepare_chat, ctx, body)
            max_tokens = req.requested_max_tokens
        else:
            req, prompts = await asyncio.to_thread(_prepare_completion, ctx, body)
            max_tokens = req.max_tokens
        renderer = _Renderer("chatcmpl" if chat else "cmpl", ctx.config.model_name, chat, ctx.pipe.tokenizer)
        renderer.logprobs = req.logprob_count is not None
        return await _serve(ctx, request, req, prompts, max_tokens, renderer)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)


def _prepare_completion(ctx: _Context, body: bytes) -> tuple[P.CompletionRequest, list[list[int]]]:
    req = P.parse_request(P.CompletionRequest, body)
    prompts = req.prompts()
    _check_request(req, ctx, prompts=len(prompts))
    return req, [
        _check_ids(p, ctx.pipe) if isinstance(p, list) else _encode(ctx.pipe, p, chat=False) for p in prompts
    ]


def _prepare_chat(ctx: _Context, body: bytes) -> tuple[P.ChatCompletionRequest, list[list[int]]]:
    req = P.parse_request(P.ChatCompletionRequest, body)
    _check_request(req, ctx, prompts=1)
    if not ctx.pipe.target.is_chat():
        raise P.APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    return req, [_encode(ctx.pipe, [m.as_template_message() for m in req.messages], chat=True)]


async def _serve(
    ctx: _Context,
    request: Request,
    req,
    prompts: list[list[int]],
    max_tokens: int | None,
    renderer: _Renderer,
):
    """Submit a job per choice to the scheduler, all at once; stream their outputs (SSE) or collect them."""
    jobs = _jobs(ctx, req, prompts, max_tokens)
    ctx.scheduler.submit(*jobs)
    renderer.prompt_tokens = sum(len(ids) for ids in prompts)  # each prompt once, whatever n
    if req.stream:
        return StreamingResponse(
            _stream(jobs, renderer, ctx.scheduler, req.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _collect(request, jobs, renderer, ctx.scheduler)


def _jobs(ctx: _Context, req, prompts: list[list[int]], max_tokens: int | None) -> list[Job]:
    """A job per choice: ``n`` per prompt, choice ``i n + j`` the j-th of prompt i, seeded ``seed + j``
    (:mod:`specdraft.server.protocol`); the choices share one output queue."""
    context, default = ctx.pipe.runtime.max_context, ctx.config.default_max_tokens
    n, loop, queue = req.n or 1, asyncio.get_running_loop(), asyncio.Queue()
    echo = [None] * len(prompts)
    if isinstance(req, P.CompletionRequest) and req.echo:  # the prompt as given (token ids: their text)
        echo = [p if isinstance(p, str) else ctx.pipe.tokenizer.decode(p) for p in req.prompts()]
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=max(req.top_k or 0, 0),
        top_p=1.0 if req.top_p is None else req.top_p,
        logprobs=req.logprob_count,
    )
    seeds = [None if req.seed is None else (req.seed + j) % 2**63 for j in range(n)]
    stop_ids = tuple(_check_ids(req.stop_token_ids or [], ctx.pipe, "stop_token_ids"))
    jobs = []
    for i, ids in enumerate(prompts):
        budget = _check_context(len(ids), max_tokens, context, default)
        for j, seed in enumerate(seeds):
            sample = replace(params, seed=seed)
            job = Job(
                ids, budget, sample, req.stop_list, req.k_cap, loop, queue, bool(req.ignore_eos), stop_ids
            )
            job.index, job.echo = i * n + j, echo[i]
            jobs.append(job)
    return jobs


# --------------------------------------------------------------------------------------- helpers
def _check_request(req, ctx: _Context, prompts: int) -> None:
    req.check_supported()
    if req.model is not None and req.model != ctx.config.model_name:
        message = f"the model `{req.model}` does not exist; this server serves `{ctx.config.model_name}`"
        raise P.APIError(404, message, param="model", code="model_not_found")
    room = ctx.scheduler.max_batch + ctx.scheduler.max_queue
    if (req.n or 1) * prompts > room:
        message = (
            f"{req.n or 1} choices x {prompts} prompts: this server holds at most {room} sequences at once "
            "(max batch + max queue)"
        )
        raise P.APIError(400, message, param="n")


def _check_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (a browser sends text/plain cross-site without a preflight)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"`{media}`" if media else "none"
        message = f"the request body must be JSON with Content-Type: application/json (got {got})"
        raise P.APIError(415, message, code="unsupported_media_type")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise P.APIError(413, f"request body over {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise P.APIError(413, f"request body over {limit} bytes", code="request_too_large")
    return bytes(body)


def _encode(pipe: Pipeline, prompt, chat: bool) -> list[int]:
    try:
        ids = pipe.encode(prompt, chat=chat)
    except SpecdraftError as e:
        raise P.APIError(400, str(e), param="messages" if chat else "prompt") from None
    except Exception as e:  # noqa: BLE001 - a template or tokenizer refusing this input
        raise P.APIError(
            400, f"cannot encode the prompt: {e}", param="messages" if chat else "prompt"
        ) from None
    if not ids:
        raise P.APIError(400, "the prompt encodes to no tokens", param="prompt")
    return ids


def _check_ids(ids: list[int], pipe: Pipeline, param: str = "prompt") -> list[int]:
    vocab = pipe.runtime.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise P.APIError(400, f"token id {bad[0]} outside the vocabulary (0..{vocab - 1})", param=param)
    return ids


def _check_context(prompt_len: int, max_tokens: int | None, context: int, default: int) -> int:
    """Resolve ``max_tokens``; prompt + max_tokens must fit the context window."""
    if prompt_len >= context:
        raise P.APIError(
            400,
            f"this model's maximum context length is {context} tokens; the prompt has {prompt_len}",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return min(default, context - prompt_len)
    if prompt_len + max_tokens > context:
        raise P.APIError(
            400,
            f"this model's maximum context length is {context} tokens; you requested "
            f"{prompt_len + max_tokens} "
            f"({prompt_len} in the prompt, {max_tokens} for the completion)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


class _Renderer:
    """Builds OpenAI response bodies and stream chunks for one request."""

    def __init__(self, prefix: str, model: str, chat: bool, tokenizer):
        self.id, self.model, self.chat, self.created = P.new_id(prefix), model, chat, P.now()
        self.tokenizer = tokenizer
        self.prompt_tokens = 0  # the request's prompts' tokens, each prompt once (set by _serve)
        self.logprobs = False  # the request asked for logprobs
        self.offsets: dict[int, int] = {}  # choice -> its text's length so far (text_offset)

    def _logprobs(self, entries: list, index: int) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return P.chat_logprobs(entries, self._token_text)
        out = P.completion_logprobs(entries, self._token_text, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + sum(len(t) for t in out["tokens"])
        return out

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def first(self, choices: int) -> list[dict]:
        if not self.chat:
            return []
        role = {"role": "assistant", "content": ""}
        return [P.chat_chunk(self.id, self.model, self.created, role, None, i) for i in range(choices)]

    def chunks(self, out: Output) -> list[dict]:
        logprobs = self._logprobs(out.logprobs, out.index)
        if not self.chat:
            return [
                P.completion_chunk(
                    self.id, self.model, self.created, out.text, out.finish_reason, out.index, logprobs
                )
            ]
        chunks = []
        if out.text or out.logprobs:
            delta = {"content": out.text}
            chunks.append(P.chat_chunk(self.id, self.model, self.created, delta, None, out.index, logprobs))
        if out.finish_reason:
            chunks.append(P.chat_chunk(self.id, self.model, self.created, {}, out.finish_reason, out.index))
        return chunks

    def usage_chunk(self, jobs: list[Job]) -> dict:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": []}
        chunk["usage"] = P.usage(self.prompt_tokens, sum(job.completion_tokens for job in jobs))
        return chunk

    def response(self, outputs: list[list[Output]], jobs: list[Job]) -> dict:
        """The whole answer: ``outputs[i]`` are choice i's (job ``jobs[i]``)."""
        build = P.chat_response if self.chat else P.completion_response
        choices = [
            (
                "".join(o.text for o in outs),
                job.finish_reason,
                self._logprobs([e for o in outs for e in o.logprobs], i),
            )
            for i, (outs, job) in enumerate(zip(outputs, jobs))
        ]
        completion = sum(job.completion_tokens for job in jobs)
        return build(self.id, self.model, self.created, choices, self.prompt_tokens, completion)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(jobs: list[Job], renderer: _Renderer, scheduler: Scheduler, include_usage: bool):
    """SSE body: chunks as outputs arrive (the choices' interleaved, each chunk naming its
    choice's index), then usage (if asked) and ``[DONE]``. One choice's error ends the stream.

    When the client disconnects, the response task is cancelled here and the ``finally`` drops the
    jobs, which frees their cache rows.
    """
    try:
        for chunk in renderer.first(len(jobs)):
            yield _sse(chunk)
        running = len(jobs)
        while running:
            out: Output = await jobs[0].queue.get()  # the jobs share it
            if out.error is not None:
                yield _sse(out.error.body())
                break
            for chunk in renderer.chunks(out):
                yield _sse(chunk)
            if out.finish_reason is not None:
                running -= 1
        if include_usage:
            yield _sse(renderer.usage_chunk(jobs))
        yield _sse("[DONE]")
    finally:
        for job in jobs:
            scheduler.cancel(job)


async def _collect(
    request: Request, jobs: list[Job], renderer: _Renderer, scheduler: Scheduler, poll_s: float = 0.5
):
    """Non-streaming: wait for every choice's whole output, checking now and then that the client is
    still there. One choice's error answers the request."""
    outputs: list[list[Output]] = [[] for _ in jobs]
    running = len(jobs)
    getter: asyncio.Future | None = None
    loop = asyncio.get_running_loop()
    next_check = loop.time() + poll_s
    try:
        while True:
            getter = getter or asyncio.ensure_future(jobs[0].queue.get())  # the jobs share it
            done, _ = await asyncio.wait({getter}, timeout=max(next_check - loop.time(), 0.0))
            if loop.time() >= next_check:  # outputs may arrive faster than poll_s: check by the clock
                next_check = loop.time() + poll_s
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; the finally frees the row
            if not done:
                continue
            out: Output = getter.result()
            getter = None
            if out.error is not None:
                raise out.error
            outputs[out.index].append(out)
            if out.finish_reason is not None:
                running -= 1
            if not running:
                return JSONResponse(renderer.response(outputs, jobs))
    finally:
        if getter is not None:
            getter.cancel()
        for job in jobs:
            scheduler.cancel(job)


# ------------------------------------------------------------------------------------ running it
class _GracefulServer(uvicorn.Server):
    """uvicorn with a graceful SIGTERM: stop accepting, let rows finish within the grace period,
    abort the rest with ``finish_reason: "abort"``; uvicorn then closes the connections."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float):
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace

    def handle_exit(self, sig, frame):
        # a signal handler must not take locks the interrupted code may hold: hand off
        threading.Thread(target=self.scheduler.begin_shutdown, args=(self.grace,), daemon=True).start()
        super().handle_exit(sig, frame)


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> int:
    """Listen on ``host:port`` (0: any free port) and serve until SIGTERM/SIGINT; returns 0."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpecdraftError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    bound = sock.getsockname()[1]
    cfg: ServerConfig = app.state.config
    sched: Scheduler = app.state.scheduler
    print(
        f"specdraft serve: listening on http://{host}:{bound} (model {cfg.model_name}, k {cfg.k}, "
        f"max batch {sched.max_batch}, max queue {sched.max_queue}"
        f"{', API key required' if cfg.api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn's own limit is a backstop; the scheduler ends every stream after shutdown_grace
    timeout = int(cfg.shutdown_grace) + 10
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=timeout)
    server = _GracefulServer(config, sched, cfg.shutdown_grace)
    # uvicorn re-raises the signal it caught once it has shut down; with the default SIGTERM
    # action that would kill the process (exit -15) after a clean shutdown. Absorb it instead.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    return 0
