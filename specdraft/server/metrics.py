"""Prometheus metrics, named after vLLM's (``vllm:`` becomes ``specdraft:``).

Speculative decoding counters follow vLLM's ``spec_decode/metrics.py`` vocabulary:

- ``spec_decode_num_drafts``: row-steps that proposed at least one draft token.
- ``spec_decode_num_draft_tokens``: draft tokens proposed.
- ``spec_decode_num_accepted_tokens``: draft tokens the target accepted.
- ``spec_decode_num_accepted_tokens_per_pos{position}``: accepted draft tokens at each draft
  position (0-based); divided by ``num_drafts`` it is the per-position acceptance curve.
- ``spec_decode_collapsed_requests``: requests the draft-length policy flagged as collapsed, their
  drafts accepted far less than the drafter's average (an acceleration-collapse input; see
  :class:`specdraft.policy.RowWatch` for the rule). specdraft's own, not in vLLM.

Mean accepted length (bonus token included) is ``1 + accepted_tokens / num_drafts``.
Inter-token latency is observed once per streamed step, as vLLM does: a speculative step that
emits several tokens counts one gap (the time since the previous step's output).

Each :class:`Metrics` has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from specdraft.stats import SpecStats

PREFIX = "specdraft:"
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)


class Metrics:
    """Every metric the server exports; ``render()`` gives the text exposition format."""

    def __init__(self) -> None:
        disable_created_metrics()  # process-wide: drop the *_created series, as vLLM does
        r = self.registry = CollectorRegistry()
        p = PREFIX
        self.http_requests = Counter(
            f"{p}http_requests",
            "HTTP requests to /v1 endpoints by status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_finished = Counter(
            f"{p}request_finished",
            "Generations that ended, by finish reason (stop, length, cancelled: client gone, abort: "
            "server shutdown, error)",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge(f"{p}num_requests_running", "Requests decoding in the batch", registry=r)
        self.waiting = Gauge(f"{p}num_requests_waiting", "Requests waiting for a batch row", registry=r)
        self.e2e = Histogram(
            f"{p}e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            f"{p}time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{p}inter_token_latency_seconds",
            "Gap between a request's consecutive steps with output",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.engine_steps = Counter(f"{p}engine_steps", "Batched target forwards (decode steps)", registry=r)
        self.num_drafts = Counter(
            f"{p}spec_decode_num_drafts", "Row-steps with at least one draft token", registry=r
        )
        self.num_draft_tokens = Counter(
            f"{p}spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.num_accepted_tokens = Counter(
            f"{p}spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            f"{p}spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens per draft position",
            ["position"],
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            f"{p}prefix_cache_hits",
            "Prompt tokens whose keys and values came from the prefix cache instead of a prefill",
            registry=r,
        )
        self.collapsed_requests = Counter(
            f"{p}spec_decode_collapsed_requests",
            "Requests whose draft acceptance collapsed far below the drafter's average (flagged once each)",
            registry=r,
        )

    def observe_step(self, stats: SpecStats) -> None:
        """Add one engine step's statistics (a fresh :class:`SpecStats` per step)."""
        self.engine_steps.inc(stats.target_forwards)
        if stats.drafted_per_position:
            self.num_drafts.inc(stats.drafted_per_position[0])
        self.num_draft_tokens.inc(stats.drafted)
        self.num_accepted_tokens.inc(stats.accepted)
        for pos, n in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(position=str(pos)).inc(n)
        self.collapsed_requests.inc(stats.collapsed)

    def render(self) -> bytes:
        return generate_latest(self.registry)
