"""The scheduler in-process (no HTTP): per-row draft caps, failure isolation, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from specdraft import api
from specdraft.policy import FixedK
from specdraft.server.metrics import Metrics
from specdraft.server.protocol import APIError
from specdraft.server.scheduler import Job, Output, Scheduler
from specdraft.verify import SamplingParams


@pytest.fixture(scope="module")
def pipe(tiny_dir, reference):  # `reference` first: it pins torch to one thread
    return api.load(str(tiny_dir), draft="prune:0", threads=1, dtype="fp32")  # as the reference


@pytest.fixture
def scheduler(pipe):
    s = Scheduler(pipe, FixedK(3), max_batch=8, max_queue=8, metrics=Metrics())
    s.start()
    yield s
    s.stop()


def new_job(prompt: list[int], max_tokens: int = 16, **kw) -> Job:
    return Job(
        prompt, max_tokens, SamplingParams(), [], None, asyncio.get_running_loop(), asyncio.Queue(), **kw
    )


async def drain(job: Job) -> tuple[str, str | None, APIError | None]:
    parts = []
    while True:
        out: Output = await asyncio.wait_for(job.queue.get(), 60)
        parts.append(out.text)
        if out.finish_reason is not None:
            return "".join(parts), out.finish_reason, out.error


def alone(reference, prompt: list[int], max_tokens: int = 16) -> tuple[str, str | None]:
    r = reference.generate(prompt, max_new_tokens=max_tokens, k=0, params=SamplingParams())
    return r.text, r.finish_reason


def test_mixed_caps_in_one_batch_equal_each_request_alone(scheduler, pipe, reference):
    prompts = [pipe.encode(f"row {i} " + "ab" * i, chat=False) for i in range(6)]
    caps = [None, 0, 1, 2, 0, None]

    async def main():
        jobs = [new_job(p, 24) for p in prompts]
        for j, c in zip(jobs, caps):
            j.k_cap = c
            scheduler.submit(j)
        return await asyncio.gather(*(drain(j) for j in jobs))

    for p, (text, reason, err) in zip(prompts, asyncio.run(main())):
        assert err is None
        assert (text, reason) == alone(reference, p, 24)


def test_a_failing_step_fails_its_batch_and_the_next_request_is_served(scheduler, pipe, reference):
    prompt = pipe.encode("after the crash", chat=False)

    def boom():
        raise RuntimeError("simulated kernel failure")

    async def main():
        scheduler.engine.step = boom  # this engine instance only; the scheduler replaces it
        first = await drain_submitted(new_job(pipe.encode("doomed", chat=False)))
        second = await drain_submitted(new_job(prompt))
        return first, second

    async def drain_submitted(job):
        scheduler.submit(job)
        return await drain(job)

    (_, reason, err), (text, reason2, err2) = asyncio.run(main())
    assert reason == "error" and err.status == 500 and "simulated kernel failure" in err.message
    assert err2 is None and (text, reason2) == alone(reference, prompt)
    assert scheduler.load() == (0, 0)


def test_one_request_failing_in_delivery_leaves_its_batch_mate_alone(scheduler, pipe, reference):
    good, bad = pipe.encode("the good one", chat=False), pipe.encode("the bad one", chat=False)
    deliver = scheduler._deliver

    def flaky(job, ev, now):
        if job.prompt == bad and job.completion_tokens >= 3:
            raise ValueError("detokenizer exploded")
        return deliver(job, ev, now)

    scheduler._deliver = flaky

    async def main():
        jobs = [new_job(good, 30), new_job(bad, 30)]
        for j in jobs:
            scheduler.submit(j)
        return await asyncio.gather(*(drain(j) for j in jobs))

    (text, reason, err), (_, bad_reason, bad_err) = asyncio.run(main())
    assert err is None and (text, reason) == alone(reference, good, 30)
    assert bad_reason == "error" and bad_err.status == 500
    assert scheduler.engine.active == 0  # the failed row was cancelled, not left decoding


def test_a_prompt_the_engine_refuses_fails_alone_at_prefill(scheduler, pipe, reference):
    good = pipe.encode("fine prompt", chat=False)

    async def main():
        # an id outside the vocabulary: the prefill's embedding lookup raises (the HTTP layer
        # refuses such ids earlier; this is the scheduler's own safety net)
        jobs = [new_job([1, 10**6, 2]), new_job(good)]
        for j in jobs:
            scheduler.submit(j)
        return await asyncio.gather(*(drain(j) for j in jobs))

    (_, bad_reason, bad_err), (text, reason, err) = asyncio.run(main())
    assert bad_reason == "error" and bad_err is not None
    assert err is None and (text, reason) == alone(reference, good)


def test_a_bug_in_the_loop_fails_the_held_requests_and_the_loop_goes_on(scheduler, pipe, reference):
    good = pipe.encode("next one", chat=False)
    admit = scheduler._admit

    def broken_once(jobs):
        scheduler._admit = admit
        raise KeyError("bookkeeping bug")

    scheduler._admit = broken_once

    async def main():
        first = new_job(pipe.encode("unlucky", chat=False))
        scheduler.submit(first)
        lost = await drain(first)
        second = new_job(good)
        scheduler.submit(second)
        return lost, await drain(second)

    (_, reason, err), (text, reason2, err2) = asyncio.run(main())
    assert reason == "error" and err.status == 500
    assert err2 is None and (text, reason2) == alone(reference, good)


def test_shutdown_aborts_running_and_waiting_jobs_then_refuses(pipe):
    s = Scheduler(pipe, FixedK(3), max_batch=1, max_queue=4, metrics=Metrics())
    s.start()

    async def main():
        jobs = [new_job(pipe.encode(f"job {i}", chat=False), 2000, ignore_eos=True) for i in range(3)]
        for j in jobs:
            s.submit(j)
        first = await jobs[0].queue.get()  # decoding has begun
        s.begin_shutdown(0.0)
        rest = await asyncio.gather(*(drain(j) for j in jobs))
        with pytest.raises(APIError) as e:
            s.submit(new_job([1, 2, 3]))
        return first, rest, e.value

    first, rest, refused = asyncio.run(main())
    s.stop()
    assert first.finish_reason is None
    assert [r[1] for r in rest] == ["abort", "abort", "abort"]
    assert refused.status == 503
    assert s.load() == (0, 0) and s.engine.active == 0


def test_full_system_is_429(pipe):
    s = Scheduler(pipe, FixedK(3), max_batch=1, max_queue=1, metrics=Metrics())  # not started: nothing drains

    async def main():
        s._thread = type("Alive", (), {"is_alive": lambda self: True})()  # accept without decoding
        s.submit(new_job([1, 2]))
        with pytest.raises(APIError) as both:  # one request's choices: all admitted or none
            s.submit(new_job([1, 2]), new_job([1, 2]))
        waiting = s.load()[1]
        s.submit(new_job([1, 2]))
        with pytest.raises(APIError) as e:
            s.submit(new_job([1, 2]))
        return both.value, waiting, e.value

    both, waiting, err = asyncio.run(main())
    assert both.status == 429 and waiting == 1
    assert err.status == 429 and err.headers["Retry-After"] == "1" and err.code == "rate_limit_exceeded"


@pytest.mark.parametrize("handler", ["_new_engine", "_fail"])
def test_a_dead_thread_ends_every_running_and_waiting_job_with_500_at_once(pipe, handler):
    """The engine step raises, and so does the error handling (``_new_engine`` or ``_fail``, which
    both handlers use): the thread is lost. Nothing may keep waiting for it."""
    s = Scheduler(pipe, FixedK(3), max_batch=2, max_queue=4, metrics=Metrics())
    s.start()

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure")

    async def main():
        jobs = [new_job(pipe.encode(f"job {i}", chat=False), 2000, ignore_eos=True) for i in range(4)]
        for j in jobs:
            s.submit(j)
        await asyncio.gather(jobs[0].queue.get(), jobs[1].queue.get())  # two decoding, two waiting
        setattr(s, handler, boom)
        s.engine.step = boom
        start = asyncio.get_running_loop().time()
        ends = await asyncio.gather(*(drain(j) for j in jobs))
        with pytest.raises(APIError) as refused:
            s.submit(new_job([1, 2, 3]))
        return ends, asyncio.get_running_loop().time() - start, refused.value

    ends, took, refused = asyncio.run(main())
    s._thread.join(10)
    assert [(reason, err.status) for _, reason, err in ends] == [("error", 500)] * 4
    assert all("scheduler stopped" in err.message for _, _, err in ends)
    assert took < 10
    assert not s._thread.is_alive() and not s.accepting and s.dead is not None
    assert refused.status == 503 and "restart" in refused.message
    assert s.load() == (0, 0)


def test_request_timeout_ends_waiting_and_running_jobs_and_frees_the_row(pipe, reference):
    s = Scheduler(pipe, FixedK(3), max_batch=1, max_queue=4, metrics=Metrics(), request_timeout=0.5)
    s.start()
    quick = pipe.encode("quick", chat=False)

    async def main():
        slow = [new_job(pipe.encode(f"slow {i}", chat=False), 3000, ignore_eos=True) for i in range(2)]
        for j in slow:  # the first decodes, the second waits for its row
            j.k_cap = 0  # plain decoding: thousands of steps, far beyond the timeout
            s.submit(j)
        ended = await asyncio.gather(*(drain(j) for j in slow))
        after = new_job(quick)
        s.submit(after)
        return ended, await drain(after), [j.completion_tokens for j in slow]

    try:
        ended, (text, reason, err), generated = asyncio.run(main())
    finally:
        s.stop()
    assert [(r, e.status, e.code) for _, r, e in ended] == [("timeout", 408, "request_timeout")] * 2
    assert 0 < generated[0] < 3000 and generated[1] == 0  # cut while decoding; never admitted
    assert err is None and (text, reason) == alone(reference, quick)  # later requests are served
    assert s.load() == (0, 0) and s.engine.active == 0


def test_after_the_thread_died_health_is_503_and_requests_get_500_or_503(tiny_dir, pipe):
    from fastapi.testclient import TestClient

    from specdraft.server import ServerConfig, create_app

    app = create_app(pipe, ServerConfig(model_name="tiny", k="3"))

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure")

    body = {"prompt": "hello", "max_tokens": 8}
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        sched = app.state.scheduler
        sched.engine.step = boom
        sched._new_engine = boom
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and "scheduler stopped" in r.json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503 and "scheduler stopped" in health.json()["error"]
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
