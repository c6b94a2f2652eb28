"""Training a draft: offline distillation, then on-policy distillation, with checkpoints.

The draft is a transformers ``LlamaForCausalLM`` whose embedding (and tied head) are the target's,
frozen. Its head may be a subset of the vocabulary (:mod:`specdraft.design.vocab`): logits are
``h @ E[head_tokens].T`` and every loss below is over that subset.

Offline distillation (:func:`train_offline`), on the target's own answers (:mod:`~specdraft.design.data`).
At each response position, with p the target and q the draft::

    loss = ce_weight * CE(q, target token) + kl_weight * KL(p_K || q)

where ``p_K`` is the target's top-K renormalised over the tokens the head has (K log-probs cached
at generation). CE is skipped where the target token is outside the head.

On-policy distillation (:func:`train_on_policy`), in the manner of Draft-OPD: run real speculative
decoding (greedy) with the current draft on fresh training prompts, keep each step's draft block,
and replay those positions with the target's tokens and distributions: the positions the draft
actually had to predict, up to and including the first rejected one. Loss per position i of a block::

    w_i * (CE(q_i, target token) + rkl_weight * KL(q_i || p_i)),   w_i = position_decay ** i

Reverse KL is mode-seeking (the draft concentrates on the target's mode, which is what greedy
acceptance rewards); p outside the cached top-K is taken as the leftover mass spread uniformly.
Earlier positions weigh more: a rejection at position i discards every later draft token.

Checkpoints: every ``checkpoint_every`` steps the trainable weights, optimizer state, step, RNG and
running loss go to ``<out>/checkpoint.pt`` (written to a temporary file, fsynced, then renamed). A
run started again with the same output directory resumes there; a killed run loses at most one
interval. The data order is a function of (seed, step), so a resumed run continues exactly where the
killed one was.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specdraft import analytic, durable
from specdraft.design.data import TargetData
from specdraft.errors import SpecdraftError

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainConfig:
    """Offline distillation settings.

    Attributes:
        steps: optimizer steps.
        batch_size: sequences per step.
        max_len: tokens per sequence; longer ones lose the start of the prompt.
        lr: peak learning rate (AdamW), reached after ``warmup`` steps, cosine-decayed to
            ``lr * min_lr_ratio``.
        warmup: linear warm-up steps.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        weight_decay: AdamW weight decay.
        ce_weight: weight of cross-entropy on the target's token.
        kl_weight: weight of KL(p_K || q).
        grad_clip: gradient-norm clip (0 = off).
        seed: data order and any randomness.
        checkpoint_every: steps between checkpoints.
        eval_every: steps between validation passes (0 = only at the end).
        eval_k: draft length used to turn validation acceptance into mean accepted length.
    """

    steps: int = 400
    batch_size: int = 8
    max_len: int = 320
    lr: float = 3e-4
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    ce_weight: float = 1.0
    kl_weight: float = 1.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 25
    eval_every: int = 50
    eval_k: int = 5

    def __post_init__(self):
        for name in ("steps", "batch_size", "max_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.warmup < 0 or self.eval_every < 0:
            raise SpecdraftError("lr must be > 0, warmup and eval_every >= 0")


@dataclass
class OnPolicyConfig:
    """On-policy (Draft-OPD style) settings.

    Attributes:
        rounds: decode-then-train rounds.
        prompts_per_round: training prompts decoded speculatively per round (one batch).
        k: draft length while decoding.
        max_new_tokens: response cap while decoding.
        updates_per_round: optimizer steps on each round's replay.
        lr: learning rate (constant).
        rkl_weight: weight of the reverse KL(q || p).
        position_decay: weight ``decay ** i`` of draft position i in its block.
        first_prompt: index of the first training prompt used (after those used offline).
        seed: randomness.
        checkpoint_every: rounds between checkpoints.
    """

    rounds: int = 10
    prompts_per_round: int = 8
    k: int = 5
    max_new_tokens: int = 128
    updates_per_round: int = 2
    lr: float = 5e-5
    rkl_weight: float = 0.5
    position_decay: float = 0.8
    first_prompt: int = 4000
    seed: int = 0
    checkpoint_every: int = 1


# ------------------------------------------------------------------------------------ the draft
class DraftLM(torch.nn.Module):
    """A transformers draft plus its head subset, for training.

    Args:
        draft: ``LlamaForCausalLM`` sharing the target's embedding (kept frozen here).
        head_tokens: ``(N,)`` ids the head predicts, or None for the whole vocabulary.
    """

    def __init__(self, draft, head_tokens: torch.Tensor | None):
        super().__init__()
        self.draft = draft
        emb = draft.get_input_embeddings().weight
        emb.requires_grad_(False)
        V = emb.shape[0]
        ids = torch.arange(V) if head_tokens is None else head_tokens.long()
        self.register_buffer("head_tokens", ids, persistent=False)
        to_sub = torch.full((V,), -1, dtype=torch.int64)
        to_sub[ids] = torch.arange(ids.numel())
        self.register_buffer("to_sub", to_sub, persistent=False)  # (V,) full id -> head row, -1 if absent
        head = draft.get_output_embeddings().weight  # the target's (often the tied embedding)
        head.requires_grad_(False)
        # (N, C) frozen, in the dtype of the draft's hidden states (the target's may differ)
        self.register_buffer("head_w", head.detach()[ids].to(draft.model.norm.weight.dtype), persistent=False)

    def trainable(self) -> list[torch.nn.Parameter]:
        shared = {
            self.draft.get_input_embeddings().weight.data_ptr(),
            self.draft.get_output_embeddings().weight.data_ptr(),
        }
        return [p for p in self.draft.parameters() if p.data_ptr() not in shared]

    def own_state(self) -> dict[str, torch.Tensor]:
        """The draft's own tensors (no shared embedding / tied head)."""
        return {
            k: v
            for k, v in self.draft.state_dict().items()
            if k not in ("model.embed_tokens.weight", "lm_head.weight")
        }

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.draft.load_state_dict(state, strict=False)
        missing = [m for m in missing if m not in ("model.embed_tokens.weight", "lm_head.weight")]
        if missing or unexpected:
            raise SpecdraftError(
                f"weights do not fit this draft (missing {missing[:2]}, unexpected {unexpected[:2]})"
            )

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` right-padded ids -> ``(B, T, C)`` final hidden states (after the norm)."""
        return self.draft.model(input_ids=ids, use_cache=False).last_hidden_state

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """``(..., C)`` -> ``(..., N)`` logits over the head's tokens."""
        return F.linear(h, self.head_w)

    # the interface train_offline / validate use (a feature-conditioned draft has the same)
    def make_batch(self, data: TargetData, idx: list[int], max_len: int) -> Batch:
        return make_batch(data, idx, self.to_sub, max_len)

    def loss(self, batch: Batch, cfg: TrainConfig) -> tuple[torch.Tensor, dict]:
        h = self.hidden(batch.ids)[batch.rows, batch.cols]  # (M, C)
        return distill_loss(self.head(h), batch, cfg.ce_weight, cfg.kl_weight)

    def predict(self, batch: Batch) -> torch.Tensor:
        """``(M,)`` head rows the draft would propose (greedy) at the labelled positions."""
        return self.head(self.hidden(batch.ids)[batch.rows, batch.cols]).argmax(-1)


# ------------------------------------------------------------------------------------ batches
@dataclass
class Batch:
    """Right-padded sequences and the labelled positions.

    Attributes:
        ids: ``(B, T)`` token ids.
        rows, cols: ``(M,)`` where the M labelled logits are (the position *before* each token).
        target: ``(M,)`` head row of the target's token (-1: outside the head).
        topk: ``(M, K)`` head rows of the target's top-K (-1: outside the head).
        topk_logp: ``(M, K)`` the target's log-probabilities of those tokens.
        weight: ``(M,)`` per-position loss weight.
    """

    ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    target: torch.Tensor
    topk: torch.Tensor
    topk_logp: torch.Tensor
    weight: torch.Tensor


def make_batch(data: TargetData, idx: list[int], to_sub: torch.Tensor, max_len: int) -> Batch:
    """Batch the sequences ``idx`` of ``data``, labelling every response position."""
    seqs, rows, cols, tgt, topk, logp = [], [], [], [], [], []
    for b, i in enumerate(idx):
        tokens, P = data.tokens[i], data.prompt_lens[i]
        keep_r = min(tokens.shape[0] - P, max_len - 1)  # response tokens kept
        start = max(0, P + keep_r - max_len)  # drop the start of a long prompt; start <= P - 1
        seq = tokens[start : P + keep_r]
        seqs.append(seq)
        pos = torch.arange(P - 1 - start, P - 1 - start + keep_r)  # logits that predict each token
        rows.append(torch.full((keep_r,), b))
        cols.append(pos)
        tgt.append(to_sub[tokens[P : P + keep_r]])
        topk.append(to_sub[data.topk_idx[i][:keep_r]])
        logp.append(data.topk_logp[i][:keep_r])
    T = max(s.shape[0] for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : s.shape[0]] = s
    rows, cols = torch.cat(rows), torch.cat(cols)
    return Batch(ids, rows, cols, torch.cat(tgt), torch.cat(topk), torch.cat(logp), torch.ones(rows.shape[0]))


def distill_loss(
    logits: torch.Tensor,
    batch: Batch,
    ce_weight: float,
    kl_weight: float,
    rkl_weight: float = 0.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """The weighted distillation loss over the labelled positions (see the module docstring).

    Args:
        logits: ``(M, N)`` draft logits over the head at the labelled positions.
        vocab_size: the full vocabulary size (for the reverse KL's tail; default N).
    """
    logq = torch.log_softmax(logits.float(), -1)  # (M, N)
    w = batch.weight
    has = batch.target >= 0
    ce = -logq.gather(1, batch.target.clamp(min=0).unsqueeze(1)).squeeze(1)  # (M,)
    ce_loss = (ce * w * has).sum() / (w * has).sum().clamp(min=1e-9)
    valid = batch.topk >= 0  # (M, K)
    p = batch.topk_logp.exp() * valid
    p_hat = p / p.sum(-1, keepdim=True).clamp(min=1e-9)  # top-K of p inside the head, renormalised
    logq_k = logq.gather(1, batch.topk.clamp(min=0))  # (M, K)
    kl = (p_hat * (torch.log(p_hat.clamp(min=1e-9)) - logq_k)).sum(-1)  # (M,)
    kl_loss = (kl * w).sum() / w.sum().clamp(min=1e-9)
    loss = ce_weight * ce_loss + kl_weight * kl_loss
    parts = {"ce": float(ce_loss.detach()), "kl": float(kl_loss.detach())}
    if rkl_weight:
        # KL(q || p): p known on its top-K; elsewhere the leftover mass spread over the other V - K ids
        V, K = vocab_size or logits.shape[-1], batch.topk.shape[1]
        tail = ((1 - batch.topk_logp.exp().sum(-1)).clamp(min=1e-6) / max(V - K, 1)).log()  # (M,)
        logp = tail.unsqueeze(1).expand_as(logq).clone()  # (M, N)
        r, c = valid.nonzero(as_tuple=True)
        logp[r, batch.topk[r, c]] = batch.topk_logp[r, c]
        rkl = (logq.exp() * (logq - logp)).sum(-1)  # (M,)
        rkl_loss = (rkl * w).sum() / w.sum().clamp(min=1e-9)
        loss = loss + rkl_weight * rkl_loss
        parts["rkl"] = float(rkl_loss.detach())
    return loss, parts


# ------------------------------------------------------------------------------------ validation
@torch.no_grad()
def validate(model, data: TargetData, max_len: int = 320, batch_size: int = 8, k: int = 5) -> dict:
    """Teacher-forced agreement on held-out target answers.

    With greedy decoding, draft position i is accepted iff the draft's argmax equals the target's
    token given the target's own prefix. For a token-level draft that prefix is all it reads, so
    this agreement rate is the per-token acceptance ``alpha`` at every position, and
    :func:`specdraft.analytic.expected_tokens` turns it into a mean accepted length. A draft with
    ``second_position`` (the EAGLE-style feature draft) reads its own predicted feature from its
    second position on: ``alpha_2`` is that position's acceptance given the first was accepted, and
    the mean accepted length takes it for every position past the first.
    """
    was = model.training
    model.eval()
    hit = total = hit2 = first = 0
    chained = getattr(model, "second_position", None)
    for s in range(0, len(data), batch_size):
        batch = model.make_batch(data, list(range(s, min(s + batch_size, len(data)))), max_len)
        if chained is None:
            hit1 = model.predict(batch) == batch.target
        else:  # the same first-position forward, then the second position's
            hit1, h2, right = chained(batch)
            hit2, first = hit2 + int((h2 & right).sum()), first + int(right.sum())
        hit += int((hit1 & (batch.target >= 0)).sum())
        total += batch.target.numel()
    model.train(was)
    alpha = hit / total if total else 0.0
    out = {"alpha": alpha, "mean_accepted_length": analytic.expected_tokens(alpha, k), "positions": total}
    if chained is not None:
        out["alpha_2"] = hit2 / first if first else 0.0
        out["mean_accepted_length"] = analytic.expected_tokens_from_rates(
            [alpha] + [out["alpha_2"]] * (k - 1), k
        )
    return out


# ------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(
    path: Path,
    model: DraftLM,
    opt,
    step: int,
    config: dict,
    history: list,
    elapsed: float,
    loss_ema: float | None = None,
) -> None:
    """Everything a resumed run needs to go on exactly as an uninterrupted one (written atomically)."""
    state = {
        "loss_ema": loss_ema,
        "step": step,
        "model": model.own_state(),
        "opt": opt.state_dict(),
        "config": config,
        "history": history,
        "elapsed": elapsed,
        "rng": torch.get_rng_state(),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    durable.replace_file(tmp, path)


def load_checkpoint(path: Path) -> dict:
    """Read a checkpoint; a clear error when it is truncated or not one."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(ck, dict) or not {"step", "model", "opt", "config"} <= set(ck):
            raise ValueError("missing fields")
    except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged file
        raise SpecdraftError(
            f"corrupted checkpoint {path} ({type(e).__name__}: {str(e)[:80]}); delete it to start over"
        ) from None
    return ck


def _restore(path: Path, model: DraftLM, opt, config: dict) -> dict:
    ck = load_checkpoint(path)
    mismatch = {
        k: (ck["config"].get(k), v) for k, v in config.items() if k != "steps" and ck["config"].get(k) != v
    }
    if mismatch:
        raise SpecdraftError(
            f"checkpoint {path} was made with other settings {mismatch}; use another --out or delete it"
        )
    try:
        model.load_own_state(ck["model"])
    except SpecdraftError as e:
        raise SpecdraftError(f"checkpoint {path}: {e}") from None
    opt.load_state_dict(ck["opt"])
    torch.set_rng_state(ck["rng"])
    return ck


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


@dataclass
class TrainResult:
    """What a training run did.

    Attributes:
        steps: steps completed (including any before a resume).
        seconds: training time (including time before a resume).
        history: ``{"step", "loss", ...}`` per evaluation.
        val: the last validation figures.
        resumed_from: the step a resumed run started at (0 = fresh).
    """

    steps: int
    seconds: float
    history: list = field(default_factory=list)
    val: dict = field(default_factory=dict)
    resumed_from: int = 0


def train_offline(
    model,
    data: TargetData,
    val: TargetData | None,
    cfg: TrainConfig,
    out: str | Path,
    *,
    progress: bool = True,
    stop_after: int | None = None,
) -> TrainResult:
    """Offline distillation with checkpoints in ``out`` (resumes from ``out/checkpoint.pt``).

    Args:
        model: the draft (trained in place): a :class:`DraftLM`, or a
            :class:`~specdraft.design.feature.FeatureDraftLM`.
        data: the target's answers to training prompts.
        val: held-out answers for validation acceptance (None: no validation).
        cfg: settings.
        out: directory for the checkpoint.
        stop_after: stop (as if killed) after this many steps of this call; for tests.
    """
    from tqdm import tqdm

    if len(data) == 0:
        raise SpecdraftError("no training data")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / CHECKPOINT
    torch.manual_seed(cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.trainable(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    config = {"phase": "offline", **asdict(cfg)}
    step, history, elapsed, loss_ema = 0, [], 0.0, None
    if ckpt.is_file():
        ck = _restore(ckpt, model, opt, config)
        step, history, elapsed, loss_ema = ck["step"], ck["history"], ck["elapsed"], ck.get("loss_ema")
    start_step = step
    per_epoch = max(len(data) // cfg.batch_size, 1)
    val_stats = history[-1].get("val", {}) if history else {}
    bar = tqdm(
        total=cfg.steps, initial=step, desc="distill", unit="step", disable=not progress, dynamic_ncols=True
    )
    t0 = time.perf_counter() - elapsed
    while step < cfg.steps:
        if stop_after is not None and step - start_step >= stop_after:
            break
        epoch, j = divmod(step, per_epoch)
        idx = _order(len(data), cfg.seed, epoch)[j * cfg.batch_size : (j + 1) * cfg.batch_size]
        batch = model.make_batch(data, idx, cfg.max_len)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        loss, parts = model.loss(batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.trainable(), cfg.grad_clip)
        opt.step()
        step += 1
        loss_ema = float(loss.detach()) if loss_ema is None else 0.9 * loss_ema + 0.1 * float(loss.detach())
        record = None
        if val is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps):
            val_stats = validate(model, val, cfg.max_len, cfg.batch_size, cfg.eval_k)
            record = {
                "step": step,
                "loss": round(loss_ema, 4),
                **{k: round(v, 4) for k, v in parts.items()},
                "val": val_stats,
            }
            history.append(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", val_alpha=f"{val_stats.get('alpha', float('nan')):.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt, model, opt, step, config, history, time.perf_counter() - t0, loss_ema)
    bar.close()
    model.eval()
    return TrainResult(step, time.perf_counter() - t0, history, val_stats, start_step)


# ------------------------------------------------------------------------------------ on-policy
class _VerifyRecorder:
    """Wraps the target runtime: keeps the top-K log-probs of every position of each forward."""

    def __init__(self, runtime, topk: int):
        self.runtime, self.topk = runtime, topk
        self.vocab_size, self.max_context, self.dtype = runtime.vocab_size, runtime.max_context, runtime.dtype
        self.last = None

    def new_state(self, batch_size: int, capacity: int):
        return self.runtime.new_state(batch_size, capacity)

    def forward(self, state, tokens, positions, **kw):
        out = self.runtime.forward(state, tokens, positions, **kw)
        logp = torch.log_softmax(out.logits.float(), -1)  # (B, T, V)
        self.last = logp.topk(self.topk, dim=-1)  # values, indices: (B, T, K)
        return out


@dataclass
class Replay:
    """One round of real speculative decoding, kept for training.

    Attributes:
        data: the sequences decoded (prompt + output) as :class:`TargetData` with empty top-K.
        items: per labelled position ``(seq, index, draft_position, topk_idx (K,), topk_logp (K,))``:
            logits at ``index`` predict token ``index + 1``, which was draft position
            ``draft_position`` of its block (0-based; the last one of a block is the first rejected).
        accepted: accepted draft tokens; drafted: proposed draft tokens.
    """

    data: TargetData
    items: list
    accepted: int
    drafted: int


def collect_replay(
    model: DraftLM,
    target_runtime,
    prompts: list[list[int]],
    *,
    k: int,
    max_new_tokens: int,
    eos_ids,
    topk: int = 32,
) -> Replay:
    """Decode ``prompts`` greedily with speculative decoding using the current draft; keep each
    block's positions up to and including the first rejected one, with the target's top-K there."""
    from specdraft.drafters.model import ModelDrafter
    from specdraft.engine import Engine, Request
    from specdraft.models.runtime import compact_runtime
    from specdraft.models.subset_head import SubsetHeadRuntime, draft_weights
    from specdraft.policy import FixedK

    V = target_runtime.vocab_size
    subset = model.head_tokens.numel() < V
    tw = getattr(target_runtime, "w", None)
    w = draft_weights(model.draft, tw, model.head_tokens if subset else None, torch.float32)
    rt = compact_runtime(w)
    drafter = ModelDrafter(SubsetHeadRuntime(rt, model.head_tokens, V) if subset else rt, "on-policy")
    rec = _VerifyRecorder(target_runtime, topk)
    engine = Engine(rec, drafter, FixedK(k))
    reqs = [Request(list(p), max_new_tokens, eos_ids=tuple(eos_ids)) for p in prompts]
    ids = engine.add(reqs)
    seq_of = {rid: i for i, rid in enumerate(ids)}
    outputs: list[list[int]] = [[] for _ in prompts]
    items = []
    while engine.active:
        rows = [r.id for r in engine.requests]
        L = engine.lengths.clone()
        events = engine.step()
        vals, idx = rec.last  # (B, k + 1, K)
        for b, (rid, ev) in enumerate(zip(rows, events)):
            s = seq_of[rid]
            n_acc = sum(ev.from_draft)
            for i in range(min(n_acc + 1, k, len(ev.tokens))):  # accepted positions, then the rejected one
                items.append((s, int(L[b]) - 1 + i, i, idx[b, i], vals[b, i]))
            outputs[s] += ev.tokens
    data = TargetData(
        tokens=[torch.tensor(list(p) + o, dtype=torch.int64) for p, o in zip(prompts, outputs)],
        prompt_lens=[len(p) for p in prompts],
        topk_idx=[torch.zeros(0, topk, dtype=torch.int64) for _ in prompts],
        topk_logp=[torch.zeros(0, topk) for _ in prompts],
        prompt_ids=list(range(len(prompts))),
    )
    return Replay(data, items, engine.stats.accepted, engine.stats.drafted)


def replay_batch(replay: Replay, to_sub: torch.Tensor, decay: float) -> Batch:
    """All of a replay's sequences, labelled at its kept positions with weight ``decay ** position``."""
    seqs = replay.data.tokens
    T = max(s.shape[0] for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : s.shape[0]] = s
    rows = torch.tensor([it[0] for it in replay.items], dtype=torch.int64)
    cols = torch.tensor([it[1] for it in replay.items], dtype=torch.int64)
    target = to_sub[ids[rows, cols + 1]]
    topk = to_sub[torch.stack([it[3] for it in replay.items])]
    logp = torch.stack([it[4] for it in replay.items])
    weight = torch.tensor([decay ** it[2] for it in replay.items])
    return Batch(ids, rows, cols, target, topk, logp, weight)


def train_on_policy(
    model: DraftLM,
    target_runtime,
    prompts: list[list[int]],
    cfg: OnPolicyConfig,
    out: str | Path,
    *,
    eos_ids=(),
    progress: bool = True,
    stop_after: int | None = None,
) -> TrainResult:
    """Rounds of: decode ``cfg.prompts_per_round`` prompts speculatively with the current draft,
    then ``cfg.updates_per_round`` updates on that replay (see the module docstring).

    Checkpoints go to ``out/checkpoint-opd.pt`` every ``cfg.checkpoint_every`` rounds; a rerun resumes.
    The history records each round's live acceptance (accepted / drafted while decoding).
    """
    from tqdm import tqdm

    need = cfg.rounds * cfg.prompts_per_round
    if len(prompts) < need:
        raise SpecdraftError(f"on-policy training needs {need} prompts, got {len(prompts)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint-opd.pt"
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.trainable(), lr=cfg.lr)
    config = {"phase": "on-policy", **asdict(cfg)}
    rnd, history, elapsed = 0, [], 0.0
    if ckpt.is_file():
        ck = _restore(ckpt, model, opt, config)
        rnd, history, elapsed = ck["step"], ck["history"], ck["elapsed"]
    start = rnd
    V = target_runtime.vocab_size
    bar = tqdm(
        total=cfg.rounds,
        initial=rnd,
        desc="on-policy",
        unit="round",
        disable=not progress,
        dynamic_ncols=True,
    )
    t0 = time.perf_counter() - elapsed
    while rnd < cfg.rounds:
        if stop_after is not None and rnd - start >= stop_after:
            break
        model.eval()
        chunk = prompts[rnd * cfg.prompts_per_round : (rnd + 1) * cfg.prompts_per_round]
        replay = collect_replay(
            model, target_runtime, chunk, k=cfg.k, max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids
        )
        model.train()
        batch = replay_batch(replay, model.to_sub, cfg.position_decay)
        for _ in range(cfg.updates_per_round):
            h = model.hidden(batch.ids)[batch.rows, batch.cols]
            loss, parts = distill_loss(model.head(h), batch, 1.0, 0.0, cfg.rkl_weight, vocab_size=V)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.trainable(), 1.0)
            opt.step()
        rnd += 1
        live = replay.accepted / max(replay.drafted, 1)
        history.append(
            {
                "round": rnd,
                "loss": round(float(loss.detach()), 4),
                **{k: round(v, 4) for k, v in parts.items()},
                "live_acceptance": round(live, 4),
                "positions": len(replay.items),
            }
        )
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", live_accept=f"{live:.3f}")
        if rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds:
            save_checkpoint(ckpt, model, opt, rnd, config, history, time.perf_counter() - t0)
    bar.close()
    model.eval()
    return TrainResult(rnd, time.perf_counter() - t0, history, history[-1] if history else {}, start)
