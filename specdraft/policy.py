"""Draft-length policies: how many tokens to draft at the next step.

- :class:`FixedK`: always k.
- :class:`HeuristicK`: transformers' "heuristic" schedule: +2 after a step that accepted every
  draft token, -1 otherwise (never below 1).
- :class:`CostAwareK`: measures draft and target latency and the acceptance of each draft position
  while it decodes and picks the k with the highest predicted throughput, including k = 0 (plain
  decoding) when speculation does not pay. Drafters that classify their proposals
  (:attr:`specdraft.drafters.base.Proposal.bucket`; prompt lookup: the length of the matched n-gram)
  get one acceptance curve per class, and each row's proposal is cut to the best length for its
  class (:meth:`KPolicy.trim`). While a class is at k = 0 it probes a small k every ``probe_every``
  steps so its estimate can recover; each probe that still says "do not speculate" doubles the
  interval (up to ``probe_max``), one that pays resets it. It also watches each request (row) on
  its own (:class:`_Row`): a row whose drafts keep being rejected is switched to 0 draft tokens
  while the others keep drafting, probes on the same schedule (a drafter whose proposals are free,
  prompt lookup, is watched at every step instead: :meth:`CostAwareK.shadow`), and is flagged as
  collapsed when its acceptance is far below the drafter's (:attr:`CostAwareK.collapsed`), the
  defense against acceleration-collapse inputs (issue 17). Whatever its model predicts, it times
  its steps and falls back to plain decoding when speculation loses more than a few plain steps'
  time (:class:`SafeArm`, a bandit with a safe arm: it never loses more than its trials).

A policy sees a step twice: :meth:`KPolicy.choose` before the drafter runs (how many tokens to ask
for) and :meth:`KPolicy.trim` after (how many of each row's proposal to verify); then
:meth:`KPolicy.update` with what verification accepted. All three are told the rows' request ids
(``rows``), so a policy can follow requests as they join and leave the batch.

Wrappers and the prefix rule that drafters share:

- :class:`CappedPolicy`: any policy with its k bounded by a cap set before each step (the server's
  per-request caps).
- :class:`VerifyCost` and :func:`best_prefix`: the prefix of a drafted proposal with the most
  expected tokens per unit of step time, from the draft's own confidences (what
  :class:`specdraft.drafters.gated.GatedDrafter` proposes), and :func:`worth_continuing`, when
  drafting further can no longer change that choice.
"""

from __future__ import annotations

import itertools
import math
import operator
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdraft import analytic
from specdraft.errors import SpecdraftError


class KPolicy(Protocol):
    k_max: int
    """The largest k :meth:`choose` can return; the engine reserves cache room for it
    (:attr:`specdraft.engine.Engine.reserve`)."""

    collapsed: set[int]
    """Request ids flagged as collapsed (drafts far less accepted than the drafter's average)."""

    def choose(self, rows: list[int] | None = None, lag: torch.Tensor | None = None) -> int:
        """Draft length to ask the drafter for (0: plain decoding); ``rows``: the batch's request ids;
        ``lag``: ``(B,)`` committed tokens the drafter would feed before drafting
        (:meth:`specdraft.drafters.base.DraftState.lag`), None when it feeds none."""
        ...

    def trim(
        self, num_valid: torch.Tensor, bucket: torch.Tensor | None, rows: list[int] | None = None
    ) -> torch.Tensor:
        """``(B,)`` how many of each row's ``num_valid`` proposed tokens to verify. It may read only
        what earlier steps taught (never the proposed tokens), so that sampling stays lossless."""
        ...

    def update(
        self,
        k: int,
        num_drafted: torch.Tensor,
        num_accepted: torch.Tensor,
        draft_time: float,
        target_time: float,
        bucket: torch.Tensor | None = None,
        rows: list[int] | None = None,
        width: int | None = None,
    ) -> None:
        """What the step did: ``k`` tokens in the longest proposal (what the draft time was spent
        on), ``(B,)`` drafts verified (after :meth:`trim`) and accepted, seconds spent drafting and
        verifying, the proposal's classes and the rows' request ids.

        A token-tree step (``Proposal.trees``) gives ``k`` = the most nodes proposed, the trees'
        depths as drafts verified, the accepted path's length as accepted, and ``width`` = the
        tokens each row fed (the most nodes + 1), the size its target time belongs to. None: a
        chain, ``num_drafted.max() + 1``."""
        ...


class _Fixed:
    """Policies that choose k before the step and keep every proposed token (no row is watched)."""

    collapsed: frozenset[int] = frozenset()

    def trim(self, num_valid, bucket, rows=None) -> torch.Tensor:
        return num_valid


class FixedK(_Fixed):
    """Always draft ``k`` tokens (k = 0: plain decoding)."""

    def __init__(self, k: int):
        if k < 0:
            raise SpecdraftError(f"draft length k must be >= 0, got {k}")
        self.k = k

    @property
    def k_max(self) -> int:
        return self.k

    def choose(self, rows=None, lag=None) -> int:
        return self.k

    def update(
        self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None, width=None
    ) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedK({self.k})"


class HeuristicK(_Fixed):
    """+2 when all drafted tokens were accepted (in every row), else -1; within [1, k_max]."""

    def __init__(self, k_start: int = 5, k_max: int = 16):
        self.k = k_start
        self.k_max = k_max

    def choose(self, rows=None, lag=None) -> int:
        return self.k

    def update(
        self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None, width=None
    ) -> None:
        if k == 0:
            return
        if bool((num_accepted >= num_drafted).all()):
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(self.k - 1, 1)

    def __repr__(self) -> str:
        return f"HeuristicK(k={self.k})"


@dataclass
class _Curve:
    """Acceptance of one class of proposals, position by position, as decayed counts.

    ``reached[j]``: steps that verified draft position j (0-based) with every earlier draft
    accepted; ``accepted[j]``: those of them that accepted it too.
    """

    reached: list[float]
    accepted: list[float]
    since_probe: int = 0
    probe_interval: int = 8
    probing: bool = False
    rates: list[float] | None = None  # cached c_j, None: recompute


@dataclass
class _Fit2:
    """``y ~ b1 x1 + b2 x2`` by least squares over observations whose weight decays by ``decay`` per
    observation. When the data cannot tell the two terms apart (x2 never seen apart from x1), or
    gives one a negative share, each term is read as if it alone took all of y (its own ratio,
    ``sum x y / sum x^2``): both are overestimated, the reading that never favours speculation."""

    decay: float
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # x1 x1, x1 x2, x2 x2, x1 y, x2 y

    def add(self, x1: float, x2: float, y: float) -> None:
        new = (x1 * x1, x1 * x2, x2 * x2, x1 * y, x2 * y)
        self.sums = [self.decay * s + v for s, v in zip(self.sums, new)]

    def solve(self) -> tuple[float, float] | None:
        """``(b1, b2)``; None until x1 has been seen."""
        a, b, c, p, q = self.sums
        if a <= 0:
            return None
        det = a * c - b * b
        if det > 1e-6 * a * c:
            b1, b2 = (c * p - b * q) / det, (a * q - b * p) / det
            if b1 >= 0 and b2 >= 0:
                return b1, b2
        return p / a, (q / c if c > 0 else 0.0)


