"""FlexDraft: the next step's draft computed inside the current verification forward.

After FlexDraft (arXiv 2605.20022, code Yaro1214/FlexDraft). From a split layer s of the target,
mask tokens appended to the verification forward go through layers s..L-1 with the draft's own
attention projectors and read the real tokens' keys/values (:mod:`specdraft.models.mask_rows`).
A step verifies ``[last, d_1 .. d_k]`` at positions ``P .. P + k``; how many drafts the target
accepts is unknown until verification, so the forward carries k + 1 *groups* of m mask tokens, one
per possible accepted count n: group n sits at positions ``P + n + 1 .. P + n + m`` and reads the
real tokens up to ``P + n``. After verification, group n (n the accepted count) holds the next
step's draft whatever n was: its mask token i predicts the token at ``P + n + 2 + i``, the i-th
draft after the bonus token (the target's token at ``P + n + 1``).

The bonus token is known only after verification, and the mask tokens could not read it; a
*bonus-guided calibration* corrects each draft position with it::

    h' = h + U silu(D [E[bonus]; h])      D: (R, 2C), U: (C, R), R = 256 in the paper
    q  = softmax(lm_head(h'))            the target's frozen head

Since the head is linear this is a rank-R correction of the draft logits. The head may be a subset
of the vocabulary (the N tokens the target emits most, as other designed drafts): the LM head costs
as much per row as a few target layers, and the draft's rows pay it every step; tokens outside the
subset get q = 0, which verification handles like any q.

The engine runs the parallel mode as its own step (:meth:`specdraft.engine.Engine._flex_step`,
chosen by the capability :attr:`FlexDrafter.drafts_in_forward` while the batch has at most
:attr:`FlexDrafter.switch_batch` rows). Above the switch, or before any verification forward
carried mask tokens (the first step), the engine's ordinary loop calls :meth:`FlexDrafter.propose`,
which runs one group of mask tokens alone over the committed cache (reading real tokens up to
``L - 2``, the bonus being the last committed token): the sequential mode, same draft model.

Mask tokens never change the target's cache or its logits for real tokens, and each draft token
is sampled from the q it is verified against (the m tokens of a group independently: they do not
read each other's tokens), so the drafter is lossless like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.drafters.base import DraftContext, DraftState, Proposal, Verified, take_token
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime, linear
from specdraft.models.mask_rows import MaskRows, forward_with_masks, mask_hidden


@dataclass
class FlexWeights:
    """A FlexDraft draft's own tensors (the rest is the target's).

    Attributes:
        split: first target layer the mask tokens go through.
        mask: ``(C,)`` the mask embedding, their input at layer ``split``.
        wqkv: per layer from ``split``: the draft's fused q/k/v projection ``((H + 2G) D, C)``.
        wo: per layer from ``split``: the draft's output projection ``(C, H D)``.
        down: ``(R, 2C)`` calibration's first projection, over ``[E[bonus]; h]``.
        up: ``(C, R)`` calibration's second projection (zeros: no correction).
    """

    split: int
    mask: torch.Tensor
    wqkv: list[torch.Tensor]
    wo: list[torch.Tensor]
    down: torch.Tensor
    up: torch.Tensor

    @classmethod
    def init(cls, target: LlamaRuntime, split: int, rank: int = 256, seed: int = 0) -> FlexWeights:
        """Untrained: the target's own projections, a small random mask embedding (its direction is
        what the first norm passes on; zero would give every query zero), no calibration."""
        n = len(target.layers)
        if not 0 <= split < n:
            raise SpecdraftError(f"split layer {split} invalid for a {n}-layer target (0..{n - 1})")
        C = target.w.hidden_size
        dt = target.dtype
        g = torch.Generator().manual_seed(seed)
        return cls(
            split=split,
            mask=(0.02 * torch.randn(C, generator=g)).to(dt),
            wqkv=[layer.wqkv.clone() for layer in target.layers[split:]],  # the target's weight dtype
            wo=[layer.wo.clone() for layer in target.layers[split:]],
            down=(torch.randn(rank, 2 * C, generator=g) / (2 * C) ** 0.5).to(dt),
            up=torch.zeros(C, rank, dtype=dt),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors, as a draft directory stores them."""
        out = {"flex.mask": self.mask, "flex.calib.down": self.down, "flex.calib.up": self.up}
        for i, (q, o) in enumerate(zip(self.wqkv, self.wo)):
            out[f"flex.wqkv.{i}"], out[f"flex.wo.{i}"] = q, o
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], split: int, n_layers: int) -> FlexWeights:
        need = ["flex.mask", "flex.calib.down", "flex.calib.up"]
        need += [f"flex.{k}.{i}" for i in range(n_layers - split) for k in ("wqkv", "wo")]
        lacking = [k for k in need if k not in t]
        if lacking:
            raise SpecdraftError(f"flex draft lacks {lacking[0]}: corrupted, or made for another target")
        L = n_layers - split
        return cls(
            split,
            t["flex.mask"],
            [t[f"flex.wqkv.{i}"] for i in range(L)],
            [t[f"flex.wo.{i}"] for i in range(L)],
            t["flex.calib.down"],
            t["flex.calib.up"],
        )


