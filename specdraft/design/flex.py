"""Training a FlexDraft draft (``specdraft design build --kind flex``) on cached target answers.

The draft (:mod:`specdraft.drafters.flex`) owns a mask embedding, its own q/k/v/o projectors for
the target's layers from the split on, and the bonus-guided calibration; the target (norms, MLPs,
keys/values of the real tokens, LM head) stays frozen. A training batch replays what a verification
forward sees: the target runs over an answer (no gradient) and fills its cache; at A *anchors* p per
sequence (the last real token a mask group reads, as after n accepted drafts), a group of m mask
tokens at positions ``p + 1 .. p + m`` runs through :func:`specdraft.models.mask_rows.mask_hidden`
(with gradients), is calibrated with the bonus token (the answer's token at ``p + 1``: the data are
the target's greedy answers, so the bonus is the target's own token), and mask token i is trained
to give the answer's token at ``p + 2 + i``::

    loss = sum_i w_i (ce_weight CE(q_i, token) + kl_weight KL(p_K || q_i)) / sum_i w_i,  w_i = 0.8^i

(:func:`specdraft.design.train.distill_loss`; ``p_K`` the target's cached top-K there). Earlier
positions weigh more: a rejection at position i discards every later draft token. Anchors are drawn
at random in training (the global RNG, which checkpoints restore: a resumed run continues exactly)
and evenly spread in validation. Training, checkpoints and resuming are
:func:`specdraft.design.train.train_offline`'s; validation acceptance is the teacher-forced greedy
agreement over the group's positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.design.data import TargetData
from specdraft.design.train import Batch, distill_loss
from specdraft.drafters.flex import FlexWeights, calibrate, group_rows
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.mask_rows import mask_hidden

POSITION_DECAY = 0.8


@dataclass
class FlexBatch(Batch):
    """A :class:`~specdraft.design.train.Batch` whose labelled rows are mask tokens.

    Attributes:
        visible: ``(B, A)`` each anchor's last real position (its group reads ``0..visible``).
        bonus: ``(M,)`` the bonus token of each labelled mask token's group.
    """

    visible: torch.Tensor = None
    bonus: torch.Tensor = None


class FlexDraftLM(torch.nn.Module):
    """The trainable FlexDraft draft over a frozen target.

    Args:
        target_model: the target (a transformers Llama-family model); its weights are extracted once
            in fp32 (:class:`~specdraft.models.llama.LlamaRuntime`).
        split: first target layer the mask tokens go through.
        block: m, mask tokens per group (the most a step drafts).
        rank: R of the calibration.
        anchors: mask groups per training sequence.
        head_tokens: ``(N,)`` ids the draft's head scores (None: the whole vocabulary).
    """

    def __init__(
        self, target_model, split: int, block: int = 4, rank: int = 256, anchors: int = 16, head_tokens=None
    ):
        super().__init__()
        if block < 1 or anchors < 1:
            raise SpecdraftError(f"flex block and anchors must be >= 1, got {block} and {anchors}")
        self.runtime = LlamaRuntime(LlamaWeights.from_hf(target_model, torch.float32))
        w = FlexWeights.init(self.runtime, split, rank)
        self.split, self.block, self.rank, self.anchors = split, block, rank, anchors
        self.mask = torch.nn.Parameter(w.mask)
        self.wqkv = torch.nn.ParameterList(w.wqkv)
        self.wo = torch.nn.ParameterList(w.wo)
        self.down, self.up = torch.nn.Parameter(w.down), torch.nn.Parameter(w.up)
        V = self.runtime.vocab_size
        ids = torch.arange(V) if head_tokens is None else head_tokens.long()
        self.head_tokens, self.head_w = ids, self.runtime.w.lm_head[ids]  # (N,), (N, C) frozen
        self.to_sub = torch.full((V,), -1, dtype=torch.int64)  # full id -> head row (-1: outside)
        self.to_sub[ids] = torch.arange(ids.numel())

    @property
    def weights(self) -> FlexWeights:
        return FlexWeights(self.split, self.mask, list(self.wqkv), list(self.wo), self.down, self.up)

    @property
    def arch(self) -> dict:
        """What a saved draft records in ``specdraft.json`` (``DraftMeta.arch``)."""
        return {"split": self.split, "block": self.block, "rank": self.rank}

    def trainable(self) -> list[torch.nn.Parameter]:
        return list(self.parameters())

    def own_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.weights.tensors().items()}

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        w = FlexWeights.from_tensors(state, self.split, len(self.runtime.layers))
        with torch.no_grad():
            mine = (self.mask, *self.wqkv, *self.wo, self.down, self.up)
            for p, t in zip(mine, (w.mask, *w.wqkv, *w.wo, w.down, w.up)):
                if p.shape != t.shape:
                    raise SpecdraftError(
                        f"flex weights of shape {tuple(t.shape)} do not fit {tuple(p.shape)}"
                    )
                p.copy_(t)

    def _anchors(self, n: int) -> torch.Tensor:
        """``(A,)`` anchor offsets among n candidates: random in training, evenly spread otherwise."""
        if self.training:
            return torch.randint(n, (self.anchors,)).sort().values
        return torch.linspace(0, n - 1, self.anchors).round().long()

    def make_batch(self, data: TargetData, idx: list[int], max_len: int) -> FlexBatch:
        """The answers ``idx`` (their start cut to ``max_len`` tokens) with A mask groups each."""
        m, A = self.block, self.anchors
        seqs, visible, items = [], [], []
        for b, i in enumerate(idx):
            tokens, P = data.tokens[i], data.prompt_lens[i]
            keep_r = min(tokens.shape[0] - P, max_len - 1)
            start = max(0, P + keep_r - max_len)
            seq = tokens[start : P + keep_r]
            seqs.append(seq)
            n = keep_r - 1  # anchors p = P-1 .. P+keep_r-3: each has a bonus and at least one label
            anchors = (P - 1 - start + self._anchors(n)) if n > 0 else torch.zeros(0, dtype=torch.int64)
            visible.append(torch.cat([anchors, anchors.new_zeros(A - len(anchors))]))
            for a, p in enumerate(anchors.tolist()):
                for j in range(min(m, len(seq) - p - 2)):  # mask j predicts token p + 2 + j
                    r = p + 2 + j + start - P  # its response index in the cached top-K
                    label = (
                        self.to_sub[seq[p + 2 + j]],
                        self.to_sub[data.topk_idx[i][r]],
                        data.topk_logp[i][r],
                    )
                    items.append((b, a * m + j, POSITION_DECAY**j, seq[p + 1], *label))
        if not items:
            raise SpecdraftError("flex training needs answers of at least 2 tokens")
        rows, cols, weight, bonus, tgt, topk, logp = zip(*items)
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        return FlexBatch(
            ids,
            torch.tensor(rows),
            torch.tensor(cols),
            torch.stack(tgt),
            torch.stack(topk),
            torch.stack(logp),
            torch.tensor(weight),
            visible=torch.stack(visible),
            bonus=torch.stack(bonus),
        )

    def logits(self, batch: FlexBatch) -> torch.Tensor:
        """``(M, N)`` calibrated draft logits over the head at the labelled mask tokens."""
        B, T = batch.ids.shape
        rt = self.runtime
        with torch.no_grad():  # the frozen target's keys/values of the real tokens
            kv = rt.new_state(B, T)
            rt.forward(
                kv, batch.ids, torch.arange(T).expand(B, T), logits_index=torch.zeros(B, 1, dtype=torch.int64)
            )
        kv.k, kv.v = [t.clone() for t in kv.k], [t.clone() for t in kv.v]  # out of inference mode
        h = mask_hidden(rt, kv, group_rows(self.weights, batch.visible, self.block))[batch.rows, batch.cols]
        h = calibrate(h, rt.w.embed[batch.bonus], self.down, self.up)  # (M, C)
        return F.linear(h, self.head_w)

    def loss(self, batch: FlexBatch, cfg) -> tuple[torch.Tensor, dict]:
        return distill_loss(self.logits(batch), batch, cfg.ce_weight, cfg.kl_weight)

    def predict(self, batch: FlexBatch) -> torch.Tensor:
        """Greedy draft head rows at the labelled mask tokens (teacher-forced: real prefix, real bonus)."""
        return self.logits(batch).argmax(-1)
