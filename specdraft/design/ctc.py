"""Training a CTC draft (``specdraft design build --kind ctc``).

The draft (:mod:`specdraft.drafters.ctc`) is the EAGLE-style feature draft of
:mod:`specdraft.design.feature` plus S learned slot embeddings and a blank logit. It trains on the
same data (the target's own answers with their final hidden states) and in the same loop
(:func:`~specdraft.design.train.train_offline`: checkpoints, resume, validation); what is new is
here.

**Anchors.** Inference runs the slots after the step's last real pair ``p``: slot j sits at
position ``p + 1 + j``, reads ``fc([g; s_j])`` with ``g`` the feature at ``p + 1``, and sees the
pairs up to ``p`` and the slots before it. Training picks up to ``anchors`` pairs per sequence and
appends one block of S slots per anchor to the sequence, with a custom attention mask that gives
each block exactly that view (:meth:`CTCDraftLM.features`), so one draft forward computes the
pairs and every block. ``g`` is the target's real feature at ``p + 1`` (plus the same uniform
noise as the pairs' features: at inference the draft reads its own prediction of it, EAGLE's
reason for the noise).

**Loss** (the paper's ``train/main.py``: ``v_w = 1.0``, ``p_w = 0.1``, ``c_w = 0.01``)::

    loss = 1.0  * SmoothL1(f_hat_{p+1}, f_{p+1})      # the pairs' predicted features
         + 0.1  * softCE(p_K, q)                       # the pairs' distributions vs the target's top-K
         + 0.01 * CTC(slots of anchor p, x_{p+2} .. x_{p+1+n})   # torch.nn.functional.ctc_loss

with the target's next ``n = labels`` tokens as each block's CTC label (the paper's ``fixlen``,
3) and the blank as the last class. The soft cross-entropy is written as ``KL(p_K || q)`` (same
gradient, see :mod:`specdraft.design.dream`). An anchor whose labels leave the head subset is
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.design.data import TargetData
from specdraft.design.feature import FeatureBatch, FeatureDraftLM
from specdraft.design.train import distill_loss
from specdraft.drafters.ctc import CTC_KEYS, alignment_beams, candidate_tree
from specdraft.errors import SpecdraftError

FEAT_WEIGHT, SOFT_CE_WEIGHT, CTC_WEIGHT = 1.0, 0.1, 0.01  # the paper's loss weights (module docstring)


@dataclass
class CTCBatch(FeatureBatch):
    """A :class:`FeatureBatch` plus the anchors' slot blocks.

    Attributes:
        anchor_rows: ``(A,)`` batch row of each anchor.
        anchor_cols: ``(A,)`` its pair's column p.
        anchor_block: ``(A,)`` its block's index among its row's blocks.
        anchor_feat: ``(A, C)`` the target's feature at ``p + 1`` (the slots' ``g``).
        anchor_labels: ``(A, n)`` head rows of the target's tokens ``p + 2 .. p + 1 + n``.
    """

    anchor_rows: torch.Tensor = None
    anchor_cols: torch.Tensor = None
    anchor_block: torch.Tensor = None
    anchor_feat: torch.Tensor = None
    anchor_labels: torch.Tensor = None


def block_mask(T: int, S: int, anchor_cols: torch.Tensor) -> torch.Tensor:
    """``(B, T + A S, T + A S)`` bool attention mask of T pairs followed by A blocks of S slots:
    pairs are causal; block a of row b sees the pairs ``0 .. anchor_cols[b, a]`` and its own
    earlier slots (a block with ``anchor_cols = -1`` is padding: it sees its own slots only).

    Args:
        anchor_cols: ``(B, A)`` each block's anchor pair.
    """
    B, A = anchor_cols.shape
    Q = T + A * S
    mask = torch.zeros(B, Q, Q, dtype=torch.bool)
    mask[:, :T, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    mask[:, T:, T:] = torch.block_diag(*[torch.ones(S, S, dtype=torch.bool).tril()] * A)
    sees = torch.arange(T) <= anchor_cols.unsqueeze(-1)  # (B, A, T)
    mask[:, T:, :T] = sees.repeat_interleave(S, dim=1)
    return mask


class CTCDraftLM(FeatureDraftLM):
    """The trainable CTC draft (module docstring).

    Args:
        draft: a ``LlamaForCausalLM`` (its layers and norm are used; embedding/head are the target's).
        head_tokens: ``(N,)`` ids the head predicts, or None for the whole vocabulary.
        slots: S, the slots per pass.
        labels: n, the target tokens each block's CTC loss aligns to (at most S).
        anchors: slot blocks per sequence in training.
        fc, noise: as :class:`FeatureDraftLM`.
    """

    second_position = None  # it drafts its slots in one pass, not pair by pair (validate: first only)

    def __init__(
        self, draft, head_tokens, slots: int = 6, labels: int = 3, anchors: int = 16, fc=None, noise=0.1
    ):
        super().__init__(draft, head_tokens, fc=fc, noise=noise, reg_weight=FEAT_WEIGHT)
        if not 1 <= labels <= slots or anchors < 1:
            raise SpecdraftError(
                f"CTC needs 1 <= labels <= slots and anchors >= 1, got {labels}, {slots}, {anchors}"
            )
        C = draft.config.hidden_size
        std = float(draft.get_input_embeddings().weight.float().std())
        g = torch.Generator().manual_seed(0)
        self.ctc = torch.nn.ParameterDict(
            {
                "slots": torch.nn.Parameter(torch.randn(slots, C, generator=g) * std),
                "blank_w": torch.nn.Parameter(torch.zeros(C)),
                "blank_b": torch.nn.Parameter(torch.zeros(1)),
            }
        )
        self.labels, self.anchors = labels, anchors

    @property
    def num_slots(self) -> int:
        return self.ctc["slots"].shape[0]

    def trainable(self) -> list[torch.nn.Parameter]:
        return super().trainable() + list(self.ctc.values())

    def own_state(self) -> dict[str, torch.Tensor]:
        return {**super().own_state(), **{f"ctc.{k}": v.detach() for k, v in self.ctc.items()}}

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        missing = [k for k in CTC_KEYS if f"ctc.{k}" not in state]
        if missing:
            raise SpecdraftError(f"weights lack ctc.{missing[0]}: not a CTC draft")
        with torch.no_grad():
            for k in CTC_KEYS:
                self.ctc[k].copy_(state.pop(f"ctc.{k}"))
        super().load_own_state(state)

    def make_batch(self, data: TargetData, idx: list[int], max_len: int) -> CTCBatch:
        """The feature batch plus up to :attr:`anchors` anchors per sequence (random, among the
        pairs with n labels inside the head and a next feature)."""
        fb = super().make_batch(data, idx, max_len)
        n_pairs = torch.bincount(fb.rows, minlength=len(idx))
        rows, cols, feat, labels = [], [], [], []
        for b, i in enumerate(idx):
            tokens, P, hid = data.tokens[i], data.prompt_lens[i], data.hidden[i]
            last = min(int(n_pairs[b]) - 1, tokens.shape[0] - P - 1 - self.labels, hid.shape[0] - 2)
            js = torch.arange(max(last + 1, 0))  # pairs with n labels and a next feature
            lab = self.to_sub[tokens[P + 1 + js.unsqueeze(1) + torch.arange(self.labels)]]  # (J, n)
            pick = (lab >= 0).all(1).nonzero().squeeze(1)
            pick = pick[torch.randperm(pick.numel())[: self.anchors]].sort().values
            rows.append(torch.full((pick.numel(),), b))
            cols.append(js[pick])
            feat.append(hid[js[pick] + 1])
            labels.append(lab[pick])
        rows = torch.cat(rows)
        block = torch.cat([torch.arange(r.numel()) for r in cols])  # each anchor's block in its row
        fields = {f: getattr(fb, f) for f in fb.__dataclass_fields__}
        return CTCBatch(
            **fields,
            anchor_rows=rows,
            anchor_cols=torch.cat(cols),
            anchor_block=block,
            anchor_feat=torch.cat(feat).float(),
            anchor_labels=torch.cat(labels),
        )

    def features(self, feats, tokens, positions, batch: CTCBatch | None = None, anchor_feat=None):
        """Pairs -> ``(B, T, C)`` predicted next features; with ``batch``, also ``(A, S, C)`` the
        anchors' slot outputs (one forward, :func:`block_mask`)."""
        if batch is None or batch.anchor_rows.numel() == 0:
            return super().features(feats, tokens, positions), None
        B, T, C = feats.shape
        S, A = self.num_slots, int(batch.anchor_block.max()) + 1
        x = self.fc(torch.cat([feats, self.draft.get_input_embeddings()(tokens)], dim=-1))  # (B, T, C)
        na = batch.anchor_rows.shape[0]
        g = (batch.anchor_feat if anchor_feat is None else anchor_feat).to(x.dtype)
        xs = self.fc(torch.cat([g.unsqueeze(1).expand(na, S, C), self.ctc["slots"].expand(na, S, C)], -1))
        grid = x.new_zeros(B, A, S, C)
        grid[batch.anchor_rows, batch.anchor_block] = xs
        cols = torch.full((B, A), -1, dtype=torch.int64)
        cols[batch.anchor_rows, batch.anchor_block] = batch.anchor_cols
        start = positions.gather(1, cols.clamp(min=0)) + 1  # (B, A): slot 0's position
        pos = torch.cat([positions, (start.unsqueeze(-1) + torch.arange(S)).flatten(1)], 1)
        allowed = block_mask(T, S, cols)
        mask = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)
        h = self.draft.model(
            inputs_embeds=torch.cat([x, grid.flatten(1, 2)], 1),
            position_ids=pos,
            attention_mask=mask.unsqueeze(1),
            use_cache=False,
        ).last_hidden_state
        return h[:, :T], h[:, T:].view(B, A, S, C)[batch.anchor_rows, batch.anchor_block]

    def slot_logprobs(self, hs: torch.Tensor) -> torch.Tensor:
        """``(A, S, C)`` slot outputs -> ``(A, S, N + 1)`` log-probabilities over the head, blank last."""
        blank = hs @ self.ctc["blank_w"] + self.ctc["blank_b"]  # (A, S)
        return torch.log_softmax(torch.cat([self.tokens.head(hs), blank.unsqueeze(-1)], -1).float(), -1)

    def ctc_loss(self, hs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean CTC loss of the slot outputs ``hs (A, S, C)`` against ``labels (A, n)``."""
        logp = self.slot_logprobs(hs)
        A, S, K = logp.shape
        return F.ctc_loss(
            logp.transpose(0, 1),  # (S, A, N + 1)
            labels,
            torch.full((A,), S, dtype=torch.int64),
            torch.full((A,), labels.shape[1], dtype=torch.int64),
            blank=K - 1,
            zero_infinity=True,
        )

    def loss(self, batch: CTCBatch, cfg) -> tuple[torch.Tensor, dict]:
        feats, g = batch.feats, batch.anchor_feat
        if self.training and self.noise:
            feats = feats + (torch.rand_like(feats) * 2 - 1) * self.noise
            g = g + (torch.rand_like(g) * 2 - 1) * self.noise
        h, hs = self.features(feats, batch.ids, batch.positions, batch, g)
        hp = h[batch.rows, batch.cols]  # (M, C)
        soft, parts = distill_loss(self.tokens.head(hp), batch, 0.0, 1.0)
        reg = F.smooth_l1_loss(hp, batch.feat_target)
        ctc = self.ctc_loss(hs, batch.anchor_labels) if hs is not None else reg.new_zeros(())
        loss = FEAT_WEIGHT * reg + SOFT_CE_WEIGHT * soft + CTC_WEIGHT * ctc
        return loss, {"soft_ce": parts["kl"], "reg": float(reg.detach()), "ctc": float(ctc.detach())}

    def head_logits(self, batch: FeatureBatch) -> torch.Tensor:
        h, _ = self.features(batch.feats, batch.ids, batch.positions)
        return self.tokens.head(h[batch.rows, batch.cols])


@torch.no_grad()
def tree_report(
    model: CTCDraftLM, data: TargetData, budget: int = 8, width: int = 2, beams: int = 16
) -> dict:
    """Teacher-forced quality of the slots on ``data``: at every anchor, the candidate tree the
    drafter would propose (:func:`~specdraft.drafters.ctc.candidate_tree`, ``budget`` nodes) walked
    along the target's next ``labels`` tokens (greedy acceptance).

    Returns:
        ``{"anchors", "first_token", "accepted_per_tree"}``: anchors scored, the share whose tree
        holds the target's next token under the root, the mean tokens accepted (at most ``labels``).
    """
    was, keep = model.training, model.anchors
    model.eval()
    model.anchors = 1 << 30  # every anchor
    accepted = []
    for s in range(0, len(data), 8):
        batch = model.make_batch(data, list(range(s, min(s + 8, len(data)))), 320)
        _, hs = model.features(batch.feats, batch.ids, batch.positions, batch)
        if hs is None:
            continue
        logp = model.slot_logprobs(hs)  # (A, S, N + 1)
        alignments, _ = alignment_beams(logp, width, beams)
        for a, labels in enumerate(batch.anchor_labels.tolist()):
            tree = candidate_tree(alignments[a], logp.shape[-1] - 1, budget)
            accepted.append(_walk(tree, labels))
    model.anchors = keep
    model.train(was)
    n = len(accepted)
    return {
        "anchors": n,
        "first_token": round(sum(x > 0 for x in accepted) / n, 4) if n else 0.0,
        "accepted_per_tree": round(sum(accepted) / n, 4) if n else 0.0,
    }


def _walk(tree, labels: list[int]) -> int:
    """How many of ``labels`` a greedy verification of ``tree`` accepts."""
    node, n = -1, 0
    kids = tree.children if tree is not None else {}
    for tok in labels:
        nxt = [c for c in kids.get(node, []) if int(tree.tokens[c]) == tok]
        if not nxt:
            break
        node, n = nxt[0], n + 1
    return n