def group_rows(weights: FlexWeights, visible: torch.Tensor, block: int) -> MaskRows:
    """Mask rows for groups that read real tokens up to ``visible (B, A)``: group a's m = ``block``
    tokens sit at positions ``visible[:, a] + 1 .. visible[:, a] + m``."""
    B, A = visible.shape
    i = torch.arange(block)
    positions = (visible.unsqueeze(-1) + 1 + i).reshape(B, A * block)  # (B, A m)
    return MaskRows(
        x=weights.mask.expand(B, A * block, -1),
        positions=positions,
        visible=visible.repeat_interleave(block, dim=1),
        group=torch.arange(A).repeat_interleave(block),
        split=weights.split,
        wqkv=weights.wqkv,
        wo=weights.wo,
    )


def calibrate(
    h: torch.Tensor, bonus_embed: torch.Tensor, down: torch.Tensor, up: torch.Tensor
) -> torch.Tensor:
    """Bonus-guided calibration (module docstring): ``h (..., C)`` and the bonus token's embedding
    ``(..., C)`` -> the corrected hidden state ``(..., C)``."""
    z = torch.cat([bonus_embed.to(h.dtype), h], dim=-1)  # (..., 2C)
    return h + F.linear(F.silu(F.linear(z, down.to(h.dtype))), up.to(h.dtype))


class FlexState(DraftState):
    """The draft each row has ready from the last verification forward.

    Attributes:
        hidden: ``(B, m, C)`` the mask group's hidden states for the next step (None: none yet).
        bonus: ``(B,)`` the bonus token that group follows.
        ready: ``(B,)`` the committed length the ready draft continues (-1: none).
    """

    def __init__(self, batch_size: int):
        super().__init__(batch_size)
        self.hidden = None
        self.bonus = torch.zeros(batch_size, dtype=torch.int64)
        self.ready = torch.full((batch_size,), -1, dtype=torch.int64)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.bonus, self.ready = self.bonus[rows], self.ready[rows]
        self.hidden = None if self.hidden is None else self.hidden[rows]

    def append(self, other: FlexState) -> None:
        super().append(other)
        self.bonus = torch.cat([self.bonus, other.bonus])
        self.ready = torch.cat([self.ready, torch.full_like(other.ready, -1)])
        if self.hidden is not None:
            pad = self.hidden.new_zeros(other.batch_size, *self.hidden.shape[1:])
            self.hidden = torch.cat([self.hidden, pad])


