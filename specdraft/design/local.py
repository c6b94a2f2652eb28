"""Making a DeLS-Spec local head for a designed draft (``specdraft design local DRAFT``).

:class:`~specdraft.drafters.local.LocalHead` is a bigram table: counting is its training. What is
tuned is the fusion ``l_long + a * l_local - b * l_prior``: on held-in data (the last
:data:`TUNE_SHARE` of the training answers, whose bigrams are not counted) a small grid of (a, b) is
scored by the fused draft's teacher-forced greedy agreement with the target at the first draft
position (the ``alpha`` of :func:`specdraft.design.train.validate`), and the best pair is kept
(``a = b = 0``, the long draft alone, is in the grid, so tuning never makes it worse there). The
held-out validation answers then give the ablation: alpha of the long draft alone and fused.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from specdraft.design.data import TargetData, _subset
from specdraft.drafters.local import LocalHead
from specdraft.errors import SpecdraftError

TUNE_SHARE = 0.1
GRID_A = (0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
GRID_B = (0.0, 0.1, 0.2, 0.3, 0.5)


def long_model(path: Path, target_model):
    """The training module of a saved ``feature`` or ``dream`` draft (for its teacher-forced logits)."""
    from specdraft.design.artifact import load_draft
    from specdraft.design.dream import DreamDraftLM
    from specdraft.design.feature import FeatureDraftLM

    draft, meta, extra = load_draft(path, target_model)
    head = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
    if meta.kind == "feature":
        return FeatureDraftLM(draft, head, fc=extra["fc.weight"]).eval()
    if meta.kind == "dream":
        model = DreamDraftLM(
            draft, head, target_model, meta.arch["layers"], meta.arch["heads"], fc=extra["fc.weight"]
        )
        model.load_own_state(
            {**model.own_state(), **{k: v for k, v in extra.items() if k.startswith("cross.")}}
        )
        return model.eval()
    raise SpecdraftError(
        f"{path} is a {meta.kind} draft: a local head fuses into feature or dream drafts only"
    )


@torch.no_grad()
def scored_positions(model, data: TargetData, local: LocalHead, max_len: int = 320, batch_size: int = 8):
    """Per labelled position of ``data``: the long draft's head logits ``(N, H)``, the local head's
    log-probabilities over the head's tokens given the previous token ``(N, H)``, and the target's head
    row ``(N,)`` (-1 outside the head)."""
    heads = model.head_tokens
    logits, local_lp, target = [], [], []
    for s in range(0, len(data), batch_size):
        batch = model.make_batch(data, list(range(s, min(s + batch_size, len(data)))), max_len)
        logits.append(model.head_logits(batch).float())
        prev = batch.ids[batch.rows, batch.cols]  # the token before the predicted one
        local_lp.append(local.log_local(prev)[:, heads])
        target.append(batch.target)
    return torch.cat(logits), torch.cat(local_lp), torch.cat(target)


def agreement(logits, local_lp, log_prior, target, a: float, b: float) -> float:
    """Greedy agreement of the fused logits with the target's tokens (``alpha``)."""
    pred = (logits + a * local_lp - b * log_prior).argmax(-1)
    return float((pred == target).float().mean()) if target.numel() else 0.0


def tune(logits, local_lp, log_prior, target, grid_a=GRID_A, grid_b=GRID_B) -> tuple[float, float, dict]:
    """The (a, b) of the grid with the best :func:`agreement` (ties: the smaller a, then b), and every
    score as ``{"a,b": alpha}``."""
    scores = {
        (a, b): agreement(logits, local_lp, log_prior, target, a, b)
        for a, b in itertools.product(grid_a, grid_b)
    }
    a, b = max(scores, key=lambda ab: (scores[ab], -ab[0], -ab[1]))
    return a, b, {f"{x},{y}": round(v, 4) for (x, y), v in scores.items()}


def build_local(
    model, data: TargetData, val: TargetData, vocab_size: int, M: int = 16, log=print
) -> tuple[LocalHead, dict]:
    """Count the bigrams of the training answers (less the held-in share), tune (a, b) on that
    share, and measure the ablation on ``val``."""
    n_tune = max(1, int(len(data) * TUNE_SHARE)) if len(data) > 1 else 0
    count_idx = range(len(data) - n_tune)
    if not count_idx:
        raise SpecdraftError("a local head needs at least 2 training answers (one to count, one to tune)")
    local = LocalHead.count([data.tokens[i][data.prompt_lens[i] - 1 :] for i in count_idx], vocab_size, M)
    held = _subset(data, list(range(len(data) - n_tune, len(data))))
    log_prior = torch.log(local.prior)[model.head_tokens]
    logits, local_lp, target = scored_positions(model, held, local)
    local.a, local.b, grid = tune(logits, local_lp, log_prior, target)
    lg, lp, tg = scored_positions(model, val, local)
    result = {
        "a": local.a,
        "b": local.b,
        "grid_alpha_held_in": grid,
        "val_alpha_long": round(agreement(lg, lp, log_prior, tg, 0.0, 0.0), 4),
        "val_alpha_fused": round(agreement(lg, lp, log_prior, tg, local.a, local.b), 4),
        "counted_answers": len(count_idx),
        "held_in_answers": n_tune,
        "val_answers": len(val),
    }
    alphas = f"{result['val_alpha_long']} -> {result['val_alpha_fused']}"
    log(f"local head: a={local.a} b={local.b}; validation alpha (long draft alone -> fused) {alphas}")
    return local, result
