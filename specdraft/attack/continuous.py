"""The continuous (white-box) attack: a bounded perturbation of the prompt's input embeddings.

The same ``(Tp, C)`` perturbation ``delta`` is added to the target's and the draft's embeddings of
the prompt (a pruned or designed draft shares the target's embedding width); the continuation ``y``
is teacher-forced unperturbed. Each of ``steps`` projected-gradient steps moves every perturbed
token along ``-(project_out(g_deg, g_pres) + lam * g_pres)`` (:mod:`specdraft.attack.losses`),
scaled so that the token with the largest projected degradation gradient moves ``step_size *
radius`` (and no token moves more; the length decays linearly to 0 over the steps), then clips
each token's perturbation to the L2 ball of ``radius = eps * mean |embedding row|``. The result is
the perturbation with the lowest degradation among those that keep the target's argmax on ``y`` at
every position (so its greedy output is unchanged). When no iterate keeps it, the lowest-degradation
iterate is halved until one does (``shrink``: forwards only), and the zero perturbation when none
does. (On 3 of 20 prompts with the designed draft every iterate changed the argmax; the kept half
was 1/16-1/32 of the iterate there and changed no greedy match: ``results/attack-2026-12-04``.)

Cost (issue 17: <= 2 minutes a prompt on 2 cores): one forward of each model per step, whose
graph gives both the iterate's record and the next step's gradients (the two gradients come from
disjoint graphs: the degradation from the draft's, the preservation from the target's); the
continuation is teacher-forced without its last token and the LM heads run on the n continuation
positions only (``logits_to_keep``); the clean target distributions are computed once. Only the
last ``window`` (128) perturbable positions are perturbed: the keys and values of the text before
them are computed once (:class:`~specdraft.attack.losses.Prefix`) and each step's forwards and
backwards run from there, so a long prompt's step costs what a short one's does. The search
stops early once a kept iterate leaves at most ``stop_matches`` of the continuation positions
where the draft's argmax is the target's token: greedy verification accepts exactly those, so with
the default 0 no draft token of ``y`` would be accepted and further steps cannot lower the greedy
accepted length (they only lower ``q(y_i)``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdraft.attack.losses import (
    Models,
    Prefix,
    degradation,
    keeps_argmax,
    preservation,
    project_out,
    teacher_forced,
)
from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class ContinuousConfig:
    """Settings of :func:`attack_continuous`.

    Attributes:
        steps: projected-gradient steps (at most: see ``stop_matches``).
        eps: the per-token L2 bound, as a fraction of the mean norm of an embedding row.
        step_size: each step's per-token length, as a fraction of the bound.
        lam: weight of the preservation term.
        greedy: greedy degradation (q of the target token); False: sampling (sum min(p, q)).
        stop_matches: stop once a kept iterate's share of positions where the draft's argmax is
            the target's token is at most this (0: none left to accept); None: run every step.
        shrink: when no iterate kept the target's argmax, the lowest-degradation iterate is halved
            up to this many times, and the first half that keeps it is the result (0: none).
        seconds: the search stops before a step that would end past this many seconds from its
            start, at the steps' mean pace (issue 17's attack cost: a long prompt's steps are
            slower); None: no limit.
        window: only the last this many of the perturbable positions are perturbed (None: all),
            and the text before them is run once: each step's forwards start at the window.
    """

    steps: int = 30
    eps: float = 0.5
    step_size: float = 0.2
    lam: float = 1.0
    greedy: bool = True
    stop_matches: float | None = 0.0
    shrink: int = 6
    seconds: float | None = None
    window: int | None = 128

    def __post_init__(self):
        bad_stop = self.stop_matches is not None and not 0 <= self.stop_matches <= 1
        bad = self.steps < 1 or self.eps < 0 or self.step_size <= 0 or self.lam < 0 or self.shrink < 0
        bad = bad or (self.seconds is not None and not self.seconds > 0)
        bad = bad or (self.window is not None and self.window < 1)
        if bad or bad_stop:
            raise SpecdraftError(f"bad continuous attack settings: {self}")


@dataclass
class ContinuousResult:
    """What :func:`attack_continuous` found.

    Attributes:
        delta: ``(Tp, C)`` the kept perturbation (zero outside the perturbed positions).
        degradation: its degradation (1.0 would be every draft token certain to be accepted).
        preservation: its KL to the clean target distributions.
        history: per step, ``{"degradation", "preservation", "keeps_argmax", "matches"}`` of the
            iterate (``matches``: share of positions where the draft's argmax is ``y_i``).
    """

    delta: torch.Tensor
    degradation: float
    preservation: float
    history: list[dict] = field(default_factory=list)


def attack_continuous(
    models: Models,
    prompt: list[int],
    y: list[int],
    config: ContinuousConfig = ContinuousConfig(),
    positions: torch.Tensor | None = None,
) -> ContinuousResult:
    """Perturb the prompt's embeddings so that the draft rejects ``y`` while the target keeps it.

    Args:
        models: the differentiable target and draft.
        prompt: the prompt's token ids (Tp).
        y: the target's greedy continuation of the clean prompt (n >= 1).
        config: the attack's settings.
        positions: ``(Tp,)`` bool, the prompt positions that may be perturbed (default: all).
    """
    Et, Ed = models.target_embedding, models.draft_embedding
    if Et.shape[1] != Ed.shape[1]:
        raise SpecdraftError(
            f"the continuous attack adds one perturbation to both models' embeddings: the draft's "
            f"width {Ed.shape[1]} differs from the target's {Et.shape[1]}; use --method discrete"
        )
    if not y:
        raise SpecdraftError("the target's continuation is empty: nothing to attack")
    ids, ys = torch.tensor(prompt), torch.tensor(y)
    n = len(y)
    mask = torch.ones(len(prompt), dtype=torch.bool) if positions is None else positions.bool()
    mask = window(mask, config)
    first = int(mask.nonzero()[0, 0]) if mask.any() else 0  # the inputs before it never change
    mask = mask.unsqueeze(1).float()  # (Tp, 1)
    radius = config.eps * float(Et.detach().norm(dim=1).mean())
    xt, xd = Et[ids].detach().unsqueeze(0), Ed[ids].detach().unsqueeze(0)  # (1, Tp, C)
    yt, yd = Et[ys].detach().unsqueeze(0), Ed[ys].detach().unsqueeze(0)  # (1, n, C)
    prefix = Prefix(models, xt[:, :first], xd[:, :first]) if first else None
    xt, xd = xt[:, first:], xd[:, first:]
    with torch.no_grad():
        logp_clean = models.target_logprobs(teacher_forced(xt, yt), keep=n, prefix=prefix)  # (1, n, V)

    def evaluate(delta: torch.Tensor) -> _Iterate:  # delta: (Tp, C), zero before ``first``
        logp = models.target_logprobs(teacher_forced(xt + delta[first:], yt), keep=n, prefix=prefix)
        logq = models.draft_logprobs(teacher_forced(xd + delta[first:], yd), keep=n, prefix=prefix)
        deg = degradation(logq, ys, None if config.greedy else logp.detach())[0]
        matches = float((logq.detach().argmax(-1) == ys).float().mean())
        return _Iterate(deg, preservation(logp_clean, logp)[0], bool(keeps_argmax(logp, ys)[0]), matches)

    delta = torch.zeros(len(prompt), xt.shape[2]).requires_grad_(True)  # (Tp, C)
    it = evaluate(delta)
    best = ContinuousResult(delta.detach().clone(), float(it.deg.detach()), 0.0)
    lowest = None  # (delta, degradation) of the lowest-degradation iterate that changed the argmax
    start = time.perf_counter()
    for t in range(config.steps):
        spent = time.perf_counter() - start
        if config.seconds is not None and t and spent * (t + 1) / t > config.seconds:
            break  # one more step at the pace so far would end past the budget
        delta = _step(delta, it, mask, radius, config, 1.0 - t / config.steps)
        it = evaluate(delta)
        best.history.append(it.record())
        if it.kept and it.record()["degradation"] < best.degradation:
            best.delta = delta.detach().clone()
            best.degradation, best.preservation = float(it.deg.detach()), float(it.pres.detach())
        if it.kept and config.stop_matches is not None and it.matches <= config.stop_matches:
            break
        if not it.kept and (lowest is None or float(it.deg.detach()) < lowest[1]):
            lowest = delta.detach().clone(), float(it.deg.detach())
    if lowest is not None and not any(h["keeps_argmax"] for h in best.history):
        _shrink(best, lowest[0], evaluate, config.shrink)
    return best


def window(positions: torch.Tensor, config: ContinuousConfig) -> torch.Tensor:
    """``(Tp,)`` bool: the last ``config.window`` of ``positions`` (all of them without a window)."""
    where = positions.nonzero()[:, 0]
    if config.window is None or len(where) <= config.window:
        return positions
    kept = positions.clone()
    kept[where[: -config.window]] = False
    return kept


@torch.no_grad()
def _shrink(best: ContinuousResult, delta: torch.Tensor, evaluate, times: int) -> None:
    """Halve ``delta`` up to ``times`` times; the first half that keeps the target's argmax and
    lowers the degradation becomes ``best`` (forwards only: no gradient is needed)."""
    for i in range(1, times + 1):
        delta = delta / 2
        it = evaluate(delta)
        best.history.append(it.record() | {"shrunk": i})
        if it.kept:
            if it.record()["degradation"] < best.degradation:
                best.delta = delta.clone()
                best.degradation, best.preservation = float(it.deg), float(it.pres)
            return


@dataclass
class _Iterate:
    """One perturbation's losses (with their graphs) and checks."""

    deg: torch.Tensor
    pres: torch.Tensor
    kept: bool
    matches: float

    def record(self) -> dict:
        return {
            "degradation": float(self.deg.detach()),
            "preservation": float(self.pres.detach()),
            "keeps_argmax": self.kept,
            "matches": round(self.matches, 4),
        }


def _step(delta, it: _Iterate, mask, radius: float, config: ContinuousConfig, decay: float):
    """One projected-gradient step from ``delta`` (module docstring); the new iterate, which
    requires grad. ``decay`` shrinks the step so that it settles instead of oscillating."""
    (g_deg,) = torch.autograd.grad(it.deg, delta)  # the draft's graph
    (g_pres,) = torch.autograd.grad(it.pres, delta)  # the target's graph
    g_free = project_out(g_deg, g_pres) * mask  # (Tp, C)
    direction = g_free + config.lam * g_pres * mask
    unit = g_free.norm(dim=1).max().clamp_min(1e-12)  # loss units -> the largest token moves 1
    step = direction / unit
    step = step * (1.0 / step.norm(dim=1, keepdim=True).clamp_min(1.0))  # no token moves > 1
    with torch.no_grad():
        new = delta - decay * config.step_size * radius * step
        new = new * (radius / new.norm(dim=1, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
    return new.requires_grad_(True)