class FlexDrafter:
    """Drafts inside the target's verification forward (module docstring).

    Args:
        target: the target's compact runtime: the engine must verify with this very runtime.
        weights: the draft's tensors.
        name: shown in statistics.
        block: m, draft tokens per group (the most a step proposes).
        switch_batch: the engine's parallel step runs up to this many rows; above, the
            sequential mode (:meth:`propose` drafts on its own).
        head_tokens: ``(N,)`` ids the draft's head scores (None: the whole vocabulary).
    """

    drafts_in_forward = True  # the engine's capability check: Engine._flex_step

    def __init__(
        self,
        target: LlamaRuntime,
        weights: FlexWeights,
        name: str = "flex",
        block: int = 4,
        switch_batch: int = 4,
        head_tokens: torch.Tensor | None = None,
    ):
        if not isinstance(target, LlamaRuntime):
            raise SpecdraftError(
                "FlexDraft drafts inside the compact runtime's forward: use a bf16 or fp32 target (--dtype)"
            )
        if type(target) is not LlamaRuntime:  # the mask tokens' layers are the Llama layer's math only
            raise SpecdraftError(f"FlexDraft runs Llama-family targets only, not {type(target).__name__}")
        if len(weights.wqkv) != len(target.layers) - weights.split:
            raise SpecdraftError("flex draft's projectors do not match the target's layers from its split")
        if block < 1:
            raise SpecdraftError(f"flex block must be >= 1, got {block}")
        self.target, self.weights = target, weights
        self.name, self.vocab_size = name, target.vocab_size
        self.block, self.switch_batch = block, switch_batch
        self.head_tokens = head_tokens
        lm_head = target.w.lm_head
        self.head = lm_head if head_tokens is None else lm_head[head_tokens].contiguous()  # (N, C)

    def new_state(self, batch_size: int, capacity: int) -> FlexState:
        return FlexState(batch_size)

    def forward_with_masks(self, state, tokens: torch.Tensor, positions: torch.Tensor, **kw):
        """The target's forward over ``[last, d_1 .. d_k]`` at ``positions (B, k + 1)`` with one mask
        group per possible accepted count; returns the forward's output and ``(B, k + 1, m, C)``."""
        rows = group_rows(self.weights, positions, self.block)
        out, h = forward_with_masks(self.target, state, tokens, positions, rows, **kw)
        return out, h.view(*positions.shape, self.block, -1)

    def take(
        self, state: FlexState, groups: torch.Tensor, num_accepted: torch.Tensor, bonus, lengths
    ) -> None:
        """Keep each row's group ``num_accepted`` of ``groups (B, k + 1, m, C)`` as the draft that
        follows ``bonus (B,)``, valid at committed length ``lengths (B,)``."""
        state.hidden = groups[torch.arange(groups.shape[0]), num_accepted]  # (B, m, C)
        state.bonus, state.ready = bonus.clone(), lengths.clone()

    def _sequential(self, state: FlexState, ctx: DraftContext, rows: torch.Tensor) -> None:
        """Draft ``rows`` alone: one mask group over the committed cache (real tokens up to L - 2)."""
        if ctx.target_state is None:
            raise SpecdraftError(
                "FlexDraft's sequential mode needs the target's cache (DraftContext.target_state)"
            )
        L = ctx.lengths
        visible = (L - 2).unsqueeze(1)  # (B, 1)
        with torch.inference_mode():
            h = mask_hidden(self.target, ctx.target_state, group_rows(self.weights, visible, self.block))
        if state.hidden is None:
            state.hidden = h.new_zeros(h.shape)
        state.hidden[rows] = h[rows]
        state.bonus[rows] = ctx.tokens.gather(1, (L - 1).unsqueeze(1))[rows, 0]
        state.ready[rows] = L[rows]

    @torch.inference_mode()
    def propose(self, state: FlexState, ctx: DraftContext, k: int) -> Proposal:
        B, m = ctx.lengths.shape[0], min(k, self.block)
        stale = state.ready != ctx.lengths
        if bool(stale.any()):
            self._sequential(state, ctx, stale)
        w = self.target.w
        h = calibrate(
            state.hidden[:, :m],
            w.embed[state.bonus].unsqueeze(1).expand(-1, m, -1),
            self.weights.down,
            self.weights.up,
        )
        logits = self._logits(h)  # (B, m, V)
        draft = torch.zeros(B, k, dtype=torch.int64)
        probs = None
        for i in range(m):  # independent positions: none reads another's token
            probs, _ = take_token(logits[:, i], ctx, draft, probs, i)
        return Proposal(tokens=draft, probs=probs, num_valid=torch.full((B,), m))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """``(B, m, C)`` calibrated states -> ``(B, m, V)`` logits (``-inf`` outside the head)."""
        if self.head_tokens is None:
            return linear(h, self.head, None, self.target.w.q_head).float()
        sub = linear(h, self.head, None, None).float()  # (B, m, N)
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.head_tokens] = sub
        return full

    def observe(self, state: FlexState, num_accepted: torch.Tensor, verified: Verified | None = None) -> None:
        pass  # the next draft is taken from the forward (take) or made in propose


def from_spec(spec, target):
    """``flex`` (an untrained draft split at the target's last layer: for checking the machinery)."""
    if not isinstance(target.runtime, LlamaRuntime):
        raise SpecdraftError(
            "FlexDraft drafts inside the compact runtime's forward: use a bf16 or fp32 target (--dtype)"
        )
    split = int(spec.arg) if spec.arg else len(target.runtime.layers) - 1
    return FlexDrafter(target.runtime, FlexWeights.init(target.runtime, split), f"flex:{split}")
