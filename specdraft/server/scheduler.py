"""Continuous batching: one thread owns one :class:`~specdraft.engine.Engine` and feeds it requests.

HTTP handlers run on the asyncio event loop; they :meth:`Scheduler.submit` a :class:`Job` and
read its :class:`Output` s from the job's ``asyncio.Queue``. The scheduler thread loops:

    take cancellations -> admit waiting jobs into free rows (engine.add) -> engine.step()
    -> detokenize each row's tokens, apply stop strings -> post outputs (call_soon_threadsafe)

Rows that finish leave the engine by themselves; a stop string, a client that went away, or a
shutdown removes a row with ``engine.cancel``, which frees its cache row at once.

Per-request draft length. The engine has one policy for the batch, so per-request settings are
caps on the server's choice: the batch drafts ``k = min(policy k, max cap over rows)`` tokens and
each row then keeps at most its own cap of them (:class:`specdraft.drafters.capped.RowCappedDrafter`
lowers the row's ``num_valid``, exactly as an n-gram drafter with no match does; the batch's k is
bounded by :class:`specdraft.policy.CappedPolicy`). A row with cap 0
(``"speculation": "off"``) accepts no draft token: every token it gets is the target's own choice
at the first position, which is plain decoding, so it stays exact. Rows with a smaller cap still
pay for drafting the batch's k (their drafted tokens are simply ignored).

Isolation: any exception while admitting or delivering to one job fails that job only (its row is
cancelled); an exception inside ``engine.step`` fails the rows of that batch, and the scheduler
starts a fresh engine, so later requests are served normally. If the thread itself dies (the error
handling failed too), every job in the system, waiting or running, ends at once with a 500, and the
scheduler refuses new jobs (``/health`` answers 503): nothing waits on a thread that is gone.

Timeouts: with ``request_timeout`` set, a job still waiting or decoding that many seconds after
it was submitted ends with a 408 error (``finish_reason`` ``timeout`` in the metrics) and its row
is freed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from specdraft.api import Detokenizer, Pipeline
from specdraft.drafters.capped import RowCappedDrafter
from specdraft.engine import Engine, Request, prompt_logprobs
from specdraft.errors import SpecdraftError
from specdraft.policy import CappedPolicy, KPolicy
from specdraft.prefix_cache import PrefixCache
from specdraft.server.metrics import Metrics
from specdraft.server.protocol import APIError
from specdraft.stats import SpecStats
from specdraft.verify import SamplingParams, TokenLogprob

log = logging.getLogger("specdraft.server")


@dataclass
class Output:
    """New text for a request; ``finish_reason`` set on its last output.

    Attributes:
        text: text released since the previous output (may be empty on the last one).
        num_tokens: generated tokens behind this output.
        finish_reason: ``stop``, ``length``, ``cancelled``, ``abort`` (server shutdown), ``error`` or
            ``timeout`` (both with ``error`` set); None while generation continues.
        error: set when the request failed inside the scheduler.
        index: the job's choice index in its HTTP request (:attr:`Job.index`, stamped by :meth:`Job.post`).
        logprobs: the tokens generated since the previous output, with their logprobs, when the
            request asked for them (``params.logprobs``); a token whose text is still held back
            (an incomplete character, a possible stop string) comes with the output that has it.
    """

    text: str
    num_tokens: int
    finish_reason: str | None = None
    error: APIError | None = None
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(eq=False)  # identity: a job is "in the queue" only as itself
class Job:
    """One request's generation, shared by its handler (event loop) and the scheduler thread.

    Attributes:
        prompt: token ids.
        max_tokens: generated tokens at most.
        params: sampling parameters.
        stop: stop strings (the text before the first one is returned).
        k_cap: at most this many draft tokens per step; None: the server's policy decides.
        ignore_eos: generate past EOS until ``max_tokens``.
        stop_ids: token ids that end the job once generated, besides EOS (vLLM's ``stop_token_ids``:
            the token is part of the output, as EOS is; they apply with ``ignore_eos`` too).
        loop, queue: where outputs are posted (the choices of one HTTP request share a queue).
        index: which choice of its HTTP request this job is (``n`` samples per prompt, several
            prompts: ``prompt_index * n + sample``), stamped on every output.
        echo: the prompt's text, sent as the job's first output (with the prompt tokens' logprobs
            when ``params.logprobs`` asks) before any generated text; None: no echo. With
            ``max_tokens`` 0 that is all the job does (scoring a text: nothing is decoded).
        deadline: ``time.monotonic()`` after which the job ends with a timeout (set on submit).
    """

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    k_cap: int | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    ignore_eos: bool = False
    stop_ids: tuple[int, ...] = ()
    index: int = 0
    echo: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    row_id: int = -1
    detok: Detokenizer | None = None
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_output_at: float | None = None
    finish_reason: str | None = None
    done: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet posted (Output.logprobs)

    def post(self, item: Output) -> None:
        item.index = self.index
        item.logprobs, self.logprobs = self.logprobs, []
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (process exiting): nobody is listening
            pass


def supports_batches(pipe: Pipeline) -> bool:
    """Whether the target (and the drafter) can hold more than one row (the HF adapter cannot)."""
    try:
        pipe.runtime.new_state(2, 8)
        if pipe.drafter is not None:
            pipe.drafter.new_state(2, 8)
    except SpecdraftError:
        return False
    return True


class Scheduler:
    """Owns the engine; decodes every admitted job in one batch.

    Args:
        pipe: the loaded target and drafter.
        policy: the server's draft-length policy (per-request caps apply on top).
        max_batch: rows decoded together (forced to 1 when the runtime cannot batch).
        max_queue: jobs allowed to wait for a row; beyond ``max_batch + max_queue`` jobs in the
            system, :meth:`submit` answers 429.
        metrics: where counters go.
        request_timeout: seconds a job may wait and decode before it ends with a 408; None: no limit.
        prefix_cache: kept for every engine the scheduler makes (:mod:`specdraft.prefix_cache`).
    """

    def __init__(
        self,
        pipe: Pipeline,
        policy: KPolicy,
        *,
        max_batch: int,
        max_queue: int,
        metrics: Metrics,
        request_timeout: float | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        if max_batch < 1 or max_queue < 0:
            raise SpecdraftError(
                f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}"
            )
        if request_timeout is not None and not request_timeout > 0:
            raise SpecdraftError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        self.pipe = pipe
        self.batch_capable = supports_batches(pipe)
        self.max_batch = max_batch if self.batch_capable else 1
        self.max_queue = max_queue
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.prefix_cache = prefix_cache
        self.drafter = RowCappedDrafter(pipe.drafter) if pipe.drafter is not None else None
        self.policy = CappedPolicy(policy)
        self.engine = self._new_engine()
        self._rows: dict[int, Job] = {}  # engine request id -> job (scheduler thread only)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._cancels: list[Job] = []
        self._live: set[Job] = set()  # submitted and not done: what a dying thread must fail
        self._draining = False
        self._dead: str | None = None  # why the thread died
        self._abort_at: float | None = None
        self._thread: threading.Thread | None = None

    def _new_engine(self) -> Engine:
        hidden = getattr(self.pipe.drafter, "hidden_layers", ())  # feature drafters read target states
        return Engine(
            self.pipe.runtime, self.drafter, self.policy, hidden_layers=hidden, prefix_cache=self.prefix_cache
        )

    # ------------------------------------------------------------------ event loop side
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specdraft-scheduler", daemon=True)
            self._thread.start()

    @property
    def accepting(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return alive and not self._draining and self._dead is None

    @property
    def dead(self) -> str | None:
        """Why the scheduler thread died, or None while it runs (or after a clean stop)."""
        return self._dead

    def load(self) -> tuple[int, int]:
        """(running, waiting) jobs."""
        with self._cond:
            return len(self._live) - len(self._waiting), len(self._waiting)

    def submit(self, *jobs: Job) -> None:
        """Queue jobs (all or none: the choices of one HTTP request), or raise 429 when the system
        has no room for all of them and 503 when shutting down."""
        with self._cond:
            if self._dead is not None:
                message = f"the scheduler stopped after an internal error ({self._dead}); restart the server"
                raise APIError(503, message, type="server_error", code="unavailable")
            if not self.accepting:
                raise APIError(503, "the server is shutting down", type="server_error", code="unavailable")
            if len(self._live) + len(jobs) > self.max_batch + self.max_queue:
                raise APIError(
                    429,
                    f"server busy: {self.max_batch} requests decoding and {self.max_queue} waiting; "
                    "retry later",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": "1"},
                )
            for job in jobs:
                if self.request_timeout is not None:
                    job.deadline = time.monotonic() + self.request_timeout
                self._live.add(job)
                self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job (no-op when it already finished)."""
        with self._cond:
            if job.done:
                return
            if job in self._waiting:
                self._waiting.remove(job)
                self._mark_done(job, "cancelled")
                return
            self._cancels.append(job)
            self._cond.notify()

    def begin_shutdown(self, grace: float) -> None:
        """Stop accepting; rows still running after ``grace`` seconds end with ``abort``."""
        with self._cond:
            self._draining = True
            abort_at = time.monotonic() + max(grace, 0.0)
            self._abort_at = abort_at if self._abort_at is None else min(self._abort_at, abort_at)
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and join the thread."""
        self.begin_shutdown(0.0)
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ scheduler thread
    def _mark_done(self, job: Job, reason: str) -> None:
        """Bookkeeping for a job that ended (call with ``self._cond`` held)."""
        job.done, job.finish_reason = True, reason
        self._live.discard(job)
        self.metrics.request_finished.labels(finished_reason=reason).inc()
        self.metrics.waiting.set(len(self._waiting))
        self.metrics.running.set(len(self._live) - len(self._waiting))

    def _finish(self, job: Job, reason: str, text: str = "", error: APIError | None = None) -> None:
        if self._rows.pop(job.row_id, None) is not None:
            self.engine.cancel(job.row_id)  # frees the cache row
        with self._cond:
            if job.done:
                return
            self._mark_done(job, reason)
        if job.first_token_at is not None:
            self.metrics.e2e.observe(time.monotonic() - job.arrival)
        job.post(Output(text, 0, reason, error))

    def _run(self) -> None:
        try:
            while True:
                try:
                    if not self._iterate():
                        return
                except Exception as e:  # a bug here must not leave requests hanging
                    log.exception("scheduler iteration failed; failing the requests it held")
                    with self._cond:  # every job out of the queue: rows, half-admitted, cancelling
                        waiting = set(self._waiting)
                        held = [j for j in self._live if j not in waiting]
                    self._rows.clear()
                    self.engine = self._new_engine()
                    for job in held:
                        self._fail(job, APIError(500, f"internal error: {e}", type="server_error"))
        except BaseException as e:  # noqa: BLE001 - the error handling failed too: the thread is lost
            self._die(e)

    def _die(self, e: BaseException) -> None:
        """End every job in the system with a 500 and refuse new ones; the thread then exits."""
        reason = f"{type(e).__name__}: {e}"
        with self._cond:
            self._dead = reason
            jobs = [j for j in self._live if not j.done]
            self._waiting.clear()
            self._live.clear()
            for job in jobs:
                job.done, job.finish_reason = True, "error"
        error = APIError(500, f"internal error: the scheduler stopped ({reason})", type="server_error")
        for job in jobs:  # first, before anything else can fail: nobody may wait on a dead thread
            job.post(Output("", 0, "error", error))
        try:
            log.critical("the scheduler thread died; failed %d requests", len(jobs), exc_info=e)
            self.metrics.request_finished.labels(finished_reason="error").inc(len(jobs))
            self.metrics.waiting.set(0)
            self.metrics.running.set(0)
        except Exception:  # noqa: BLE001, S110 - the requests are answered; nothing more to do
            pass

    def _iterate(self) -> bool:
        """Cancellations, admissions, one step. Returns False once drained after a shutdown."""
        with self._cond:
            while not (self._waiting or self._cancels or self._rows or self._draining):
                self._cond.wait()
            if self._draining and not (self._rows or self._waiting):
                return False
            cancels, self._cancels = self._cancels, []
            now = time.monotonic()
            expired = [j for j in self._waiting if j.deadline is not None and now >= j.deadline]
            for job in expired:
                self._waiting.remove(job)
            expired += [j for j in self._rows.values() if j.deadline is not None and now >= j.deadline]
            free = self.max_batch - len(self._rows)
            admit = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            abort = self._draining and time.monotonic() >= self._abort_at
            if abort:
                admit += list(self._waiting)
                self._waiting.clear()
        for job in cancels:
            self._finish(job, "cancelled")
        for job in expired:
            message = f"the request outlived the server's request timeout ({self.request_timeout:g} s)"
            error = APIError(408, message, type="timeout_error", code="request_timeout")
            self._finish(job, "timeout", error=error)
        if abort:
            for job in admit + list(self._rows.values()):
                self._finish(job, "abort")
            return True
        if admit:
            self._admit(admit)  # should this raise, the guard in _run fails the admitted jobs
        if self._rows:
            self._step()
        return True

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill new jobs together; if that fails, one by one, so one bad job fails alone. Jobs
        that echo their prompt send it first (:meth:`_echo`)."""
        jobs = [job for job in jobs if not self._echo(job)]
        requests = [
            Request(
                j.prompt, j.max_tokens, j.params, (() if j.ignore_eos else self.pipe.eos_ids) + j.stop_ids
            )
            for j in jobs
        ]
        reused = self.prefix_cache.reused_tokens if self.prefix_cache is not None else 0
        try:
            self.engine.add(requests)
            pairs = list(zip(jobs, requests))
        except Exception:
            log.exception("batched prefill failed; admitting one by one")
            pairs = []
            for job, req in zip(jobs, requests):
                try:
                    self.engine.add([req])
                    pairs.append((job, req))
                except SpecdraftError as e:
                    self._fail(job, APIError(400, str(e)))
                except Exception as e:  # isolate the request, keep serving
                    log.exception("prefill failed for one request")
                    self._fail(job, APIError(500, f"internal error during prefill: {e}", type="server_error"))
        for job, req in pairs:
            job.row_id = req.id
            job.detok = Detokenizer(self.pipe.tokenizer, job.stop)
            job.last_output_at = job.arrival
            self._rows[req.id] = job
            self.metrics.prompt_tokens.inc(len(job.prompt))
        if self.prefix_cache is not None:
            self.metrics.prefix_cache_hits.inc(self.prefix_cache.reused_tokens - reused)
        with self._cond:
            self.metrics.waiting.set(len(self._waiting))
            self.metrics.running.set(len(self._live) - len(self._waiting))

    def _echo(self, job: Job) -> bool:
        """Post an echoing job's prompt text (and its tokens' logprobs); True when that ends it
        (``max_tokens`` 0)."""
        if job.echo is None:
            return False
        try:
            if job.params.logprobs is not None:
                job.logprobs = prompt_logprobs(self.pipe.runtime, job.prompt, job.params.logprobs)
        except Exception as e:  # isolate the request, keep serving
            log.exception("scoring the prompt failed for one request")
            self._fail(
                job, APIError(500, f"internal error while scoring the prompt: {e}", type="server_error")
            )
            return True
        job.post(Output(job.echo, 0))
        if job.max_tokens > 0:
            return False
        self.metrics.prompt_tokens.inc(len(job.prompt))  # a job decoding counts its own in _admit
        self._finish(job, "length")
        return True

    def _fail(self, job: Job, error: APIError) -> None:
        self._finish(job, "error", error=error)

    def _step(self) -> None:
        rows = [self._rows[r.id] for r in self.engine.requests]
        caps = [self.policy.k_max if j.k_cap is None else min(j.k_cap, self.policy.k_max) for j in rows]
        self.policy.cap = max(caps)
        if self.drafter is not None:
            self.drafter.caps = torch.tensor(caps)
        try:
            events = self.engine.step()
        except Exception as e:  # fail this batch, keep the server up
            log.exception("engine step failed; failing the %d requests of this batch", len(rows))
            self._rows.clear()
            self.engine = self._new_engine()
            for job in rows:
                self._fail(job, APIError(500, f"internal error while decoding: {e}", type="server_error"))
            return
        stats, self.engine.stats = self.engine.stats, SpecStats()
        self.metrics.observe_step(stats)
        now = time.monotonic()
        for ev in events:
            job = self._rows.get(ev.request_id)
            if job is None:
                continue
            try:
                self._deliver(job, ev, now)
            except Exception as e:
                log.exception("delivering output failed for one request")
                self._fail(job, APIError(500, f"internal error: {e}", type="server_error"))

    def _deliver(self, job: Job, ev, now: float) -> None:
        job.completion_tokens += len(ev.tokens)
        self.metrics.generation_tokens.inc(len(ev.tokens))
        if ev.tokens:
            if job.first_token_at is None:
                job.first_token_at = now
                self.metrics.ttft.observe(now - job.arrival)
            else:
                self.metrics.itl.observe(now - job.last_output_at)
            job.last_output_at = now
        job.logprobs += ev.logprobs or []
        text, hit_stop = job.detok.push(ev.tokens, ev.finished)
        reason = "stop" if hit_stop else ev.finish_reason if ev.finished else None
        if reason is None:
            if text:
                job.post(Output(text, len(ev.tokens)))
            return
        self._rows.pop(job.row_id, None)
        if not ev.finished:  # a stop string ended it; the engine still holds the row
            self.engine.cancel(job.row_id)
        with self._cond:
            if job.done:
                return
            self._mark_done(job, reason)
        self.metrics.e2e.observe(now - job.arrival)
        job.post(Output(text, len(ev.tokens), reason))