@dataclass
class _StepLine:
    """A ragged step's time at one batch size B, ``T = t_plain + s x`` for x draft tokens over the
    batch: ``t_plain`` the running average of plain steps, s the median of ``(T - t_plain) / x`` over
    the last speculative steps (``latency_window`` of them, kept however many plain steps follow:
    one slow step, which a shared machine has, cannot make drafts look dear at B for the rest of
    a run, when their dearness stops them being timed again). :meth:`CostAwareK.slope` reads s.

    A draft token's cost is not one s: it grows with x (the quantized target's forward at batch 1, 2
    threads: 6.07 ms over 1 token, 6.86, 8.19 and 10.03 ms over 2, 3 and 4,
    ``results/feature-q8-2026-12-05/latency-0b2ca67.txt``), so a line through steps of 2 draft tokens
    read a 1-token step as dear as half of one of them, and the policy cut 1-token drafts that pay
    (prompt lookup at batch 1: k = auto 1.08x plain decoding, k = 1 1.13x,
    ``results/feature-q8-2026-12-05/lookup-k-0b2ca67.txt``). So steps of x draft tokens keep their own
    samples too (``by_x``, the last ``latency_window`` of each x); an x with a majority of them
    (a median one slow step cannot move) is read from its own (:meth:`CostAwareK.latency`)."""

    t_plain: float | None = None
    per_token: list[float] = field(default_factory=list)
    by_x: dict[int, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class RowWatch:
    """How :class:`CostAwareK` watches each request on its own (issue 17's defense).

    A row (request) is switched off, 0 draft tokens verified, once its own decayed acceptance of
    the first draft token falls below ``floor`` with at least ``evidence`` decayed proposals
    behind it (``decay`` 0.8, ``evidence`` 2: three rejected proposals in a row), and its run of
    rejected proposals is one a row of this drafter rarely has: below ``off_alpha`` at the
    drafter's average acceptance p (``(1 - p)^run``: 3 at p = 0.9, 6 at p = 0.5), or ``off_max``
    long whatever p (a drafter seldom right has little to lose by trying again). Before that rule,
    a draft accepted half of the time went off at every third miss in a row and spent a fifth of
    its steps off (``results/policy-warmup-2026-12-05/README.md``). While the average is cold the
    floor alone decides. While off it probes ``probe_k`` tokens on the policy's schedule
    (``probe_every``, doubling to ``probe_max``); a probe that is accepted lifts the estimate above
    ``floor`` and switches it back on. A row that is off spends no draft token of its own: when
    every row is off the batch decodes plainly.

    A row is flagged once as collapsed (:attr:`CostAwareK.collapsed`) when its first-token
    acceptance over all its proposals, h hits of n, is below ``detect_fraction`` of the drafter's
    running average p (rows that are on, decay ``average_decay`` per proposal) and so unlikely
    that ``P(X <= h) < detect_alpha``, for X the hits of a request whose own acceptance is drawn
    from a Beta with mean p and concentration ``detect_concentration`` (:func:`beta_binomial_cdf`).
    Requests differ: prompt lookup on SmolLM2 accepts 0.05 of one
    request's first tokens and 0.6 of another's, so a test that reads every request as accepting p
    (a binomial, ``detect_concentration=None``) flagged 5.6% of clean requests and 13% of the
    calibration prompts at its ``detect_alpha`` 0.01. The defaults were chosen on 200 training
    prompts (HellaSwag contexts, GSM8K train questions) as the grid point with the most room to
    issue 17's bounds (<= 5% of clean requests flagged, >= 90% of always-wrong ones), never on
    Spec-Bench: ``results/detection-calibration-2026-12-05/``. A row that is merely unlucky is
    not flagged, one that is always wrong is after n proposals with ``P(X = 0) < detect_alpha``
    (4 at p = 0.9, 9 at p = 0.6, 30 at p = 0.3). A row that is off proposes only at its probes
    (intervals ``probe_every``, doubling), so in steps that is later still (at p = 0.6: off after
    5, probes 8, 16, 32 and 64 steps apart), and later than most requests end; probing faster would
    buy detection with draft work (a probe of a model draft costs ``probe_k`` draft forwards),
    which the defense must not spend. A drafter whose proposals are free (prompt lookup) is
    watched at every step instead (:meth:`CostAwareK.shadow`); a feature or model drafter's probe
    reads back the outcomes of the positions since its last proposal from its catch-up (up to its
    ``read_back``: 15 for F, 31 for a model draft; :meth:`CostAwareK.hindsight`): the feature draft
    F, recorded requests replayed, 0.167 of always-wrong requests flagged on its probes alone and
    0.944 with them, no clean one either way (``results/hindsight-2026-12-05/detection-e2fbab2.txt``);
    the designed draft l2 0.000 and 0.667, none clean (``results/model-hindsight-2026-12-05/``). A drafter
    whose average acceptance is low cannot tell an attacked request from an unlucky one quickly
    (l2's clean requests accept 0.04-0.49 of their first tokens; the pruned ``prune:0-14``, 0.11 on
    average, has no always-wrong request flagged with or without read-backs): it is also the
    drafter with little to collapse.

    Cold: nothing is flagged until the average rests on ``detect_warmup`` decayed proposals (the
    first requests a policy sees); those requests are still switched off by ``floor``, so an
    attacked one costs about plain decoding even when it is not flagged. The average counts
    every row that is on, the watched row included, so a request alone on a cold policy is
    compared with itself and never flagged. Measured on recorded clean and always-wrong requests
    by :mod:`specdraft.attack.detection` (``benchmarks/bench_detection.py``).

    Attributes:
        decay: weight of history in a row's acceptance estimate (per proposal).
        floor: below this first-token acceptance a row is off.
        evidence: decayed proposals needed before a row can be switched off.
        detect_fraction: flagged only below this fraction of the drafter's average acceptance.
        detect_alpha: and only when that few hits are this unlikely at the average.
        detect_concentration: ``a + b`` of the Beta the requests' acceptance is read from (the
            smaller, the more requests differ; None: all at the average, a binomial test).
        average_decay: weight of history in the drafter's average (per row proposal).
        detect_warmup: decayed proposals the average needs before any row is flagged.
        off_alpha: a row goes off only after a run of rejections this unlikely at the average.
        off_max: or after a run this long.
    """

    decay: float = 0.8
    floor: float = 0.1
    evidence: float = 2.0
    detect_fraction: float = 0.25
    detect_alpha: float = 0.002
    average_decay: float = 0.98
    detect_warmup: float = 10.0
    off_alpha: float = 0.02
    off_max: int = 8
    detect_concentration: float | None = 20.0

    def __post_init__(self):
        if not (0 < self.decay < 1 and 0 < self.average_decay < 1 and 0 <= self.floor < 1):
            raise SpecdraftError("RowWatch: need 0 < decay, average_decay < 1 and 0 <= floor < 1")
        if not (0 < self.off_alpha <= 1 and self.off_max >= 1):
            raise SpecdraftError("RowWatch: need 0 < off_alpha <= 1 and off_max >= 1")
        if not (self.evidence > 0 and 0 < self.detect_fraction <= 1 and 0 < self.detect_alpha < 1) or (
            self.detect_warmup < 0
            or (self.detect_concentration is not None and self.detect_concentration <= 0)
        ):
            raise SpecdraftError(
                "RowWatch: need evidence > 0, 0 < detect_fraction <= 1, 0 < detect_alpha < 1, "
                "detect_warmup >= 0, detect_concentration > 0 or None"
            )


@dataclass
class _Row:
    """One request's record: ``reached`` / ``accepted`` decayed counts of its proposals and of
    those whose first token was accepted (the on/off switch), ``proposals`` / ``hits`` the same
    without decay (detection), ``misses`` its current run of rejected proposals, its probe
    schedule while off, and whether its last step verified no draft token (``idle``:
    :meth:`CostAwareK.hindsight_rows`)."""

    probe_interval: int
    reached: float = 0.0
    accepted: float = 0.0
    proposals: int = 0
    hits: int = 0
    misses: int = 0
    off: bool = False
    since_probe: int = 0
    probing: bool = False
    idle: bool = False
    pending: list = field(default_factory=list)  # (class, drafted, accepted) not yet taught to the class


@dataclass(frozen=True)
class SafeArm:
    """How :class:`CostAwareK` checks its realised speed against plain decoding's, whatever its
    model of ``T(n)`` and acceptance predicts (issue 17): a bandit with a safe arm.

    Each step is timed from :meth:`CostAwareK.choose` to :meth:`CostAwareK.update` (drafting,
    verification, commit: what the model does not price included; never less than the draft and target
    times reported). Plain steps (k = 0, which happen anyway while the model says 0) give the time of a
    plain step at each batch size B, ``T_plain(B)``; a speculative step that commits m tokens over B
    rows would have cost plain decoding ``m T_plain(B) / B``, and its loss is the seconds it took beyond
    that (negative: a gain). Probes (a k the model did not choose) are left out: the probe schedule
    bounds what they cost (:meth:`RealisedRate.chose`). Per band of batch sizes (1, 2-3, 4-7, 8-15, ...)
    the verdict is a CUSUM over the speculative steps: the loss accumulated since speculation was last
    ahead, ``S = max(0, S + loss)``. Speculation stays on while ``S <= max_loss T_plain(B)``; once it
    has lost more than ``max_loss`` plain steps' time since it was last ahead, the band decodes plainly
    for ``backoff`` steps, then tries speculation again (a trial); each trial that loses as much doubles
    the back-off (up to ``backoff_max``), one that is ahead after ``evidence`` steps resets it. A plain
    step is also taken after ``refresh`` speculative ones (and before the first), so that ``T_plain(B)``
    follows the context's growth; a size not measured yet is read off the measured ones on the side that
    favours plain decoding (:meth:`RealisedRate.plain_time`).

    Why a CUSUM: the verdict before it judged a decayed ratio (about 20 steps long) at every step
    after the first ``evidence``, so a stretch of rejected drafts in a run that pays read as a loss.
    A draft a few per cent ahead of plain decoding failed about every other trial, its back-off
    doubled, and it decoded plainly most of the time (``results/policy-cusum-2026-12-05/``). The
    CUSUM ends a run that pays only after a stretch that loses ``max_loss`` plain steps net.

    The guarantee: an always-losing speculation loses at most ``max_loss`` plain steps' time plus
    one step per trial, per band, with trials after 16, 32, 64, ... plain steps (about
    ``1 + log2(N / backoff)`` trials in N steps), and the probes its model makes while it says 0
    (what they cost beyond two plain steps is at most ``1 / probe_max`` of the time,
    :meth:`CostAwareK._probe_wait`). Its cost on clean traffic is the refresh steps
    (1 in ``refresh``) and the verdicts noisy timings end early
    (``benchmarks/bench_policy.py --policies auto,auto-unguarded`` measures it).

    Attributes:
        evidence: speculative steps after which a trial that is ahead resets the back-off.
        max_loss: plain steps' time speculation may lose, net, before falling back.
        decay: weight of history in the realised speed reported (:meth:`RealisedRate.speedup`).
        margin: tolerated shortfall of realised speed against plain's (a step's seconds count
            ``1 - margin`` of themselves in its loss).
        backoff: plain steps after the first losing verdict; doubles per losing trial.
        backoff_max: the longest back-off.
        refresh: a plain step after this many speculative ones.
        plain_window: ``T_plain(B)`` is the median of this many last plain steps at B (one slow
            step on a loaded machine does not make speculation look good until the next refresh).
        clock: seconds, for the step's span (a fake one in tests).
    """

    evidence: int = 8
    max_loss: float = 4.0
    decay: float = 0.95
    margin: float = 0.0
    backoff: int = 16
    backoff_max: int = 1024
    refresh: int = 64
    plain_window: int = 5
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self):
        if not (self.evidence >= 1 and 1 <= self.backoff <= self.backoff_max and self.refresh >= 1) or not (
            0 < self.decay < 1 and self.plain_window >= 1 and 0 <= self.margin < 1 and self.max_loss > 0
        ):
            raise SpecdraftError(
                "SafeArm: need evidence >= 1, 1 <= backoff <= backoff_max, refresh >= 1, "
                "0 < decay < 1, plain_window >= 1, 0 <= margin < 1, max_loss > 0"
            )


