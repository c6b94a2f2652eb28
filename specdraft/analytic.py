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
"""

from __future__ import annotations


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


def step_time(k: int, t_draft: float, t_target: "callable") -> float:
    """T_step(k) = k * T_draft + T_target(k + 1); ``t_target(n)`` is a forward over n tokens."""
    return k * t_draft + t_target(k + 1)


def throughput(alpha: float, k: int, t_draft: float, t_target: "callable") -> float:
    """Predicted tokens per second per row: E[tokens | k] / T_step(k)."""
    return expected_tokens(alpha, k) / step_time(k, t_draft, t_target)


def speedup(alpha: float, k: int, t_draft: float, t_target: "callable") -> float:
    """Predicted speedup over plain decoding (k = 0) with the same target."""
    return throughput(alpha, k, t_draft, t_target) / throughput(alpha, 0, t_draft, t_target)


def best_k(alpha: float, t_draft: float, t_target: "callable", k_max: int = 8) -> int:
    """The draft length in 0..k_max with the highest predicted throughput (0 = do not speculate)."""
    return max(range(k_max + 1), key=lambda k: throughput(alpha, k, t_draft, t_target))


def alpha_needed(target: float, t_draft: float, t_target: "callable", k_max: int = 8, tol: float = 1e-4) -> tuple[float, int] | None:
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


def batch_step_time(k: int, batch: int, t_draft: "callable", t_target: "callable", draft_calls: int | None = None) -> float:
    """One speculative step of ``batch`` rows decoded together:

        T_step(b, k) = c(k) * T_draft(b) + T_target(b, k + 1)

    ``t_draft(b)`` is one draft step for b rows, ``t_target(b, n)`` a target forward over n tokens
    per row. ``c(k) = draft_calls`` is the number of draft steps, k for a draft model (one forward
    per token) and 1 for prompt lookup (one search however many tokens it returns).
    """
    calls = k if draft_calls is None else draft_calls
    return calls * t_draft(batch) + t_target(batch, k + 1)


def batch_throughput(mean_tokens: float, k: int, batch: int, t_draft: "callable", t_target: "callable", draft_calls: int | None = None) -> float:
    """Predicted tokens per second of a batch from a *measured* mean accepted length:

        throughput(b, k) = b * E[tokens | k] / T_step(b, k)

    where ``mean_tokens`` (bonus token included) stands in for E[tokens | k]; with it the model
    needs no independence assumption on alpha. ``batch=1`` and ``mean_tokens =
    expected_tokens(alpha, k)`` give :func:`throughput`.
    """
    return batch * mean_tokens / batch_step_time(k, batch, t_draft, t_target, draft_calls)


def best_k_measured(mean_tokens_by_k: dict[int, float], batch: int, t_draft: "callable", t_target: "callable") -> int:
    """The k with the highest :func:`batch_throughput`, given measured mean accepted lengths per k
    (k = 0, plain decoding, is always a candidate with 1 token per step)."""
    candidates = {0: 1.0, **mean_tokens_by_k}
    return max(candidates, key=lambda k: batch_throughput(candidates[k], k, batch, t_draft, t_target))


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured, the error the study reports for each prediction."""
    if measured <= 0:
        raise ValueError(f"measured value must be > 0, got {measured}")
    return abs(predicted - measured) / measured


def median_relative_error(pairs: "list[tuple[float, float]]") -> float:
    """Median of :func:`relative_error` over ``(predicted, measured)`` pairs."""
    errors = sorted(relative_error(p, m) for p, m in pairs)
    if not errors:
        raise ValueError("no (predicted, measured) pairs")
    mid = len(errors) // 2
    return errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
