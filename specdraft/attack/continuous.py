"""The continuous (white-box) attack: a bounded perturbation of the prompt's input embeddings.

The same ``(Tp, C)`` perturbation ``delta`` is added to the target's and the draft's embeddings of
the prompt (a pruned or designed draft shares the target's embedding width); the continuation ``y``
is teacher-forced unperturbed. Each of ``steps`` projected-gradient steps moves every perturbed
token along ``-(project_out(g_deg, g_pres) + lam * g_pres)`` (:mod:`specdraft.attack.losses`),
scaled so that the token with the largest projected degradation gradient moves ``step_size *
radius`` (and no token moves more; the length decays linearly to 0 over the steps), then clips
each token's perturbation to the L2 ball of ``radius = eps * mean |embedding row|``. The result is
the perturbation with the lowest degradation among those that keep the target's argmax on ``y`` at
every position (so its greedy output is unchanged); the zero perturbation when none does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdraft.attack.losses import (
    Models,
    continuation_slice,
    degradation,
    keeps_argmax,
    preservation,
    project_out,
)
from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class ContinuousConfig:
    """Settings of :func:`attack_continuous`.

    Attributes:
        steps: projected-gradient steps.
        eps: the per-token L2 bound, as a fraction of the mean norm of an embedding row.
        step_size: each step's per-token length, as a fraction of the bound.
        lam: weight of the preservation term.
        greedy: greedy degradation (q of the target token); False: sampling (sum min(p, q)).
    """

    steps: int = 30
    eps: float = 0.5
    step_size: float = 0.2
    lam: float = 1.0
    greedy: bool = True

    def __post_init__(self):
        if self.steps < 1 or self.eps < 0 or self.step_size <= 0 or self.lam < 0:
            raise SpecdraftError(f"bad continuous attack settings: {self}")


@dataclass
class ContinuousResult:
    """What :func:`attack_continuous` found.

    Attributes:
        delta: ``(Tp, C)`` the kept perturbation (zero outside the perturbed positions).
        degradation: its degradation (1.0 would be every draft token certain to be accepted).
        preservation: its KL to the clean target distributions.
        history: per step, ``{"degradation", "preservation", "keeps_argmax"}`` of the iterate.
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
    Tp, n = len(prompt), len(y)
    cont = continuation_slice(Tp, n)
    mask = torch.ones(Tp, dtype=torch.bool) if positions is None else positions.bool()
    mask = mask.unsqueeze(1).float()  # (Tp, 1)
    radius = config.eps * float(Et.detach().norm(dim=1).mean())
    xt, xd = Et[ids].detach(), Ed[ids].detach()  # (Tp, C)
    yt, yd = Et[ys].detach(), Ed[ys].detach()  # (n, C)
    with torch.no_grad():
        logp_clean = models.target_logprobs(torch.cat([xt, yt]).unsqueeze(0))[:, cont]  # (1, n, V)

    def evaluate(delta: torch.Tensor):
        logp = models.target_logprobs(torch.cat([xt + delta, yt]).unsqueeze(0))[:, cont]
        logq = models.draft_logprobs(torch.cat([xd + delta, yd]).unsqueeze(0))[:, cont]
        deg = degradation(logq, ys, None if config.greedy else logp.detach())[0]
        return deg, preservation(logp_clean, logp)[0], bool(keeps_argmax(logp, ys)[0])

    delta = torch.zeros_like(xt)
    with torch.no_grad():
        deg0, _, _ = evaluate(delta)
    best = ContinuousResult(delta.clone(), float(deg0), 0.0)
    for t in range(config.steps):
        delta.requires_grad_(True)
        deg, pres, kept = evaluate(delta)
        (g_deg,) = torch.autograd.grad(deg, delta, retain_graph=True)
        (g_pres,) = torch.autograd.grad(pres, delta)
        g_free = project_out(g_deg, g_pres) * mask  # (Tp, C)
        direction = g_free + config.lam * g_pres * mask
        unit = g_free.norm(dim=1).max().clamp_min(1e-12)  # loss units -> the largest token moves 1
        step = direction / unit
        step = step * (1.0 / step.norm(dim=1, keepdim=True).clamp_min(1.0))  # no token moves > 1
        with torch.no_grad():
            decay = 1.0 - t / config.steps  # a shrinking step settles instead of oscillating
            delta = delta.detach() - decay * config.step_size * radius * step
            scale = (radius / delta.norm(dim=1, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
            delta = delta * scale
            deg, pres, kept = evaluate(delta)
        best.history.append({"degradation": float(deg), "preservation": float(pres), "keeps_argmax": kept})
        if kept and float(deg) < best.degradation:
            best.delta, best.degradation, best.preservation = delta.clone(), float(deg), float(pres)
    return best