@dataclass
class _Band:
    """One band of batch sizes' record of speculation against plain decoding (:class:`SafeArm`)."""

    backoff: int
    saved: float = 0.0  # decayed plain-equivalent seconds of the speculative steps (reported)
    spent: float = 0.0  # decayed seconds they took
    loss: float = 0.0  # CUSUM: seconds lost since speculation was last ahead
    net: float = 0.0  # seconds lost since the window (re)started (negative: gained)
    steps: int = 0  # speculative steps since the window (re)started
    off_for: int = 0  # plain steps left before the next trial
    trial: bool = False  # the window is a trial after a back-off
    since_plain: int = 0  # speculative steps since the last plain one


class RealisedRate:
    """The state of a :class:`SafeArm` check: plain step times per batch size, a :class:`_Band` per
    band; :meth:`allows` before a step, :meth:`observe` after it."""

    def __init__(self, arm: SafeArm):
        self.arm = arm
        self.samples: dict[int, list[float]] = {}  # batch size -> seconds of its last plain steps
        self.plain: dict[int, float] = {}  # batch size -> T_plain(B), their median
        self.bands: dict[int, _Band] = {}
        self.fallbacks = 0  # losing verdicts (back-offs started)
        self.forced = 0  # plain steps this check imposed
        self._start: float | None = None
        self._chosen = 0
        self._probe_step = False

    def _band(self, B: int) -> _Band:
        return self.bands.setdefault(B.bit_length(), _Band(self.arm.backoff))

    def allows(self, B: int) -> bool:
        """Start timing a step at batch size B; whether it may speculate."""
        self._start, self._chosen = self.arm.clock(), 0
        band = self._band(B)
        if band.off_for > 0:
            band.off_for -= 1
            if band.off_for == 0:  # the back-off is over: the next speculative steps are a trial
                band.saved = band.spent = band.loss = band.net = 0.0
                band.steps, band.trial = 0, True
        elif self.plain_time(B) is not None and band.since_plain < self.arm.refresh:
            return True
        self.forced += 1
        return False

    def chose(self, k: int, probe: bool = False) -> None:
        """The k the policy asked for at the step being timed, and whether that is a probe (its
        model said 0): a probe is exploration, which the probe schedule prices and spaces
        (:meth:`CostAwareK._probe_wait`), so it is left out of the verdict on the model's choices.
        Before, a probe that failed counted as a lost speculative step: a feature draft's probe,
        a catch-up over up to ``max_lag`` pairs and a draft of ``probe_k`` tokens, loses about one
        plain step when rejected, so four failed probes ended speculation for a back-off that
        doubled, however well the model's own choices did (results/hindsight-2026-12-05/)."""
        self._chosen, self._probe_step = k, probe

    def observe(self, k: int, committed: int, B: int, reported: float) -> None:
        """A step of B rows, k draft tokens proposed (0: none), ``committed`` tokens, ``reported``
        seconds of drafting and verification; the span since :meth:`allows` is taken if longer."""
        if self._start is None or B == 0:
            return
        seconds = max(self.arm.clock() - self._start, reported)
        self._start, band = None, self._band(B)
        if self._probe_step:
            return
        if k == 0 and self._chosen == 0:  # a plain step
            last = [*self.samples.get(B, []), seconds][-self.arm.plain_window :]
            self.samples[B], self.plain[B] = last, statistics.median(last)
            band.since_plain = 0
            return
        plain = self.plain_time(B)
        if plain is None:
            return
        d, equivalent = self.arm.decay, committed * plain / B
        band.saved = d * band.saved + equivalent
        band.spent = d * band.spent + seconds
        loss = (1 - self.arm.margin) * seconds - equivalent
        band.loss, band.net = max(0.0, band.loss + loss), band.net + loss
        band.steps += 1
        band.since_plain += 1
        losing = self._verdict(band, plain)
        if losing is False and band.trial:  # a trial that is ahead: the back-off starts over
            band.trial, band.backoff = False, self.arm.backoff
        if not losing:
            return
        self.fallbacks += 1
        band.off_for = band.backoff
        band.backoff = min(2 * band.backoff, self.arm.backoff_max)
        band.steps, band.trial, band.loss = 0, False, 0.0

    def _verdict(self, band: _Band, plain: float) -> bool | None:
        """Whether the band's speculation is losing (True: fall back), ahead after ``evidence``
        steps (False), or not judged yet (None) (:class:`SafeArm`: a CUSUM of its losses)."""
        if band.loss > self.arm.max_loss * plain:
            return True
        return False if band.steps >= self.arm.evidence and band.net <= 0 else None

    def plain_time(self, B: int) -> float | None:
        """Seconds of a plain step at batch size B: measured, else estimated on the safe side (never
        above the truth for a step time that grows with B while its time per row falls): on the
        line between the nearest measured sizes, flat above the largest, proportional to B below
        the smallest. None before any plain step. Rows that leave a batch need no new plain step."""
        if B in self.plain or not self.plain:
            return self.plain.get(B)
        below = max((b for b in self.plain if b < B), default=None)
        above = min((b for b in self.plain if b > B), default=None)
        if below is None:
            return self.plain[above] * B / above
        if above is None:
            return self.plain[below]
        w = (B - below) / (above - below)
        return (1 - w) * self.plain[below] + w * self.plain[above]

    def speedup(self, B: int) -> float | None:
        """Realised speed of speculation over plain decoding in B's band (decayed), None before any."""
        band = self._band(B)
        return band.saved / band.spent if band.spent > 0 else None


