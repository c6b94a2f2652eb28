"""Analytic throughput model of speculative decoding.

Assume each draft token is accepted independently with probability alpha (Leviathan et al.,
"Fast Inference from Transformers via Speculative Decoding", ICML 2023, Sec. 3.1). With draft
length k, the number of tokens one step emits (accepted drafts plus the recovered/bonus token) is

    E[tokens | k] = (1 - alpha^(k + 1)) / (1 - alpha)                      (Leviathan eq. 1)

and one step costs k draft steps plus one target forward over k + 1 tokens

    T_step(k) = k * T_draft + T_target(k + 1)

(Yan, Agarwal, Venkataraman, "Decoding Speculative Decoding", NAACL 2025, Sec. 3: throughput is
E[tokens] / T_step; unlike Leviathan's c = T_draft / T_target, T_target depends on k here, which on
a CPU is far from constant). Plain decoding is k = 0: one token per T_target(1).

T_target comes from measurements: :class:`LatencyCurve` interpolates the measured points (the
profiler in :mod:`specdraft.bench.profile` and the online estimate in :mod:`specdraft.policy`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha); equals k + 1 at alpha = 1."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_from_rates(rates, k: int) -> float:
    """E[tokens | k] from per-position acceptance instead of one alpha:

        E[tokens | k] = 1 + sum_{j=1..k} prod_{i<=j} c_i

    where ``c_i = P(draft token i accepted | tokens 1..i-1 accepted)`` (``rates[i - 1]``, at least
    k of them): term j is the chance that the first j drafts all survive. With every c_i = alpha
    this is :func:`expected_tokens`; measured rates need no independence assumption.
    """
    total, survive = 1.0, 1.0
    for c in rates[:k]:
        survive *= c
        total += survive
    return total


def best_k_from_rates(rates, t_draft: float, times, draft_calls=None) -> int:
    """The k in ``0..len(rates)`` with the highest E[tokens | k] / T_step(k) (the first on a tie),
    in one pass: :func:`expected_tokens_from_rates` over :func:`step_time` with ``times[n - 1]``
    the forward over n tokens (at least ``len(rates) + 1`` of them) and ``draft_calls(k)`` the
    draft forwards of k tokens (default k). The same sums in the same order as those two, so the
    same choice; a policy asks it per class at every step."""
    best, best_rate = 0, 1.0 / times[0]  # k = 0: one token in T_target(1)
    total, survive = 1.0, 1.0
    for k, c in enumerate(rates, 1):
        survive *= c
        total += survive
        calls = k if draft_calls is None else draft_calls(k)
        rate = total / (calls * t_draft + times[k])
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def alpha_from_mean_accepted(mean_tokens: float, k: int, tol: float = 1e-6) -> float:
    """Invert :func:`expected_tokens`: the alpha whose E[tokens | k] equals ``mean_tokens``.

    ``mean_tokens`` is the mean accepted length *with* the bonus token (1 <= m <= k + 1).
    """
    if k <= 0 or mean_tokens <= 1.0:
        return 0.0
    if mean_tokens >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:  # expected_tokens is increasing in alpha
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < mean_tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def step_time(
    k: int, t_draft: float, t_target: Callable[..., float], draft_calls: int | None = None
) -> float:
    """T_step(k) = c(k) * T_draft + T_target(k + 1); ``t_target(n)`` is a forward over n tokens and
    ``c(k) = draft_calls`` the draft forwards, k for a draft that runs one per token (the default),
    ``min(k, 1)`` for a block drafter (one forward per block, :mod:`specdraft.drafters.diffusion`)."""
    return (k if draft_calls is None else draft_calls) * t_draft + t_target(k + 1)


def throughput(alpha: float, k: int, t_draft: float, t_target: Callable[..., float]) -> float:
    """Predicted tokens per second per row: E[tokens | k] / T_step(k)."""
    return expected_tokens(alpha, k) / step_time(k, t_draft, t_target)


def speedup(alpha: float, k: int, t_draft: float, t_target: Callable[..., float]) -> float:
    """Predicted speedup over plain decoding (k = 0) with the same target."""
    return throughput(alpha, k, t_draft, t_target) / throughput(alpha, 0, t_draft, t_target)


def best_k(alpha: float, t_draft: float, t_target: Callable[..., float], k_max: int = 8) -> int:
    """The draft length in 0..k_max with the highest predicted throughput (0 = do not speculate)."""
    return max(range(k_max + 1), key=lambda k: throughput(alpha, k, t_draft, t_target))


def alpha_needed(
    target: float, t_draft: float, t_target: Callable[..., float], k_max: int = 8, tol: float = 1e-4
) -> tuple[float, int] | None:
    """The smallest per-token acceptance alpha for which some k in 1..k_max reaches ``target``
    speedup over plain decoding, and that k; None if even alpha = 1 does not reach it."""

    def best(alpha: float) -> tuple[float, int]:
        return max((speedup(alpha, k, t_draft, t_target), k) for k in range(1, k_max + 1))

    if best(1.0)[0] < target:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > tol:  # the best speedup grows with alpha
        mid = (lo + hi) / 2
        if best(mid)[0] < target:
            lo = mid
        else:
            hi = mid
    return hi, best(hi)[1]


# ------------------------------------------------------------------------------------------------
# Batches, measured acceptance, and checking predictions against measurements (the study, issue 3)
# ------------------------------------------------------------------------------------------------


def batch_step_time(
    k: int,
    batch: int,
    t_draft: Callable[..., float],
    t_target: Callable[..., float],
    draft_calls: int | None = None,
    t_engine: Callable[..., float] | None = None,
) -> float:
    """One speculative step of ``batch`` rows decoded together:

        T_step(b, k) = T_draft(b, c(k)) + T_target(b, k + 1) + T_engine(b)

    ``t_draft(b, c)`` is a proposal of c draft steps for b rows (``c * T_draft(b)`` when every
    step costs the same), ``t_target(b, n)`` a target forward over n tokens per row, and
    ``t_engine(b)`` the engine's own work in a step (verification, commit, bookkeeping; none when
    not given). ``c(k) = draft_calls`` is the number of draft steps, k for a draft model (one
    forward per token) and 1 for prompt lookup (one search however many tokens it returns).
    """
    calls = k if draft_calls is None else draft_calls
    draft = t_draft(batch, calls) if calls else 0.0
    return draft + t_target(batch, k + 1) + (t_engine(batch) if t_engine is not None else 0.0)


def batch_throughput(
    mean_tokens: float,
    k: int,
    batch: int,
    t_draft: Callable[..., float],
    t_target: Callable[..., float],
    draft_calls: int | None = None,
    t_engine: Callable[..., float] | None = None,
) -> float:
    """Predicted tokens per second of a batch from a *measured* mean accepted length:

        throughput(b, k) = b * E[tokens | k] / T_step(b, k)

    where ``mean_tokens`` (bonus token included) stands in for E[tokens | k]; with it the model
    needs no independence assumption on alpha. ``batch=1``, ``t_draft(b, c) = c * T_draft`` and
    ``mean_tokens = expected_tokens(alpha, k)`` give :func:`throughput`.
    """
    return batch * mean_tokens / batch_step_time(k, batch, t_draft, t_target, draft_calls, t_engine)


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured, the error the study reports for each prediction."""
    if measured <= 0:
        raise ValueError(f"measured value must be > 0, got {measured}")
    return abs(predicted - measured) / measured


