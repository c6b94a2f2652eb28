"""Making a DeLS-Spec local head for a designed draft (``specdraft design local DRAFT``).

:class:`~specdraft.drafters.local.LocalHead` is a bigram table: counting is its training. What is
tuned is the fusion ``l_long + a * l_local - b * l_prior``: on the first half of the held-out
validation answers a small grid of (a, b) is scored by the fused draft's teacher-forced greedy
agreement with the target at the first draft position (the ``alpha`` of
:func:`specdraft.design.train.validate`), and the best pair is kept (``a = b = 0``, the long draft
alone, is in the grid, so tuning never makes it worse there); the other half gives the ablation,
alpha of the long draft alone and fused. Both halves are answers neither expert trained on: the
long draft learned from every training answer, so scoring on training answers (this module's
first version tuned on their last tenth) reads it as far better than it is (SmolLM2's feature
draft: 0.80 there, 0.50 held out) and the local head as useless.

The GRU head (:class:`~specdraft.drafters.local.GRULocalHead`, ``--local gru``) is trained instead
of counted, on the same answers (plain next-token cross-entropy over the whole vocabulary, Adam,
:func:`train_gru`; minutes on this CPU, so it has no checkpoints), then tuned and measured the same
way.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from specdraft.design.data import TargetData, _subset
from specdraft.drafters.local import GRULocalHead, LocalHead
from specdraft.errors import SpecdraftError

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
        idx = list(range(s, min(s + batch_size, len(data))))
        batch = model.make_batch(data, idx, max_len)
        logits.append(model.head_logits(batch).float())
        recent = recent_tokens(data, idx, batch.rows, batch.cols, local.window)
        local_lp.append(local.log_local(recent)[:, heads])
        target.append(batch.target)
    return torch.cat(logits), torch.cat(local_lp), torch.cat(target)


def recent_tokens(data: TargetData, idx: list[int], rows, cols, W: int) -> torch.Tensor:
    """``(N, W)`` the W tokens up to the one before each predicted token of a feature batch (pair
    ``cols`` of sequence ``idx[rows]`` holds token ``P + col``), earlier ones clamped to the first."""
    out = torch.zeros(rows.shape[0], W, dtype=torch.int64)
    for b, i in enumerate(idx):
        at = rows == b
        pos = data.prompt_lens[i] + cols[at]  # (n,) the token before each label
        out[at] = data.tokens[i][(pos.unsqueeze(1) - W + 1 + torch.arange(W)).clamp(min=0)]
    return out


def gru_examples(data: TargetData, idx, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every answer position of ``data[idx]`` (from the last prompt token on) as ``(N, W)`` recent
    tokens and ``(N,)`` the next token."""
    wins, nxt = [], []
    for i in idx:
        seq, P = data.tokens[i], data.prompt_lens[i]
        pos = torch.arange(P - 1, seq.shape[0] - 1)
        wins.append(seq[(pos.unsqueeze(1) - W + 1 + torch.arange(W)).clamp(min=0)])
        nxt.append(seq[pos + 1])
    return torch.cat(wins), torch.cat(nxt)


def train_gru(
    head: GRULocalHead,
    recent,
    nxt,
    steps: int,
    batch_size: int = 256,
    lr: float = 1e-2,
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """Plain next-token cross-entropy of the GRU head on ``(recent (N, W), nxt (N,))``; the loss
    of each step."""
    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    head.train()
    losses = []
    bar = tqdm(
        range(steps),
        desc="GRU local head",
        unit="step",
        dynamic_ncols=True,
        leave=False,
        disable=not progress,
    )
    for _ in bar:
        pick = torch.randint(0, nxt.shape[0], (batch_size,), generator=g)
        loss = F.cross_entropy(head.logits(recent[pick]), nxt[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    head.eval()
    return losses


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
    model, data: TargetData, val: TargetData, vocab_size: int, M: int = 16, log=print, gru: dict | None = None
) -> tuple[LocalHead | GRULocalHead, dict]:
    """Count the bigrams of the training answers, or with ``gru`` (``{"embed": (V, C) target
    embedding, "steps": n, "window": W}``) train a GRU head on them; tune (a, b) on the first half
    of ``val`` and measure the ablation on the second (module docstring)."""
    if len(val) < 2:
        raise SpecdraftError(
            "a local head needs at least 2 validation answers (one half to tune, one to measure)"
        )
    count_idx = range(len(data))
    local = LocalHead.count([data.tokens[i][data.prompt_lens[i] - 1 :] for i in count_idx], vocab_size, M)
    losses = None
    if gru is not None:
        local = GRULocalHead(gru["embed"].detach(), local.prior, window=gru.get("window", 8))
        recent, nxt = gru_examples(data, count_idx, local.window)
        losses = train_gru(local, recent, nxt, gru["steps"], progress=gru.get("progress", True))
        if losses:
            log(f"GRU local head: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    half = len(val) // 2
    tune_set, report = _subset(val, list(range(half))), _subset(val, list(range(half, len(val))))
    log_prior = torch.log(local.prior)[model.head_tokens]
    logits, local_lp, target = scored_positions(model, tune_set, local)
    local.a, local.b, grid = tune(logits, local_lp, log_prior, target)
    lg, lp, tg = scored_positions(model, report, local)
    result = {
        "a": local.a,
        "b": local.b,
        "grid_alpha_tune": grid,
        "val_alpha_long": round(agreement(lg, lp, log_prior, tg, 0.0, 0.0), 4),
        "val_alpha_fused": round(agreement(lg, lp, log_prior, tg, local.a, local.b), 4),
        "kind": "gru" if gru is not None else "bigram",
        **({"gru_loss": [round(losses[0], 4), round(losses[-1], 4)]} if losses else {}),
        "counted_answers": len(count_idx),
        "tune_answers": len(tune_set),
        "val_answers": len(report),
    }
    alphas = f"{result['val_alpha_long']} -> {result['val_alpha_fused']}"
    log(
        f"local head: a={local.a} b={local.b} (tuned on {len(tune_set)} held-out answers); alpha on the "
        f"other {len(report)} (long draft alone -> fused) {alphas}"
    )
    return local, result
