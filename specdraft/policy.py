"""Draft-length policies: how many tokens to draft at the next step.

- :class:`FixedK`: always k.
- :class:`HeuristicK`: transformers' "heuristic" schedule: +2 after a step that accepted every
  draft token, -1 otherwise (never below 1).
- :class:`CostAwareK`: measures draft and target latency and the running acceptance while it
  decodes and picks the k with the highest predicted throughput from :mod:`specdraft.analytic`,
  including k = 0 (plain decoding) when speculation does not pay. While at k = 0 it probes a
  small k every ``probe_every`` steps so the acceptance estimate can recover; each probe that
  still says "do not speculate" doubles the interval (up to ``probe_max``), one that pays resets it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdraft import analytic
from specdraft.errors import SpecdraftError


class KPolicy(Protocol):
    def choose(self) -> int: ...

    def update(self, k: int, num_drafted: torch.Tensor, num_accepted: torch.Tensor, draft_time: float, target_time: float) -> None: ...


class FixedK:
    """Always draft ``k`` tokens (k = 0: plain decoding)."""

    def __init__(self, k: int):
        if k < 0:
            raise SpecdraftError(f"draft length k must be >= 0, got {k}")
        self.k = k

    def choose(self) -> int:
        return self.k

    def update(self, k, num_drafted, num_accepted, draft_time, target_time) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedK({self.k})"


class HeuristicK:
    """+2 when all drafted tokens were accepted (in every row), else -1; within [1, k_max]."""

    def __init__(self, k_start: int = 5, k_max: int = 16):
        self.k = k_start
        self.k_max = k_max

    def choose(self) -> int:
        return self.k

    def update(self, k, num_drafted, num_accepted, draft_time, target_time) -> None:
        if k == 0:
            return
        if bool((num_accepted >= num_drafted).all()):
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(self.k - 1, 1)

    def __repr__(self) -> str:
        return f"HeuristicK(k={self.k})"


class CostAwareK:
    """Choose k by the analytic model with latencies and acceptance measured online.

    Args:
        k_max: largest k considered.
        k_start: k used until the first measurements arrive.
        decay: weight of history in the exponential moving averages.
        probe_every: at k = 0, try ``probe_k`` once every this many steps at first.
        probe_max: the longest interval between probes (after failed probes doubled it).
    """

    def __init__(self, k_max: int = 8, k_start: int = 3, decay: float = 0.8, probe_every: int = 8, probe_k: int = 2,
                 probe_max: int = 64):
        self.k_max, self.k_start, self.decay = k_max, k_start, decay
        self.probe_every, self.probe_k, self.probe_max = probe_every, probe_k, probe_max
        self.probe_interval = probe_every
        self._probing = False
        self.alpha: float | None = None
        self.t_draft: float | None = None  # seconds per draft token
        self.t_target: dict[int, float] = {}  # tokens fed -> seconds
        self._since_probe = 0
        self.last_k = k_start

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def target_time(self, n: int) -> float:
        """Measured T_target(n), linearly inter/extrapolated from the sizes seen so far."""
        if n in self.t_target:
            return self.t_target[n]
        known = sorted(self.t_target)
        if len(known) == 1:
            return self.t_target[known[0]]  # no slope yet: assume flat (optimistic, then measured)
        lo = max([m for m in known if m < n], default=known[0])
        hi = min([m for m in known if m > n], default=known[-1])
        if lo == hi:
            lo, hi = known[-2], known[-1]
        slope = (self.t_target[hi] - self.t_target[lo]) / (hi - lo)
        return max(self.t_target[lo] + slope * (n - lo), 1e-6)

    def choose(self) -> int:
        if self.alpha is None or self.t_draft is None or 1 not in self.t_target:
            # measure: a speculative step first, then one plain step for T_target(1)
            k = self.k_start if self.alpha is None or self.t_draft is None else 0
        else:
            k = analytic.best_k(self.alpha, self.t_draft, self.target_time, self.k_max)
            if k == 0:
                self._since_probe += 1
                if self._since_probe >= self.probe_interval:
                    self._since_probe = 0
                    k = self.probe_k
                    self._probing = True
        self.last_k = k
        return k

    def update(self, k, num_drafted, num_accepted, draft_time, target_time) -> None:
        drafted = int(num_drafted.max()) if num_drafted.numel() else 0
        # the target scored drafted + 1 tokens per row (fewer than k + 1 when a drafter such as
        # prompt lookup found less to propose): that is the size this time belongs to
        self.t_target[drafted + 1] = self._ema(self.t_target.get(drafted + 1), target_time)
        if k == 0 or drafted == 0:
            return
        self.t_draft = self._ema(self.t_draft, draft_time / k)
        mean_tokens = float((num_accepted.float() + 1).mean())
        self.alpha = self._ema(self.alpha, analytic.alpha_from_mean_accepted(mean_tokens, drafted))
        if self._probing:  # did the probe change the verdict?
            self._probing = False
            pays = analytic.best_k(self.alpha, self.t_draft, self.target_time, self.k_max) > 0
            self.probe_interval = self.probe_every if pays else min(2 * self.probe_interval, self.probe_max)

    def __repr__(self) -> str:
        return f"CostAwareK(alpha={self.alpha}, t_draft={self.t_draft}, k={self.last_k})"


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
