"""Training a block-diffusion draft with a length head (``specdraft design build --kind diffusion``).

The draft (:class:`~specdraft.drafters.diffusion.BlockDiffusion`) trains offline on the target's own
answers with their final hidden states (the cached data of :mod:`specdraft.design.data`), in
:func:`~specdraft.design.train.train_offline` (checkpoints, resume, validation, progress bar).

**Blocks.** Each batch takes ``anchors`` random anchor positions per answer (evenly spaced ones in
evaluation). An anchor is a committed token t; the block reads the target's features at the
``window`` positions before it (``.. t-1``, never inside the prompt, as at inference) and predicts
tokens ``t+1 .. t+block-1`` at once, positions past the answer's end unlabelled.

**Loss** (AdaFlash's weights; its on-policy rollouts are replaced by the target's own answers)::

    loss = sum_k w_k (0.8 CE(q_k, target token) + 0.2 KL(q_k || p_k)) / sum_k w_k
         + MSE(a_hat, (accepted + 1) / block),          w_k = exp(-(k - 1) / 7), k = 1 .. block - 1

where p_k is the target's cached top-K (the tail spread uniformly, as
:func:`~specdraft.design.train.distill_loss` does), and ``accepted`` is the teacher-forced accepted
length of the block under greedy verification: the leading run of positions whose argmax is the
target's token (an estimate: the draft's real blocks see the same context, so under greedy
decoding this is the accepted length it would get). The length head reads detached features: its
MSE does not move the drafter. On-policy training (Draft-OPD replay) is not implemented for this
kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.design.data import TargetData
from specdraft.design.train import Batch, distill_loss
from specdraft.drafters.diffusion import PREFIX, BlockArch, BlockDiffusion, init_tensors
from specdraft.errors import SpecdraftError

CE_WEIGHT, RKL_WEIGHT, LEN_WEIGHT = 0.8, 0.2, 1.0
DECAY = 7.0  # position weight exp(-(k - 1) / DECAY)
SHARED = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class BlockBatch(Batch):
    """A :class:`~specdraft.design.train.Batch` of blocks: ``rows`` index anchors, ``cols`` block
    positions (1 .. block - 1); labelled positions only.

    Attributes:
        feats: ``(A, W, C)`` target features before each anchor (right-aligned).
        valid: ``(A, W)`` which are real.
        anchor: ``(A,)`` anchor tokens.
        L: ``(A,)`` committed lengths (anchor position + 1).
    """

    feats: torch.Tensor = None
    valid: torch.Tensor = None
    anchor: torch.Tensor = None
    L: torch.Tensor = None


def anchor_indices(R: int, n: int, training: bool) -> torch.Tensor:
    """Anchors ``j`` (token at position P + j) of an answer of R tokens: n random ones in training,
    n evenly spaced ones otherwise (each with a label: j <= R - 2)."""
    if R < 2:
        return torch.zeros(0, dtype=torch.int64)
    if training:
        return torch.randint(0, R - 1, (n,))
    return torch.linspace(0, R - 2, min(n, R - 1)).round().long().unique()


class DiffusionDraftLM(torch.nn.Module):
    """The trainable block draft (module docstring).

    Args:
        draft: a ``LlamaForCausalLM`` (its layers and norm are used; embedding/head are the target's).
        head_tokens: ``(N,)`` ids the head predicts, or None for the whole vocabulary.
        arch: block size and context window (default :class:`BlockArch`'s).
        anchors: anchors per answer in a batch.
    """

    def __init__(self, draft, head_tokens, arch: BlockArch | None = None, anchors: int = 8):
        super().__init__()
        arch = arch or BlockArch()
        C = draft.config.hidden_size
        self.block = BlockDiffusion(draft, head_tokens, init_tensors(C), arch)
        self.arch, self.anchors = arch, anchors
        V = draft.get_input_embeddings().weight.shape[0]
        to_sub = torch.full((V,), -1, dtype=torch.int64)
        to_sub[self.block.head_tokens] = torch.arange(self.block.head_tokens.numel())
        self.register_buffer("to_sub", to_sub, persistent=False)
        draft.get_input_embeddings().weight.requires_grad_(False)
        draft.get_output_embeddings().weight.requires_grad_(False)

    @property
    def draft(self):
        return self.block.draft

    @property
    def head_tokens(self) -> torch.Tensor:
        return self.block.head_tokens

    def trainable(self) -> list[torch.nn.Parameter]:
        shared = {self.draft.get_input_embeddings().weight.data_ptr()}
        shared.add(self.draft.get_output_embeddings().weight.data_ptr())
        own = [p for p in self.draft.parameters() if p.data_ptr() not in shared]
        return own + list(self.block.t.values())

    def own_state(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.draft.state_dict().items() if k not in SHARED}
        return {**state, **{PREFIX + k: v.detach() for k, v in self.block.tensors().items()}}

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        missing = [k for k in init_tensors(1) if PREFIX + k not in state]
        if missing:
            raise SpecdraftError(f"weights lack {PREFIX}{missing[0]}: not a block-diffusion draft")
        with torch.no_grad():
            for k, t in self.block.tensors().items():
                t.copy_(state.pop(PREFIX + k))
        bad = self.draft.load_state_dict(state, strict=False)
        lacking = [m for m in bad.missing_keys if m not in SHARED]
        if lacking or bad.unexpected_keys:
            raise SpecdraftError(f"weights do not fit this draft ({(lacking + bad.unexpected_keys)[:2]})")

    def make_batch(self, data: TargetData, idx: list[int], max_len: int) -> BlockBatch:
        """Blocks at :func:`anchor_indices` of each answer (``max_len`` is unused: a block reads a
        window, not the sequence)."""
        if data.hidden is None:
            raise SpecdraftError("block-diffusion drafts need data with hidden states (hidden=True)")
        W, T = self.arch.window, self.arch.block
        feats, valid, anchor, L, labels = [], [], [], [], []
        for i in idx:
            tokens, P, hid = data.tokens[i], data.prompt_lens[i], data.hidden[i]
            R = hid.shape[0]
            for j in anchor_indices(R, self.anchors, self.training).tolist():
                lo = max(0, j + 1 - W)
                f = hid.new_zeros(W, hid.shape[1])
                f[W - (j + 1 - lo) :] = hid[lo : j + 1]
                feats.append(f)
                valid.append(torch.arange(W) >= W - (j + 1 - lo))
                anchor.append(int(tokens[P + j]))
                L.append(P + j + 1)
                ks = torch.arange(1, min(T - 1, R - 1 - j) + 1)  # labelled block positions
                labels.append((ks, tokens[P + j + ks], data.topk_idx[i][j + ks], data.topk_logp[i][j + ks]))
        if not feats:
            raise SpecdraftError("no answer in this batch has two tokens: nothing to train a block on")
        rows = torch.cat([torch.full((len(lab[0]),), a) for a, lab in enumerate(labels)])
        cat = [torch.cat([lab[n] for lab in labels]) for n in range(4)]
        cols, tgt, topk, logp = cat
        return BlockBatch(
            torch.zeros(len(feats), 1, dtype=torch.int64),
            rows,
            cols,
            self.to_sub[tgt],
            self.to_sub[topk],
            logp,
            torch.exp(-(cols - 1).float() / DECAY),
            feats=torch.stack(feats),
            valid=torch.stack(valid),
            anchor=torch.tensor(anchor),
            L=torch.tensor(L),
        )

    def _hidden(self, batch: BlockBatch) -> torch.Tensor:
        return self.block(batch.feats, batch.valid, batch.anchor, batch.L)  # (A, block, C)

    def loss(self, batch: BlockBatch, cfg) -> tuple[torch.Tensor, dict]:
        h = self._hidden(batch)
        logits = self.block.logits(h[batch.rows, batch.cols])  # (M, N)
        V = self.to_sub.shape[0]
        tok, parts = distill_loss(logits, batch, CE_WEIGHT, 0.0, RKL_WEIGHT, vocab_size=V)
        goal = accepted_fraction(logits.detach().argmax(-1), batch, self.arch.block)
        mse = F.mse_loss(self.block.accepted_fraction(h.detach()), goal)
        parts["len_mse"] = float(mse.detach())
        return tok + LEN_WEIGHT * mse, parts

    def predict(self, batch: BlockBatch) -> torch.Tensor:
        """``(M,)`` greedy head rows at the labelled block positions (teacher-forced agreement)."""
        return self.block.logits(self._hidden(batch)[batch.rows, batch.cols]).argmax(-1)


def accepted_fraction(pred: torch.Tensor, batch: BlockBatch, block: int) -> torch.Tensor:
    """``(A,)`` teacher-forced ``(accepted + 1) / block`` per anchor: the leading run of labelled
    positions whose greedy prediction ``pred (M,)`` is the target's token (unlabelled: rejected)."""
    A = batch.anchor.shape[0]
    hit = torch.zeros(A, block, dtype=torch.bool)
    hit[batch.rows, batch.cols] = (pred == batch.target) & (batch.target >= 0)
    accepted = hit[:, 1:].int().cumprod(1).sum(1)
    return (accepted + 1).float() / block


@torch.no_grad()
def block_report(model: DiffusionDraftLM, data: TargetData, batch_size: int = 8) -> dict:
    """Teacher-forced block figures on held-out answers: mean accepted tokens per block (bonus
    included), and the length head's mean absolute error on the accepted fraction."""
    was = model.training
    model.eval()
    acc, err, n = 0.0, 0.0, 0
    for s in range(0, len(data), batch_size):
        batch = model.make_batch(data, list(range(s, min(s + batch_size, len(data)))), 0)
        h = model._hidden(batch)
        goal = accepted_fraction(
            model.block.logits(h[batch.rows, batch.cols]).argmax(-1), batch, model.arch.block
        )
        acc += float((goal * model.arch.block).sum())
        err += float((model.block.accepted_fraction(h) - goal).abs().sum())
        n += goal.numel()
    model.train(was)
    return {"tokens_per_block": acc / max(n, 1), "length_mae": err / max(n, 1), "blocks": n}


def param_count(model: DiffusionDraftLM) -> int:
    """The block tensors' parameters (the Llama layers are counted by the build)."""
    return sum(math.prod(t.shape) for t in model.block.tensors().values())


def drafter_from_spec(spec, target):
    """``diffusion:NAME[,fixed]``: the designed block-diffusion draft NAME (a ``drafts/`` name or a
    directory), as ``designed:NAME`` loads it; ``fixed`` ignores the length head and proposes every
    block token up to k (a fixed block length, for comparisons)."""
    from specdraft.design.artifact import diffusion_drafter, find_draft, load_draft

    name, _, opt = spec.arg.partition(",")
    path = find_draft(name.removeprefix("designed:"), target.loaded.model)
    dense = torch.float32 if target.dtype == torch.qint8 else target.dtype
    draft, meta, extra = load_draft(path, target.loaded.model, dense)
    if meta.kind != "diffusion":
        raise SpecdraftError(f"{spec}: {path} is a {meta.kind} draft, not a block-diffusion draft")
    head = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
    drafter = diffusion_drafter(draft, meta, extra, head, path, adaptive=opt != "fixed")
    drafter.name = f"diffusion:{spec.arg}"
    return drafter