def median_relative_error(pairs: list[tuple[float, float]]) -> float:
    """Median of :func:`relative_error` over ``(predicted, measured)`` pairs."""
    errors = sorted(relative_error(p, m) for p, m in pairs)
    if not errors:
        raise ValueError("no (predicted, measured) pairs")
    mid = len(errors) // 2
    return errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2


# ------------------------------------------------------------------------------------------------
# The measured target latency T_target(b, n)
# ------------------------------------------------------------------------------------------------

MIN_SECONDS = 1e-6  # floor of an interpolated time (extrapolating two noisy medians can go below zero)


def interp(points: Mapping[float, float], x: float, beyond: str = "clamp") -> float:
    """Piecewise-linear y(x) through measured ``points`` ``{x: y}``.

    At a measured x its y; between two neighbouring measured xs the straight line through them.
    Outside the measured range ``beyond`` decides: ``"clamp"`` holds the nearest measured y,
    ``"linear"`` extends the nearest segment. One point is flat either way.
    """
    if beyond not in ("clamp", "linear"):
        raise ValueError(f"beyond must be 'clamp' or 'linear', got {beyond!r}")
    if x in points:
        return points[x]
    return _interp_sorted(sorted(points), points, x, beyond)


def _interp_sorted(xs: list, points: Mapping[float, float], x: float, beyond: str) -> float:
    """:func:`interp` at an x not in ``points``, their xs sorted (``xs``) by the caller."""
    if not xs:
        raise ValueError("no measured points to interpolate")
    if len(xs) == 1:
        return points[xs[0]]
    if beyond == "clamp":
        x = min(max(x, xs[0]), xs[-1])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)  # segment xs[i - 1]..xs[i], or the nearest one
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class LatencyCurve:
    """T_target(b, n): seconds of one target forward over n new tokens for each of b rows, from
    measured points (the profiler's medians, or the policy's running averages).

    With ``T_b(n)`` the measured row of batch size b (:func:`interp` over n):

        T(b, n) = T_b(n)                                     b measured
                = (1 - w) * T_b0(n) + w * T_b1(n)            b0 < b < b1, the measured sizes around b,
                                                             w = (b - b0) / (b1 - b0)
                = T_b0(n) at the nearest measured b0         outside the measured sizes

    In n, between measured sizes the line through the two around n; beyond them ``beyond``:
    ``"linear"`` extends the nearest segment (on a CPU a forward's cost grows about linearly with
    n), ``"flat"`` holds the nearest measured time. One measured n is flat. ``T_b(n)`` is never
    below :data:`MIN_SECONDS`.

    Attributes:
        points: ``{b: {n: seconds}}``; the ``t_target`` table of a profile's JSON (whose string keys
            :meth:`from_dict` turns back into integers).
        beyond: ``"linear"`` or ``"flat"``, how n outside the measured sizes is read.
    """

    points: dict[int, dict[int, float]]
    beyond: str = "linear"

    def __post_init__(self):
        if self.beyond not in ("linear", "flat"):
            raise ValueError(f"LatencyCurve.beyond must be 'linear' or 'flat', got {self.beyond!r}")

    def time(self, n: int, batch: int = 1) -> float:
        """T_target(batch, n) in seconds (class docstring)."""
        if not self.points:
            raise ValueError("LatencyCurve has no measured points")
        mode = "linear" if self.beyond == "linear" else "clamp"

        def row(b: int) -> float:  # T_b(n)
            return max(interp(self.points[b], n, mode), MIN_SECONDS)

        if batch in self.points:
            return row(batch)
        return interp({b: row(b) for b in self.points}, batch, "clamp")

    def times(self, n_max: int, batch: int = 1) -> list[float]:
        """``[T_target(batch, n) for n in 1 .. n_max]``, as :meth:`time` reads each, the measured
        sizes sorted once (the cost-aware policy reads them at every step)."""
        row = self.points.get(batch)
        if not row:
            return [self.time(n, batch) for n in range(1, n_max + 1)]
        xs, mode = sorted(row), "linear" if self.beyond == "linear" else "clamp"
        return [
            max(row[n] if n in row else _interp_sorted(xs, row, n, mode), MIN_SECONDS)
            for n in range(1, n_max + 1)
        ]

    def to_dict(self) -> dict[int, dict[int, float]]:
        """``{b: {n: seconds}}``, as stored in JSON (keys become strings there)."""
        return {b: dict(row) for b, row in self.points.items()}

    @classmethod
    def from_dict(cls, d: Mapping, beyond: str = "linear") -> LatencyCurve:
        """The inverse of :meth:`to_dict`, also from JSON (string keys)."""
        return cls({int(b): {int(n): float(t) for n, t in row.items()} for b, row in d.items()}, beyond)
