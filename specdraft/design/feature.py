"""A feature-conditioned draft (EAGLE-style): it reads the target's final hidden state too.

At position p the draft is fed a pair: the target's final hidden state ``f_p`` (after the final
norm; the target computes it while verifying anyway) and the embedding of the token at ``p + 1``.
``fc`` maps the concatenation ``[f_p, e_{p+1}]`` (2C) to C, one decoder layer (with its own KV
cache over earlier pairs) and the final norm predict ``f_{p+1}``, and the target's head turns that
into the token at ``p + 2``. Drafting further, the draft feeds back its own predicted features.

Training (offline, on the cached answers with their hidden states) combines the token loss of
:mod:`specdraft.design.train` with a smooth-L1 regression of ``f_{p+1}``; input features get a
little uniform noise, since at inference the draft reads its own imperfect features after the first
step (EAGLE does the same).

The draft's context starts ``prompt_pairs`` pairs before the last prompt token, in training (from
the data's ``prompt_hidden``) as at inference (the engine keeps the prefill's features): 0, the
answer's pairs only, relies on the target's feature to carry the prompt; more lets the draft attend
to the prompt's pairs and copy from them (EAGLE feeds the whole prompt). The labelled pairs are
the answer's, and the last prompt pair's (its label is the answer's first token, which such a draft
proposes at the first step after the prefill).

Trade-off: the first draft token of a step is conditioned on the target's own state, so acceptance
is much higher than for a token-only draft of the same size, at the same per-token cost (fc is
0.66 M multiply-adds next to a 3.5 M layer). The price is coupling: the engine must ask the target
for its final hidden state (an ``Engine`` over this drafter does by default), the draft only works
with the target it was trained on, and it cannot be exported to engines that lack feature drafting
(transformers' ``assistant_model`` cannot host it); its directory format is specdraft's own
(``kind = "feature"`` plus ``fc.weight``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.design.data import TargetData
from specdraft.design.train import Batch, distill_loss
from specdraft.errors import SpecdraftError


@dataclass
class FeatureBatch(Batch):
    """A :class:`~specdraft.design.train.Batch` of pairs (right-padded), plus features.

    Attributes:
        feats: ``(B, T, C)`` input features ``f_p``.
        positions: ``(B, T)`` positions p of the pairs.
        feat_target: ``(M, C)`` the target's next feature ``f_{p+1}`` at each labelled pair.
    """

    feats: torch.Tensor = None
    positions: torch.Tensor = None
    feat_target: torch.Tensor = None


class FeatureDraftLM(torch.nn.Module):
    """The trainable feature-conditioned draft.

    Args:
        draft: a ``LlamaForCausalLM`` (its layers and norm are used; embedding/head are the target's).
        head_tokens: ``(N,)`` ids the head predicts, or None for the whole vocabulary.
        fc: ``(C, 2C)`` initial fc weight (default ``[0.1 I | I]``: mostly the token's embedding,
            a little of the feature; training finds the mix).
        noise: half-width of the uniform noise added to input features in training.
        reg_weight: weight of the feature regression loss.
        prompt_pairs: prompt pairs read before the last prompt position (module docstring).
        second_weight: weight of the same losses at the second draft position, which reads the
            draft's own predicted feature (:meth:`second_position`; EAGLE-3's training-time test,
            one step deep); 0: trained on real features only.
    """

    def __init__(
        self,
        draft,
        head_tokens: torch.Tensor | None,
        fc: torch.Tensor | None = None,
        noise: float = 0.1,
        reg_weight: float = 1.0,
        prompt_pairs: int = 0,
        second_weight: float = 0.0,
    ):
        super().__init__()
        from specdraft.design.train import DraftLM

        self.tokens = DraftLM(draft, head_tokens)  # embedding, head subset, layers
        C = draft.config.hidden_size
        if fc is None:
            fc = torch.cat([0.1 * torch.eye(C), torch.eye(C)], dim=1)
        if fc.shape != (C, 2 * C):
            raise SpecdraftError(f"fc weight must be ({C}, {2 * C}), got {tuple(fc.shape)}")
        self.fc = torch.nn.Linear(2 * C, C, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(fc)
        self.noise = noise
        self.reg_weight = reg_weight
        self.prompt_pairs = prompt_pairs
        self.second_weight = second_weight

    @property
    def draft(self):
        return self.tokens.draft

    @property
    def to_sub(self) -> torch.Tensor:
        return self.tokens.to_sub

    @property
    def head_tokens(self) -> torch.Tensor:
        return self.tokens.head_tokens

    def trainable(self) -> list[torch.nn.Parameter]:
        return self.tokens.trainable() + [self.fc.weight]

    def own_state(self) -> dict[str, torch.Tensor]:
        return {**self.tokens.own_state(), "fc.weight": self.fc.weight.detach()}

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        if "fc.weight" not in state:
            raise SpecdraftError("weights lack fc.weight: not a feature-conditioned draft")
        with torch.no_grad():
            self.fc.weight.copy_(state.pop("fc.weight"))
        self.tokens.load_own_state(state)

    def features(
        self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask=None
    ) -> torch.Tensor:
        """``(B, T, C)`` features, ``(B, T)`` next tokens and positions -> ``(B, T, C)`` predicted next
        features (causal, or under a boolean ``mask (B, T, T)`` of which pairs each one reads)."""
        emb = self.draft.get_input_embeddings()(tokens)
        x = self.fc(torch.cat([feats, emb], dim=-1))
        if mask is not None:  # transformers takes a 4D additive mask as it is
            mask = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, torch.finfo(x.dtype).min)[
                :, None
            ]
        out = self.draft.model(inputs_embeds=x, position_ids=positions, attention_mask=mask, use_cache=False)
        return out.last_hidden_state

    def _second(self, batch: FeatureBatch, feats: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` the draft's features at the second draft position of every pair, from input
        features ``feats`` and the first position's predictions ``h`` over them (:meth:`second_position`)."""
        B, T = batch.ids.shape
        drafted = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)  # (B, T, C): f_hat of pair t - 1
        i = torch.arange(T)
        real = i[None, :] <= i[:, None]  # (T, T) causal
        none, own = torch.zeros(T, T, dtype=torch.bool), torch.eye(T, dtype=torch.bool)
        mask = torch.cat([torch.cat([real, none], 1), torch.cat([real.tril(-1), own], 1)])  # (2T, 2T)
        twice = (torch.cat([feats, drafted], 1), batch.ids.repeat(1, 2), batch.positions.repeat(1, 2))
        return self.features(*twice, mask.expand(B, 2 * T, 2 * T))[:, T:]

    def second_position(self, batch: FeatureBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy hits of the first draft position (:meth:`predict`'s), of the *second*, which reads
        the draft's own feature, and where the first was right: ``(hit1, hit2, first_right)``,
        ``(M,)`` booleans over the labelled pairs.

        At labelled pair t the second draft position feeds the pair ``(f_hat, token p_t + 1)``, with
        ``f_hat`` what the draft predicted at pair t - 1 from real features, and reads the real pairs
        before t: its label is pair t's. All of them run in one forward over the real pairs followed
        by these drafted pairs (each drafted pair sees the real ones before it and itself), as in
        EAGLE-3's training-time test. ``first_right``: the teacher-forced prediction at pair t - 1 was
        its label (so the draft's first token was accepted and ``token p_t + 1`` is what it proposed).
        """
        B, T = batch.ids.shape
        with torch.no_grad():
            h = self.features(batch.feats, batch.ids, batch.positions)  # (B, T, C) from real features
            hit1 = self.tokens.head(h[batch.rows, batch.cols]).argmax(-1) == batch.target  # (M,)
            h2 = self._second(batch, batch.feats, h)[batch.rows, batch.cols]
            hit2 = self.tokens.head(h2).argmax(-1) == batch.target
        at = torch.zeros(B, T, dtype=torch.bool)
        at[batch.rows, batch.cols] = hit1
        first_right = (batch.cols > 0) & at[batch.rows, (batch.cols - 1).clamp(min=0)]
        return hit1, hit2, first_right

    def make_batch(self, data: TargetData, idx: list[int], max_len: int) -> FeatureBatch:
        """Pairs ``(f_p, token p + 1)`` from ``prompt_pairs`` before the last prompt position to the
        answer's end (its first ``max_len``); labels, at the answer's pairs (and the last prompt
        pair when any is read): token p + 2 and ``f_{p+1}``."""
        if data.hidden is None or (self.prompt_pairs and data.prompt_hidden is None):
            raise SpecdraftError(
                "feature-conditioned drafts need data with hidden states (target_data(..., hidden=True"
                + (", prompt_hidden=True))" if self.prompt_pairs else "))")
            )
        to_sub = self.to_sub
        rows, cols, feats, toks, pos, tgt, topk, logp, ftgt = [], [], [], [], [], [], [], [], []
        for b, i in enumerate(idx):
            tokens, P, hid = data.tokens[i], data.prompt_lens[i], data.hidden[i]  # hid: (R, C)
            n = max(min(hid.shape[0] - 1, max_len), 0)  # answer pairs with a label
            m = min(self.prompt_pairs, P - 1)  # prompt pairs before them
            e = 1 if m else 0  # the last prompt pair (position P - 2) predicts the answer's first token
            pre = data.prompt_hidden[i][P - 1 - m :] if m else hid[:0]
            feats.append(torch.cat([pre, hid[:n]]))
            toks.append(tokens[P - m : P + n])
            pos.append(torch.arange(P - 1 - m, P - 1 + n))
            rows.append(torch.full((n + e,), b))
            cols.append(m - e + torch.arange(n + e))
            tgt.append(to_sub[tokens[P + 1 - e : P + 1 + n]])
            topk.append(to_sub[data.topk_idx[i][1 - e : 1 + n]])
            logp.append(data.topk_logp[i][1 - e : 1 + n])
            ftgt.append(hid[1 - e : 1 + n])
        B, C = len(idx), self.draft.config.hidden_size
        T = max(1, max(f.shape[0] for f in feats))
        F_in = torch.zeros(B, T, C)
        ids = torch.zeros(B, T, dtype=torch.int64)
        positions = torch.zeros(B, T, dtype=torch.int64)
        for b in range(B):
            n = feats[b].shape[0]
            F_in[b, :n], ids[b, :n] = feats[b], toks[b]
            positions[b, :n] = pos[b]
            if n < T:  # padding continues the positions (it comes after every real pair)
                positions[b, n:] = (pos[b][-1] if n else 0) + 1 + torch.arange(T - n)
        return FeatureBatch(
            ids,
            torch.cat(rows),
            torch.cat(cols),
            torch.cat(tgt),
            torch.cat(topk),
            torch.cat(logp),
            torch.ones(sum(r.shape[0] for r in rows)),
            feats=F_in,
            positions=positions,
            feat_target=torch.cat(ftgt),
        )

    def loss(self, batch: FeatureBatch, cfg) -> tuple[torch.Tensor, dict]:
        feats = batch.feats
        if self.training and self.noise:
            feats = feats + (torch.rand_like(feats) * 2 - 1) * self.noise
        full = self.features(feats, batch.ids, batch.positions)  # (B, T, C)
        loss, parts = self._losses(full[batch.rows, batch.cols], batch, cfg)
        if self.second_weight:  # the second draft position, reading the draft's own features
            h2 = self._second(batch, feats, full)[batch.rows, batch.cols]
            after_first = dataclasses.replace(batch, weight=batch.weight * (batch.cols > 0))  # a pair before
            second, more = self._losses(h2, after_first, cfg)
            loss = loss + self.second_weight * second
            parts["second_ce"] = more["ce"]
        return loss, parts

    def _losses(self, h: torch.Tensor, batch: FeatureBatch, cfg) -> tuple[torch.Tensor, dict]:
        """Token distillation and feature regression of predicted features ``h (M, C)`` at the
        labelled pairs of non-zero ``batch.weight``."""
        loss, parts = distill_loss(self.tokens.head(h), batch, cfg.ce_weight, cfg.kl_weight)
        keep = batch.weight > 0
        reg = F.smooth_l1_loss(h[keep], batch.feat_target[keep])
        parts["reg"] = float(reg.detach())
        return loss + self.reg_weight * reg, parts

    def head_logits(self, batch: FeatureBatch) -> torch.Tensor:
        """``(N, H)`` head logits at the labelled pairs (from the target's real features)."""
        h = self.features(batch.feats, batch.ids, batch.positions)[batch.rows, batch.cols]
        return self.tokens.head(h)

    def predict(self, batch: FeatureBatch) -> torch.Tensor:
        """Greedy first-draft-token predictions (from the target's real features)."""
        return self.head_logits(batch).argmax(-1)