def binomial_cdf(h: int, n: int, p: float) -> float:
    """``P(X <= h)`` for ``X ~ Binomial(n, p)``."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(h + 1))


def beta_binomial_cdf(h: int, n: int, p: float, concentration: float) -> float:
    """``P(X <= h)`` for X the hits of n trials whose success rate is drawn once from a Beta with
    mean p and ``a + b = concentration`` (requests whose acceptance differs from request to request
    around the drafter's average p); :func:`binomial_cdf` as the concentration grows. Written out
    (a few log-gamma terms) rather than taken from scipy, which nothing else here needs."""
    a, b = max(p, 1e-9) * concentration, max(1 - p, 1e-9) * concentration
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    return sum(
        math.comb(n, i)
        * math.exp(math.lgamma(i + a) + math.lgamma(n - i + b) - math.lgamma(n + a + b) - log_beta)
        for i in range(h + 1)
    )


class CostAwareK:
    """Choose k by the analytic model with latencies and per-position acceptance measured online.

    For each class of proposal (one class unless the drafter sets ``Proposal.bucket``) it keeps
    the conditional acceptance ``c_j = P(draft j accepted | drafts 1..j-1 accepted)`` from counts
    that decay by ``decay`` per observation (a position not yet measured takes the rate of the
    one before; the first starts from a pseudo-count at 0.5), and predicts

        E[tokens | k] = 1 + sum_{j<=k} prod_{i<=j} c_i          (analytic.expected_tokens_from_rates)
        T_step(k)     = k * T_draft + T_target(k + 1)           (analytic.step_time)

    with ``T_target(n)`` measured per n (:meth:`latency`). It asks for the k that maximises
    E[tokens | k] / T_step(k) (the most any class would verify, for a drafter with classes), and
    :meth:`trim` cuts each row to its class's best length, the draft cost then being spent
    already. A single alpha, as
    before, misjudges drafts whose acceptance comes in bursts: prompt lookup after a 3-token match
    is accepted ~0.8 of the time here, after a 1-token match ~0.2.

    Given the rows' request ids, it also watches each row (:class:`RowWatch`): a row whose drafts
    keep failing is cut to 0 while the others draft, probes, recovers, and may be flagged in
    :attr:`collapsed`; such a row no longer teaches the class curves, and a row's proposals teach
    them only once one of its drafts has been accepted (until then they wait in ``_Row.pending``).
    A row's cut reads only its earlier steps, never the tokens proposed now, so sampling stays
    lossless. In a batch, a chain step pads every row to the longest, so the rows are then cut to
    the one length that maximises their summed expected tokens per padded step time
    (:meth:`_batch_cap`; rows due for a probe keep theirs). On a runtime with ragged steps
    (:attr:`ragged`, set by the engine) each row feeds only its own tokens: a step's time is a line
    in the draft tokens the batch fed, one line per batch size (:meth:`latency`; where a draft token
    costs about what a token of a plain step does, as in this CPU's batch-8 steps, only near-certain
    drafts pay), and the batch keeps the draft positions with the best expected gain instead of
    cutting every row to one length.

    A draft model that was off catches up on the tokens committed meanwhile before it drafts (its
    cache lags; after a long prompt, the whole prompt): the engine passes each row's ``lag`` to
    :meth:`choose`, the draft time is fitted as ``T_draft k + T_lag x`` (x: the catch-up tokens
    beyond a steady step's, :attr:`t_lag`), so ``T_draft`` is not inflated by catch-ups, and a
    probe that costs more than a plain step waits in proportion (:meth:`_probe_wait`): what it
    costs beyond two plain steps takes at most ``1 / probe_max`` of the time.

    The model can be wrong (a latency curve read between sizes, a tree's budget read as its depth,
    work it does not price), so its choice is checked against the clock (:class:`SafeArm`): per
    band of batch sizes, speculative steps' realised tokens per second against plain steps'; when
    speculation is slower, the band decodes plainly for a back-off that doubles while trials keep
    losing. :attr:`rate` holds that record (``fallbacks``, ``forced``, ``speedup(B)``).

    Token trees (``Proposal.trees``): k is the node budget ("at most k nodes"). ``T_target(k + 1)``
    is the same latency curve (a forward over a root and k nodes costs what k + 1 chain tokens
    do), and the acceptance curve is learned per depth (``c_j``: the accepted path reaches depth
    j + 1 given depth j), so the budget chosen, 0 included, is the one whose predicted accepted
    length per step time is highest, reading a budget of k nodes as depth k (optimistic for
    bushy trees: a tree's accepted length is at most its depth). :meth:`trim` does not cut trees;
    a row it cuts to 0 (switched off) verifies none.

    Args:
        k_max: largest k considered.
        k_start: k used until the first measurements arrive.
        decay: weight of history in the moving averages and the acceptance counts.
        probe_every: at k = 0, try ``probe_k`` once every this many steps at first.
        probe_max: the longest interval between probes (after failed probes doubled it).
        watch: per-row watching (None: one policy for the whole batch, as before issue 17).
        guard: the check of realised speed against plain decoding (:class:`SafeArm`; None: the
            model's choice unchecked).
        latency_window: ``T_target(n)`` is the median of the last this many steps that fed n
            tokens per row. One slow step (a busy machine) could otherwise stick to a size the
            policy then stops choosing: a size not chosen is not measured again, so an
            exponential average kept the slow step's share until the end of a run. Ragged steps:
            a draft token's cost at B rows, the same way (:class:`_StepLine`).
    """

    def __init__(
        self,
        k_max: int = 8,
        k_start: int = 3,
        decay: float = 0.9,
        probe_every: int = 8,
        probe_k: int = 2,
        probe_max: int = 64,
        watch: RowWatch | None = RowWatch(),
        guard: SafeArm | None = SafeArm(),
        latency_window: int = 5,
    ):
        if (
            latency_window < 1
            or not 1 <= k_start <= k_max
            or not 0 < decay < 1
            or not 1 <= probe_k <= k_max
            or not 1 <= probe_every <= probe_max
        ):
            raise SpecdraftError(
                "CostAwareK: need 1 <= k_start, probe_k <= k_max, 0 < decay < 1, 1 <= probe_every <= "
                "probe_max, latency_window >= 1"
            )
        self.k_max, self.k_start, self.decay = k_max, k_start, decay
        self.probe_every, self.probe_k, self.probe_max = probe_every, probe_k, probe_max
        self.t_draft: float | None = None  # seconds per draft token
        self.t_lag = 0.0  # seconds per catch-up token (ModelDrafter.catch_up beyond a steady step)
        # draft time ~ t_draft u + t_lag x (u: draft tokens, 1 per step for a block drafter; x:
        # catch-up tokens, _catch); unseparated, each as if it took all of it (pessimistic)
        self.draft_fit = _Fit2(decay)
        self._catch = 0  # catch-up tokens of the step being chosen (from choose's lag)
        self.t_target: dict[int, float] = {}  # tokens fed -> seconds (the median of _target_samples)
        self._target_samples: dict[int, list[float]] = {}  # tokens fed -> its last steps' seconds
        self.latency_window = latency_window
        self.curves: dict[int | None, _Curve] = {}  # class -> acceptance (None: a drafter without classes)
        self.classes: bool | None = (
            None  # whether the drafter classifies its proposals (seen at the first update)
        )
        self._times: list[float] | None = None  # cached T_target(1 .. k_max + 1)
        self._times_at = 0  # the batch size they were read at
        self.last_k = k_start
        self.watch = watch
        self.row_state: dict[int, _Row] = {}  # request id -> its own record
        self.collapsed: set[int] = set()  # request ids flagged (of the rows still in the batch)
        self.average = [0.0, 0.0]  # the drafter's first-token (reached, accepted), rows that are on
        # ragged chain steps (each row feeds only its own 1 + k_b tokens; the engine sets it from
        # the runtime): a line per batch size B in the draft tokens the batch fed (_StepLine)
        self.ragged = False
        self.step_lines: dict[int, _StepLine] = {}
        # a block drafter (one draft forward per step whatever k; the engine sets it from the
        # drafter's ``drafts_blocks``): T_draft is per step, charged once (analytic.step_time)
        self.per_block = False
        self.rate = RealisedRate(guard) if guard is not None else None  # the safe arm's record
        self._batch = 1  # rows at the last update (the batch size when choose() is not told the rows)
        self._probing = False  # the k chosen is a probe (the model said 0)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def latency(self, B: int | None = None) -> analytic.LatencyCurve:
        """T_target(n) as measured so far (at the batch size being decoded), read through
        :class:`specdraft.analytic.LatencyCurve`: linear between and beyond the measured n, flat
        while only one n is measured (optimistic until the next size is measured).

        Ragged steps: ``T(n) = t_plain + s B (n - 1)`` at n mean tokens per row over B rows (default:
        the last step's), the line of the steps seen at B (:class:`_StepLine`), or once some counts
        x of draft tokens have costs of their own, the curve through them at n = 1 + x / B
        (:meth:`_ragged_points`); the table above while no plain step at B is seen."""
        B = B or self._batch
        points = self._ragged_points(B)
        return analytic.LatencyCurve({1: self.t_target if points is None else points})

    def _ragged_points(self, B: int) -> dict[float, float] | None:
        """A ragged step's time at B rows by tokens per row n = 1 + x / B (:meth:`latency`): through
        ``t_plain`` and, for each x that has its own cost (:class:`_StepLine`), ``t_plain`` plus it;
        the line of :meth:`slope` while none has. None when steps are not ragged or no plain step at
        B is timed yet."""
        line = self.step_lines.get(B) if self.ragged else None
        if line is None or line.t_plain is None:
            return None
        t, nearest = line.t_plain, self._nearest_line(B)
        need = self.latency_window // 2 + 1
        own = {} if nearest is None else {x: v for x, v in nearest.by_x.items() if len(v) >= need}
        if own:
            return {1: t, **{1 + x / B: t + max(statistics.median(v), 0.0) * x for x, v in own.items()}}
        s = self.slope(B)
        s = t / B if s is None else s  # a plain step's cost per token: never favours drafts
        return {1: t, 2: t + s * B}

    def _nearest_line(self, B: int) -> _StepLine | None:
        """The line of the batch size nearest B with speculative steps timed (the smaller on a tie:
        a token's share of the weights' reading is larger there); None before any."""
        measured = [b for b, line in self.step_lines.items() if line.per_token]
        return self.step_lines[min(measured, key=lambda b: (abs(b - B), b))] if measured else None

    def slope(self, B: int) -> float | None:
        """Seconds per draft token of a ragged step at B rows (:class:`_StepLine`), all x together:
        as measured at B, else at the nearest batch size where it was (:meth:`_nearest_line`); None
        before any speculative ragged step. Borrowed because the batch shrinks as rows finish: a new
        size needs only its plain step timed."""
        line = self._nearest_line(B)
        return None if line is None else max(statistics.median(line.per_token), 0.0)

    def _plain_timed(self, B: int | None = None) -> bool:
        """Whether plain steps have been timed (ragged: at B rows, default the batch's size)."""
        if not self.ragged:
            return 1 in self.t_target
        line = self.step_lines.get(B or self._batch)
        return line is not None and line.t_plain is not None

    def _drafts_timed(self) -> bool:
        """Whether what a draft token adds to a step was measured (ragged: :meth:`slope`; else the
        table's reading is optimistic until then). Before, trim() cuts nothing: the step that
        times them has to verify some (a plain step's share per token would cut them all)."""
        return not self.ragged or self.slope(self._batch) is not None

    def _step_times(self) -> list[float]:
        """``T_target(1 .. k_max + 1)`` at the current batch size, cached until the next update."""
        if self._times is None:
            self._times, self._times_at = self.latency().times(self.k_max + 1), self._batch
        return self._times

    def _curve(self, bucket: int | None) -> _Curve:
        if bucket not in self.curves:
            self.curves[bucket] = _Curve(
                [0.0] * self.k_max, [0.0] * self.k_max, probe_interval=self.probe_every
            )
        return self.curves[bucket]

    def rates(self, bucket: int | None = None) -> list[float]:
        """Estimated ``c_j`` for draft positions 1..k_max of a class."""
        cur = self._curve(bucket)
        if cur.rates is None:
            cur.rates, prev = [], 0.5
            for reached, accepted in zip(cur.reached, cur.accepted):
                prev = (accepted + prev) / (reached + 1.0)  # one pseudo-count at the previous rate
                cur.rates.append(prev)
        return cur.rates

    def expected_tokens(self, k: int, bucket: int | None = None) -> float:
        return analytic.expected_tokens_from_rates(self.rates(bucket), k)

    def _best(self, bucket: int | None, t_draft: float) -> int:
        """The k in 0..k_max with the highest E[tokens | k] / T_step(k) for a class."""
        calls = (lambda k: min(k, 1)) if self.per_block else None
        rates = self.rates(bucket)[: self.k_max]
        return analytic.best_k_from_rates(rates, t_draft, self._step_times(), calls)

    def _probe_overhead(self) -> float:
        """What a probe costs beyond a plain step, in plain steps: its draft tokens, the draft's
        catch-up (:attr:`t_lag` per token of ``_catch``) and the wider verification, over
        ``T_target(1)``; 0 before those are measured."""
        if self.t_draft is None or not self._plain_timed():
            return 0.0
        times = self._step_times()
        drafts = 1 if self.per_block else self.probe_k
        extra = drafts * self.t_draft + self.t_lag * self._catch + times[self.probe_k] - times[0]
        return extra / times[0] if times[0] > 0 else 0.0

    def _probe_wait(self, interval: int, overhead: float) -> float:
        """Steps from one probe to the next for a probe costing ``overhead`` plain steps beyond a
        plain step (:meth:`_probe_overhead`): ``interval`` times max(1, overhead), and at least
        ``probe_max (overhead - 1)``, so that what a probe costs beyond two plain steps takes at
        most ``1 / probe_max`` of the time (a draft catching up on a long context)."""
        return max(interval * max(1.0, overhead), self.probe_max * (overhead - 1))

    def _probe(self, cur: _Curve, best: int) -> int:
        """``best``, or ``probe_k`` when a class at 0 is due for a probe (:meth:`_probe_wait`)."""
        if best > 0:
            return best
        cur.since_probe += 1
        if cur.since_probe < cur.probe_interval:  # the wait is never shorter (_probe_wait): not priced
            return 0
        if cur.since_probe < self._probe_wait(cur.probe_interval, self._probe_overhead()):
            return 0
        cur.since_probe, cur.probing = 0, True
        return self.probe_k

    def _follow(self, rows: list[int]) -> list[_Row]:
        """The rows' records (new ones for rows that joined; those of rows that left dropped), each
        off row one step nearer its probe."""
        keep, overhead = set(rows), None  # overhead: one probe's cost, the same for every row
        for gone in [r for r in self.row_state if r not in keep]:
            del self.row_state[gone]
        self.collapsed &= keep
        out = []
        for r in rows:
            if r not in self.row_state:
                self.row_state[r] = _Row(self.probe_every)
            row = self.row_state[r]
            if row.off and not row.probing:
                row.since_probe += 1
                if row.since_probe >= row.probe_interval:  # the wait is never shorter (_probe_wait)
                    overhead = self._probe_overhead() if overhead is None else overhead
                    if row.since_probe >= self._probe_wait(row.probe_interval, overhead):
                        row.since_probe, row.probing = 0, True
            out.append(row)
        return out

    def choose(self, rows: list[int] | None = None, lag: torch.Tensor | None = None) -> int:
        if rows is not None and len(rows) != self._batch:
            self._batch, self._times = len(rows), None
        lags = [] if lag is None else lag.tolist()
        self._catch = len(lags) * max(max(lags, default=0) - 1, 0)
        states = self._follow(rows) if rows is not None and self.watch is not None else []
        if self.rate is None:
            return self._choose(states)
        if not self.rate.allows(len(rows) if rows is not None else self._batch):
            self.last_k = 0  # the safe arm: plain decoding (SafeArm)
            return 0
        k = self._choose(states)
        self.rate.chose(k, self._probing)
        return k

    def _choose(self, states: list[_Row]) -> int:
        """The model's k (the row watch's and the probes' included) for rows ``states``, before the
        safe arm's check."""
        model = 0  # the k the model chose, probes aside (_probing: a k > 0 it did not choose)
        if self.t_draft is None or not self._plain_timed():
            # measure: a speculative step first, then one plain step (at each new batch size when
            # steps are ragged) for T_target(1)
            k = model = self.k_start if self.t_draft is None else 0
        elif states and all(s.off for s in states):  # nobody drafts but the rows due for a probe
            k = self.probe_k if any(s.probing for s in states) else 0
        elif not self.classes:  # a drafter without classes: decide here
            model = self._best(None, self.t_draft)
            k = self._probe(self._curve(None), model)
        else:
            k, model = self._class_k(states)
        self.last_k, self._probing = k, k > 0 and model == 0
        return k

    def _class_k(self, states: list[_Row]) -> tuple[int, int]:
        """A drafter with classes (known only once it has proposed): what the most promising class
        learned would use, trim() cutting each row to its own class's; ``probe_k`` while no class
        is learned, or when a class that does not pay is due for its probe (:meth:`_probe`, a tick
        per step) or a row is; else 0: no proposal would be verified, so none is made (proposing
        and cutting take time of their own: results/batch-overhead-2026-12-05/README.md). Also the
        k the model chose, probes aside."""
        learned = [(b, cur) for b, cur in self.curves.items() if cur.reached[0] > 0]
        if not learned:
            return self.probe_k, self.probe_k
        best = {b: self._best(b, self.t_draft) for b, _ in learned}
        k = max(self._probe(cur, best[b]) for b, cur in learned)
        return max(k, self.probe_k if any(s.probing for s in states) else 0), max(best.values())

    def trim(
        self, num_valid: torch.Tensor, bucket: torch.Tensor | None, rows: list[int] | None = None
    ) -> torch.Tensor:
        valid = num_valid.tolist()  # lists, not tensors: this runs at every speculative step
        classes = bucket.tolist() if bucket is not None else [None] * len(valid)
        caps, fresh = valid, set()  # fresh: classes not learned yet, their first proposals teach them
        # (cut to their best, or to a probe's length, never to 0)
        # a drafter without classes too: a probe that read-backs (hindsight) ended before this trim
        # verifies only what its curve now says pays (results/feature-draft-cost-2026-12-05/)
        if self.t_draft is not None and self._plain_timed() and self._drafts_timed():
            by_class: dict[int, int] = {}  # its best k now the drafting is done, or its probe
            for b in set(classes):
                cur, best = self._curve(b), self._best(b, 0.0)
                if cur.reached[0] == 0:
                    fresh.add(b)
                by_class[b] = best or (self.probe_k if cur.probing or b in fresh else 0)
            caps = [min(v, by_class[b]) for v, b in zip(valid, classes)]
        if rows is None or self.watch is None:
            return num_valid if caps is valid else torch.tensor(caps, dtype=num_valid.dtype)
        # a row that is off verifies nothing, or probe_k tokens when its probe is due
        row_caps, probing = [], []
        for r, cap, v, b in zip(rows, caps, valid, classes):
            row = self.row_state.get(r)
            off = row is not None and row.off
            probing.append(b in fresh or (off and row.probing))
            row_caps.append(min(v, self.probe_k if row.probing else 0) if off else cap)
        return torch.tensor(self._batch_cap(row_caps, classes, probing), dtype=num_valid.dtype)

    def _batch_cap(self, caps: list[int], classes: list, probing: list[bool]) -> list[int]:
        """Cut the rows to one length K when that pays for the batch: a chain step pads every row
        to the longest, so K maximises the rows' summed expected tokens per padded step time
        (:meth:`latency` at this batch size). Rows due for a probe keep theirs, as do rows of a class
        not learned yet (else a batch where drafts look dear would never learn one). It reads only what
        earlier steps taught and the rows' classes, as the per-row cut does. Ragged steps:
        :meth:`_ragged_cap`."""
        B = len(caps)
        if B < 2 or max(caps) == 0 or not self._plain_timed(B) or not self._drafts_timed():
            return caps
        curve = self.latency(B)
        if self.ragged:
            return self._ragged_cap(caps, classes, probing, curve)

        def rate(K: int) -> float:
            tokens = sum(self.expected_tokens(min(K, c), b) for c, b in zip(caps, classes))
            return tokens / curve.time(K + 1)

        K = max(range(max(caps) + 1), key=rate)
        return [c if p else min(c, K) for c, p in zip(caps, probing)]

    def _ragged_cap(self, caps: list[int], classes: list, probing: list[bool], curve) -> list[int]:
        """A ragged step costs ``T(1 + n / B) = t_plain + s n`` for n draft tokens over B rows
        (:class:`_StepLine`), whichever rows feed them; draft position j of a row gains
        ``P_j = c_1 ... c_j`` expected tokens (non-increasing in j). So the n positions kept are the n
        best gains of the batch (a prefix of each row), n maximising
        ``(B + sum of their gains) / T(1 + n / B)``. Rows due for a probe keep theirs."""
        B = len(caps)
        out = [c if p else 0 for c, p in zip(caps, probing)]
        gains = sorted(
            (-gain, j, row)
            for row, (c, b, p) in enumerate(zip(caps, classes, probing))
            if not p
            for j, gain in enumerate(itertools.accumulate(self.rates(b)[:c], operator.mul))
        )
        tokens = sum(self.expected_tokens(c, b) for c, b in zip(out, classes))
        fixed = sum(out)
        rates = [tokens / curve.time(1 + fixed / B)]
        for n, (neg_gain, _, _) in enumerate(gains, 1):
            tokens -= neg_gain
            rates.append(tokens / curve.time(1 + (fixed + n) / B))
        for _, _, row in gains[: max(range(len(rates)), key=rates.__getitem__)]:
            out[row] += 1
        return out

    def update(
        self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None, width=None
    ) -> None:
        drafts, accepts = num_drafted.tolist(), num_accepted.tolist()  # lists: this runs at every step
        self._batch = len(accepts) or self._batch
        if rows is not None and self.watch is not None:
            for r, d in zip(rows, drafts):
                if r in self.row_state:
                    self.row_state[r].idle = k == 0 or d == 0
        if self.rate is not None:
            self.rate.observe(k, sum(accepts) + len(accepts), len(accepts), draft_time + target_time)
        drafted = max(drafts, default=0)
        # the target scored drafted + 1 tokens per row (fewer than k + 1 when a drafter such as
        # prompt lookup found less to propose or trim() cut it), or a tree's nodes + 1 (width):
        # that is the size this time belongs to
        fed = drafted + 1 if width is None else width
        line = self.step_lines.get(len(accepts)) if self.ragged else None
        plain_before = None if line is None else line.t_plain  # B's before this step (ragged steps)
        if self.ragged:  # rows fed 1 + num_drafted[b] each (a tree: width each)
            self._line(len(accepts), sum(drafts), width, target_time)
        if not self.ragged or fed == 1:
            last = [*self._target_samples.get(fed, []), target_time][-self.latency_window :]
            self._target_samples[fed], self.t_target[fed] = last, statistics.median(last)
        self._times = self._shifted(len(accepts), plain_before, fed)
        if k > 0:  # the drafter ran, whatever trim() kept
            self.draft_fit.add(1 if self.per_block else k, self._catch, draft_time)
            self.t_draft, self.t_lag = self.draft_fit.solve()
            if self.classes is None:  # known from its first proposal, even one trim() cut
                self.classes = bucket is not None
        if k == 0 or drafted == 0:
            return
        classes = bucket.tolist() if bucket is not None else [None] * len(drafts)
        ids = rows if rows is not None and self.watch is not None else [None] * len(drafts)
        for b, d, a, r in zip(classes, drafts, accepts, ids):
            if d == 0:
                continue
            if r is not None:
                if not self._observe_row(r, a):
                    continue  # a row that is off (this was its probe) does not teach its class
                row = self.row_state[r]
                if row.hits == 0:  # held back until the row has had a draft accepted, dropped if it
                    # goes off first: rows under attack do not teach the other rows' classes
                    row.pending = [] if row.off else [*row.pending, (b, d, a)]
                    continue
                for pending in row.pending:
                    self._learn(*pending)
                row.pending = []
            self._learn(b, d, a)

    def _shifted(self, B: int, plain_before: float | None, fed: int) -> list[float] | None:
        """The cached step times after a plain ragged step at B rows, the size they were read at,
        moved by what the step moved B's ``t_plain``: once a draft token's cost is measured, every
        point of :meth:`_ragged_points` is ``t_plain`` plus a cost that only speculative steps change,
        so reading the curve again at every plain step (work in Python right after a forward, where it
        is slowest) gives the same times. None (read again) after any other step."""
        if self._times is None or plain_before is None or fed != 1 or self._times_at != B:
            return None
        if self._nearest_line(B) is None:  # no cost measured: a plain step's share per token
            return None
        move = self.step_lines[B].t_plain - plain_before
        return [t + move for t in self._times]

    def _line(self, B: int, drafted: int, width: int | None, seconds: float) -> None:
        """A ragged step (``drafted`` draft tokens over B rows) into its batch size's line
        (:class:`_StepLine`)."""
        line = self.step_lines.setdefault(B, _StepLine())
        x = B * (width - 1) if width is not None else drafted
        if x == 0:
            line.t_plain = self._ema(line.t_plain, seconds)
        elif line.t_plain is not None:
            cost = (seconds - line.t_plain) / x
            line.per_token = [*line.per_token, cost][-self.latency_window :]
            line.by_x[x] = [*line.by_x.get(x, []), cost][-self.latency_window :]

    def _learn(self, b: int | None, d: int, a: int) -> None:
        """Add one row's proposal of class b (d drafts verified, a accepted) to the class's curve."""
        cur = self._curve(b)
        self._add(cur, d, a)
        self._probed(b, cur)

    def _add(self, cur: _Curve, d: int, a: int) -> None:
        """One proposal (d drafts verified, a accepted) into a curve's decayed counts."""
        cur.rates = None
        for j in range(self.k_max):
            cur.reached[j] *= self.decay
            cur.accepted[j] *= self.decay
        for j in range(min(d, self.k_max)):  # position j was verified if drafts 0..j-1 all held
            # (a fractional count spreads over two positions)
            cur.reached[j] += min(max(a - j + 1, 0.0), 1.0)
            cur.accepted[j] += min(max(a - j, 0.0), 1.0)

    def _probed(self, b: int | None, cur: _Curve) -> None:
        """A class's probe ends at its first lesson: the interval starts over if it pays now, else
        doubles."""
        if cur.probing:  # did the probe change the verdict?
            cur.probing = False
            pays = self._best(b, self.t_draft if b is None else 0.0) > 0
            cur.probe_interval = self.probe_every if pays else min(2 * cur.probe_interval, self.probe_max)

    def _observe_row(self, r: int, accepted: int) -> bool:
        """Record row r's proposal (its first token accepted or not), switch it off or on, flag it;
        whether it was on (a proposal its class may learn from)."""
        w = self.watch
        row = self.row_state.setdefault(r, _Row(self.probe_every))
        hit = accepted >= 1
        rate = self._count(row, hit)
        was_on = not row.off
        if row.off:  # this was a probe
            row.probing = False
            if not self._back_on(row, rate):
                row.probe_interval = min(2 * row.probe_interval, self.probe_max)
        elif row.reached >= w.evidence and rate < w.floor and self._rare_run(row.misses):
            row.off, row.since_probe = True, 0
        if was_on:
            self.average = [
                w.average_decay * self.average[0] + 1.0,
                w.average_decay * self.average[1] + hit,
            ]
        self._detect(r, row)
        return was_on

    def _count(self, row: _Row, hit: bool) -> float:
        """Add one first-token outcome to a row's record; its decayed acceptance now."""
        w = self.watch
        row.reached = w.decay * row.reached + 1.0
        row.accepted = w.decay * row.accepted + hit
        row.proposals += 1
        row.hits += hit
        row.misses = 0 if hit else row.misses + 1
        return row.accepted / row.reached

    def _back_on(self, row: _Row, rate: float) -> bool:
        """Switch an off row on when its acceptance is back at ``floor``; whether it was."""
        if rate < self.watch.floor:
            return False
        row.off, row.probe_interval = False, self.probe_every
        return True

    def unverified(self, rows: list[int]) -> list[int]:
        """Of ``rows`` (request ids, after :meth:`choose`), those the row watch has switched off
        and that are not due for a probe: they verify nothing at this step."""
        if self.watch is None:
            return []
        state = self.row_state
        return [r for r in rows if r in state and state[r].off and not state[r].probing]

    def shadow(self, rows: list[int], hits: list[bool]) -> None:
        """First-token outcomes of proposals that were made but not verified for rows that are
        off (:meth:`unverified`): a drafter whose proposals cost nothing (prompt lookup,
        ``proposes_free``) proposes for them anyway, any drafter does at a step where the batch
        drafts (greedy rows only: ``Engine._shadowed``), and the engine compares each proposal's first
        token with the token the target committed there, which is the first draft token's fate
        under verification (greedy; sampling with a point-mass draft: accepted with probability
        p(x), the probability that the target's own sample is x). Such an outcome counts as a
        probe's does for the row (it can switch it back on, and it counts toward detection),
        without the probe's cost: an attacked row gets the evidence of every step, a clean row
        off by bad luck is back on at its next hit. It teaches neither the drafter's average nor
        the class curves (the row is off), and a miss does not lengthen the probe interval."""
        for r, hit in zip(rows, hits):
            row = self.row_state.get(r) if self.watch is not None else None
            if row is not None and row.off:
                self._off_outcome(r, row, hit)

    def _off_outcome(self, r: int, row: _Row, hit: bool) -> None:
        """An off row's first-token outcome of a proposal not verified: counted, maybe back on, and
        toward detection (:meth:`shadow`, :meth:`hindsight`)."""
        self._back_on(row, self._count(row, hit))
        self._detect(r, row)

    def hindsight_rows(self, rows: list[int]) -> list[bool] | None:
        """Of ``rows`` (request ids, after :meth:`choose`), those whose last step verified no draft
        token (the policy at k = 0, or the row off): a feature or model drafter's catch-up at this step
        runs over positions the target committed by itself and can read back how proposals
        there would have fared (``Proposal.hindsight``, :meth:`hindsight`). Only those: after a
        speculative step, the positions a catch-up reads follow accepted drafts, which acceptance
        (in bursts) favours. None without a row watch."""
        if self.watch is None:
            return None
        state = self.row_state
        return [r in state and state[r].idle for r in rows]

    def hindsight(self, rows: list[int], outcomes: list[list[bool]]) -> None:
        """First-token outcomes a drafter read back at positions committed without a proposal
        (:meth:`hindsight_rows`; greedy rows), told before :meth:`trim`. A row that is off takes
        them as :meth:`shadow` outcomes (they may switch it back on; they count toward detection),
        one that is on as proposals of its own (:meth:`_observe_row`: the drafter's average, the
        switch, detection), and a drafter without classes learns them at its curve's first
        position: a probe after a stretch at k = 0 teaches what ``max_lag`` proposals there would
        have, where it taught one (a feature draft F near its break-even stayed at k = 0 for most
        of a run on an estimate of about ten decayed proposals, results/feature-q8-2026-12-05/)."""
        for r, hits in zip(rows, outcomes):
            row = self.row_state.get(r) if self.watch is not None else None
            if row is None or not row.idle or not hits:
                continue
            cur, learned = (None if self.classes else self._curve(None)), False
            for hit in hits:
                if row.off:
                    self._off_outcome(r, row, hit)
                elif self._observe_row(r, hit) and row.hits > 0 and cur is not None:
                    self._add(cur, 1, int(hit))
                    learned = True
            if learned:
                self._probed(None, cur)

    def _rare_run(self, misses: int) -> bool:
        """Whether a run of ``misses`` rejected proposals is rare for a row of this drafter
        (:class:`RowWatch`: ``off_alpha``, ``off_max``); True while the average is cold."""
        w = self.watch
        if misses >= w.off_max or self.average[0] < max(w.detect_warmup, 1.0):
            return True
        return (1 - self.average[1] / self.average[0]) ** misses < w.off_alpha

    def _detect(self, r: int, row: _Row) -> None:
        """Flag row r once when its acceptance is far below, and implausibly low for, the average."""
        w = self.watch
        if r in self.collapsed or self.average[0] < max(w.detect_warmup, 1.0):
            return
        p = self.average[1] / self.average[0]
        if row.hits < w.detect_fraction * p * row.proposals and self._unlikely(row.hits, row.proposals, p):
            self.collapsed.add(r)

    def _unlikely(self, h: int, n: int, p: float) -> bool:
        """Whether h hits of n are below ``detect_alpha`` at the drafter's average p, requests
        spread around it as :attr:`RowWatch.detect_concentration` says (None: a binomial)."""
        w = self.watch
        if w.detect_concentration is None:
            return binomial_cdf(h, n, p) < w.detect_alpha
        return beta_binomial_cdf(h, n, p, w.detect_concentration) < w.detect_alpha

    @property
    def probe_interval(self) -> int:
        """The current probe interval of a drafter without classes."""
        return self.curves[None].probe_interval if None in self.curves else self.probe_every

    def __repr__(self) -> str:
        curves = {b: round(self.expected_tokens(self.last_k, b), 2) for b in self.curves}
        return f"CostAwareK(t_draft={self.t_draft}, k={self.last_k}, E[tokens | k] per class={curves})"


def make_policy(spec: str | int) -> KPolicy:
    """``"5"`` / 5 -> FixedK(5); ``"auto"`` -> CostAwareK; ``"heuristic"`` -> HeuristicK."""
    if isinstance(spec, int):
        return FixedK(spec)
    s = str(spec).strip().lower()
    if s == "auto":
        return CostAwareK()
    if s == "heuristic":
        return HeuristicK()
    try:
        return FixedK(int(s))
    except ValueError:
        raise SpecdraftError(f"--k must be an integer >= 0, 'auto' or 'heuristic', got {spec!r}") from None


def _inner_flag(name: str) -> property:
    """A wrapper's view of its inner policy's :class:`CostAwareK` flag ``name``: False (and setting it
    does nothing) for an inner policy that does not price steps."""

    def set_flag(self, value: bool) -> None:
        if hasattr(self.inner, name):
            setattr(self.inner, name, value)

    return property(
        lambda self: getattr(self.inner, name, False), set_flag, doc=f"The inner policy's ``{name}``."
    )


class CappedPolicy:
    """Any policy, with its k bounded by ``cap`` (None: no bound), set by the caller before each step.

    The server sets ``cap`` to the largest per-request cap in the batch;
    :class:`specdraft.drafters.capped.RowCappedDrafter` then cuts each row to its own cap.
    """

    def __init__(self, inner: KPolicy):
        self.inner = inner
        self.cap: int | None = None
        self.k_max = inner.k_max  # the cap only lowers k: the inner policy's room suffices

    @property
    def collapsed(self) -> set[int]:
        return self.inner.collapsed

    ragged = _inner_flag("ragged")
    per_block = _inner_flag("per_block")

    def choose(self, rows: list[int] | None = None, lag: torch.Tensor | None = None) -> int:
        k = self.inner.choose(rows, lag)
        return k if self.cap is None else min(k, self.cap)

    def trim(
        self, num_valid: torch.Tensor, bucket: torch.Tensor | None, rows: list[int] | None = None
    ) -> torch.Tensor:
        return self.inner.trim(num_valid, bucket, rows)

    def update(
        self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None, width=None
    ) -> None:
        self.inner.update(k, num_drafted, num_accepted, draft_time, target_time, bucket, rows, width)

    def unverified(self, rows: list[int]) -> list[int]:
        return self.inner.unverified(rows) if hasattr(self.inner, "unverified") else []

    def shadow(self, rows: list[int], hits: list[bool]) -> None:
        if hasattr(self.inner, "shadow"):
            self.inner.shadow(rows, hits)

    def hindsight_rows(self, rows: list[int]) -> list[bool] | None:
        return self.inner.hindsight_rows(rows) if hasattr(self.inner, "hindsight_rows") else None

    def hindsight(self, rows: list[int], outcomes: list[list[bool]]) -> None:
        if hasattr(self.inner, "hindsight"):
            self.inner.hindsight(rows, outcomes)

    def __repr__(self) -> str:
        return f"CappedPolicy({self.inner!r})"


# ------------------------------------------------------------------------------------ best prefix
@dataclass
class VerifyCost:
    """Step costs relative to a plain 1-token target step.

    Attributes:
        target: ``target[n - 1] = T_target(n) / T_target(1)`` for n = 1..len (flat beyond).
        draft: ``T_draft / T_target(1)``, one draft token.
    """

    target: list[float]
    draft: float

    def step(self, m: int) -> float:
        """Relative cost of a step that proposes m tokens (the first draft forward is sunk)."""
        if m == 0:
            return 1.0
        return self.target[min(m + 1, len(self.target)) - 1] + (m - 1) * self.draft

    @classmethod
    def measure(cls, target, draft, n_max: int = 8, context: int = 64, reps: int = 3) -> VerifyCost:
        """Median latencies on this machine (target sizes and the draft interleaved), read through
        :meth:`specdraft.bench.profile.DraftLatencies.curve`."""
        from specdraft.bench.profile import measure_latency

        ns = tuple(sorted({1, 2, 3, 5, n_max + 1}))
        lat = measure_latency(target, {"draft": draft}, ns=ns, context=context, reps=reps)
        times = lat.curve().times(n_max + 1)
        t1 = max(times[0], 1e-9)
        return cls([t / t1 for t in times], lat.draft["draft"] / t1)


def best_prefix(conf: torch.Tensor, cost: VerifyCost) -> torch.Tensor:
    """``(B, k)`` per-token confidences -> ``(B,)`` prefix lengths m maximising
    ``(1 + sum_{i <= m} P_i) / cost(m)``, ``P_i = prod_{j <= i} conf_j``."""
    B, k = conf.shape
    expected = 1 + torch.cat([torch.zeros(B, 1), conf.cumprod(1).cumsum(1)], 1)  # (B, k + 1): m = 0..k
    costs = torch.tensor([cost.step(m) for m in range(k + 1)])  # (k + 1,)
    return (expected / costs).argmax(1)


def worth_continuing(cum: torch.Tensor, k: int, cost: VerifyCost) -> torch.Tensor:
    """After i drafted tokens (``cum`` ``(B, i)``: P_1..P_i), could a longer prefix still win,
    per row? P never grows, so ``1 + sum_{j <= i} P_j + (m - i) P_i`` bounds the expected tokens of
    every prefix m > i: stopping here never changes the chosen prefix. ``(B,)`` bool."""
    i = cum.shape[1]
    expected = 1 + torch.cat([torch.zeros(cum.shape[0], 1), cum.cumsum(1)], 1)  # (B, i + 1): m = 0..i
    best = (expected / torch.tensor([cost.step(m) for m in range(i + 1)])).max(1).values
    bound = (
        torch.stack([(expected[:, -1] + (m - i) * cum[:, -1]) / cost.step(m) for m in range(i + 1, k + 1)])
        .max(0)
        .values
    )
    return bound > best
