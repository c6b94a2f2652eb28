"""The discrete attack: a short suffix of real tokens found by gradient-guided search (GCG-style).

The prompt becomes ``head + suffix + tail`` (``tail``: the chat template's closing tokens, so the
suffix sits at the end of the user's message). Each step takes the gradient of
``degradation + lam * preservation`` (:mod:`specdraft.attack.losses`) with respect to the suffix's
one-hot rows (``(m, V)``, through both models' embedding matrices), keeps the ``topk`` tokens with
the most negative gradient at each suffix position, samples ``candidates`` single-token swaps from
them, drops those a client could not send (``valid``: the decoded text must encode back to the same
ids) and evaluates the rest exactly, in batches; the best swap is kept when it lowers the loss
(Zou et al. 2023, "Universal and Transferable Adversarial Attacks on Aligned Language Models").
The head's keys and values are computed once (:class:`~specdraft.attack.losses.Prefix`): every
forward, the gradient's and the candidates', runs from the suffix on.

Preserving the answer: the search starts from the best of several initial suffixes (``starts``:
the caller passes neutral phrases, such as "Please answer briefly.", which leave the target's
argmax on ``y`` in place where a string of "!" often does not), ranked by (keeps the argmax,
-loss); once the current suffix keeps the argmax, a swap is taken only if it keeps it too, so the
search stays where the target's greedy output is ``y``. The suffix returned is the best one seen
that keeps the target's argmax at every position, else the best one seen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdraft.attack.losses import Models, Prefix, degradation, keeps_argmax, preservation
from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class DiscreteConfig:
    """Settings of :func:`attack_discrete`.

    Attributes:
        steps: search steps (one swap kept at most per step).
        topk: swap tokens kept per suffix position from the gradient.
        candidates: swaps sampled and evaluated per step.
        batch: candidates per forward pass.
        lam: weight of the preservation term.
        greedy: greedy degradation (q of the target token); False: sampling (sum min(p, q)).
        seed: seeds the sampling of swaps.
    """

    steps: int = 20
    topk: int = 32
    candidates: int = 32
    batch: int = 8
    lam: float = 1.0
    greedy: bool = True
    seed: int = 0

    def __post_init__(self):
        if min(self.steps, self.topk, self.candidates, self.batch) < 1 or self.lam < 0:
            raise SpecdraftError(f"bad discrete attack settings: {self}")


@dataclass
class DiscreteResult:
    """What :func:`attack_discrete` found.

    Attributes:
        suffix: the suffix's token ids.
        loss: its ``degradation + lam * preservation``.
        degradation: its degradation.
        keeps_argmax: whether the target's greedy output on the attacked prompt is still ``y``.
        history: per step, the kept suffix's ``{"loss", "degradation", "preservation"}``.
        start: the initial suffix the search started from.
    """

    suffix: list[int]
    loss: float
    degradation: float
    keeps_argmax: bool
    history: list[dict] = field(default_factory=list)
    start: list[int] = field(default_factory=list)


def attack_discrete(
    models: Models,
    head: list[int],
    tail: list[int],
    y: list[int],
    suffix: list[int],
    config: DiscreteConfig = DiscreteConfig(),
    allowed: torch.Tensor | None = None,
    valid: Callable[[list[int]], bool] | None = None,
    clean: list[int] | None = None,
    starts: list[list[int]] = (),
) -> DiscreteResult:
    """Search a suffix that makes the draft reject ``y`` while the target keeps it.

    Args:
        models: the differentiable target and draft.
        head: the prompt's ids before the suffix.
        tail: the prompt's ids after the suffix (may be empty).
        y: the target's greedy continuation of the clean prompt.
        suffix: the initial suffix (its length m is kept).
        config: the search's settings.
        allowed: ``(V,)`` bool, tokens the suffix may use (default: all).
        valid: ``valid(suffix) -> bool``: whether a candidate can be sent as text.
        clean: the clean prompt's ids (default ``head + tail``), for the preservation term.
        starts: other initial suffixes of length m; the search starts from the best of these and
            ``suffix`` by (keeps the argmax, -loss).
    """
    if not y or not suffix:
        raise SpecdraftError("the discrete attack needs a continuation and a suffix of >= 1 token")
    if any(len(s) != len(suffix) for s in starts):
        raise SpecdraftError("every initial suffix of the discrete attack must have the same length")
    Et, Ed = models.target_embedding, models.draft_embedding
    V, m = Et.shape[0], len(suffix)
    allowed = torch.ones(V, dtype=torch.bool) if allowed is None else allowed
    gen = torch.Generator().manual_seed(config.seed)
    ys = torch.tensor(y)
    clean_ids = torch.tensor(head + tail if clean is None else clean)
    n = len(y)
    with torch.no_grad():  # the continuation teacher-forced, heads on its n positions only
        logp_clean = models.target_logprobs(Et[torch.cat([clean_ids, ys[:-1]])].unsqueeze(0), keep=n)
    h, t = torch.tensor(head, dtype=torch.int64), torch.tensor(tail, dtype=torch.int64)
    prefix = Prefix(models, Et[h].unsqueeze(0), Ed[h].unsqueeze(0)) if head else None
    lead = h if prefix is None else h[:0]  # the head's ids in every forward: none once it is run

    def losses(suffixes: torch.Tensor, onehot: torch.Tensor | None = None):
        """``(B, m)`` suffixes (or a ``(m, V)`` one-hot for the gradient) -> loss, deg, pres, kept."""
        B = suffixes.shape[0]
        ids = torch.cat([lead.expand(B, -1), suffixes, t.expand(B, -1), ys[:-1].expand(B, -1)], 1)
        xt, xd = Et[ids], Ed[ids]  # (B, T, C)
        if onehot is not None:
            s = slice(len(lead), len(lead) + m)
            xt = torch.cat([xt[:, : s.start], (onehot @ Et).unsqueeze(0), xt[:, s.stop :]], 1)
            xd = torch.cat([xd[:, : s.start], (onehot @ Ed).unsqueeze(0), xd[:, s.stop :]], 1)
        pre = None if prefix is None else prefix.repeated(B)
        logp = models.target_logprobs(xt, keep=n, prefix=pre)
        logq = models.draft_logprobs(xd, keep=n, prefix=pre)
        deg = degradation(logq, ys, None if config.greedy else logp.detach())
        pres = preservation(logp_clean, logp)
        return deg + config.lam * pres, deg, pres, keeps_argmax(logp, ys)

    def evaluate(cands: torch.Tensor):
        with torch.no_grad():
            parts = [losses(c) for c in cands.split(config.batch)]
        return [torch.cat([p[i] for p in parts]) for i in range(4)]

    firsts = torch.tensor([list(suffix), *map(list, starts)])
    loss, deg, pres, kept = evaluate(firsts)
    i = max(range(len(firsts)), key=lambda j: (bool(kept[j]), -float(loss[j])))
    current = firsts[i : i + 1]
    cur_loss, cur_deg, cur_pres, cur_kept = float(loss[i]), float(deg[i]), float(pres[i]), bool(kept[i])
    best = DiscreteResult(current[0].tolist(), cur_loss, cur_deg, cur_kept, start=current[0].tolist())
    for _ in range(config.steps):
        onehot = torch.zeros(m, V)
        onehot[torch.arange(m), current[0]] = 1.0
        onehot.requires_grad_(True)
        (grad,) = torch.autograd.grad(losses(current, onehot)[0][0], onehot)  # (m, V)
        grad = grad.masked_fill(~allowed, float("inf"))
        top = (-grad).topk(min(config.topk, int(allowed.sum())), dim=1).indices  # (m, topk)
        pos = torch.randint(0, m, (config.candidates,), generator=gen)
        pick = torch.randint(0, top.shape[1], (config.candidates,), generator=gen)
        cands = current.repeat(config.candidates, 1)
        cands[torch.arange(config.candidates), pos] = top[pos, pick]
        cands = torch.unique(cands, dim=0)
        cands = cands[(cands != current).any(1)]
        if valid is not None:
            keep = [valid(c.tolist()) for c in cands]
            cands = cands[torch.tensor(keep, dtype=torch.bool)] if cands.shape[0] else cands
        if cands.shape[0] == 0:
            best.history.append({"loss": cur_loss, "degradation": cur_deg, "preservation": cur_pres})
            continue
        loss, deg, pres, kept = evaluate(cands)
        if cur_kept:  # stay where the target's greedy output is y
            loss = loss.masked_fill(~kept, float("inf"))
        i = int(loss.argmin())
        if float(loss[i]) < cur_loss:
            current, cur_loss = cands[i : i + 1], float(loss[i])
            cur_deg, cur_pres, cur_kept = float(deg[i]), float(pres[i]), bool(kept[i])
            better = (bool(kept[i]), -cur_loss) > (best.keeps_argmax, -best.loss)
            if better:
                best = DiscreteResult(
                    current[0].tolist(), cur_loss, float(deg[i]), bool(kept[i]), best.history, best.start
                )
        best.history.append({"loss": cur_loss, "degradation": cur_deg, "preservation": cur_pres})
    return best
