"""Block-diffusion drafting with an adaptive length head (DFlash / AdaFlash style).

After DFlash (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036;
code z-lab/dflash) and AdaFlash ("AdaFlash: Adaptive Speculative Decoding via On-Policy Distilled
Diffusion Drafters", arXiv 2607.19223; code ZinYY/AdaFlash). Our own implementation.

**One forward per block.** With L committed tokens, the draft reads a block of ``block`` positions
``[token L-1 (the anchor), MASK x (block - 1)]`` at positions ``L-1 .. L-2+block``. Its decoder
layers (initialised from target layers, :mod:`specdraft.design.diffusion`) attend *bidirectionally
inside the block* and to a *context*: the target's final hidden states at the last ``window``
verified positions (``.. L-2``), projected by ``fc`` and fed as extra keys/values to every layer
(RoPE at their true positions). The frozen target head turns block position ``i + 1``'s output into
draft token i, so all ``block - 1`` tokens come out of that one pass::

    h = layers([anchor, MASK, .., MASK] | context = fc(f_{L-1-window} .. f_{L-2}))   # (B, block, C)
    q_i = softmax(head(h[:, i + 1]))                                                # draft token i

**Adaptive length head.** A small MLP over ``[h_anchor; mean_j h_j]`` predicts the accepted fraction
``a = (accepted + 1) / block`` of this block (trained with MSE). The drafter proposes
``n = clamp(round(a * block), 1, block - 1)`` tokens: the expected accepted ones plus one. ``n`` is
also the proposal's class (``Proposal.bucket``), so :class:`~specdraft.policy.CostAwareK` learns the
acceptance curve of each predicted length and cuts every row to the length that pays under the
measured ``T_target(n)`` (:meth:`~specdraft.policy.CostAwareK.trim`): the head caps the step, the
policy checks the cap against the latencies.

**Losslessness.** Every q_i and the head's n come from one pass over the committed context only,
before anything is sampled, so q_i is the distribution token i was drawn from given any prefix, and
the cut never depends on the drafted tokens: standard rejection sampling keeps the target's
distribution (tests/test_tv_all_drafters.py, case ``diffusion``).

**Cost.** ``Proposal.steps`` is 1: the study charges one draft forward per block, whatever k
(:mod:`specdraft.study`), and :attr:`DiffusionDrafter.drafts_blocks` tells the cost-aware policy the
same. The head's n is computed first, so the LM head (the larger half of a block's cost with an
8192-token head) runs only on the positions proposed. One denoising pass only (DFlash's
default): several passes are not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdraft.drafters.base import DraftContext, DraftState, Proposal, take_token
from specdraft.errors import SpecdraftError

PREFIX = "diffusion."  # the block drafter's own tensors in a draft directory
LEN_HIDDEN = 64  # the length head's width


@dataclass
class BlockArch:
    """The block drafter's shape (``arch`` in ``specdraft.json``).

    Attributes:
        block: positions per block, the anchor included (block - 1 draft tokens).
        window: target features the block reads as context (the last verified positions).
    """

    block: int = 16
    window: int = 8

    def __post_init__(self):
        if self.block < 2 or self.window < 1:
            raise SpecdraftError(f"block must be >= 2 and window >= 1, got {self.block}, {self.window}")


def init_tensors(C: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Initial block tensors: ``fc`` the identity (the context enters as the target's features),
    a small random mask embedding, a length head that starts at a = 0.5."""
    g = torch.Generator().manual_seed(seed)
    return {
        "fc": torch.eye(C),
        "mask": torch.randn(C, generator=g) * 0.02,
        "len1.weight": torch.randn(LEN_HIDDEN, 2 * C, generator=g) * (2 * C) ** -0.5,
        "len1.bias": torch.zeros(LEN_HIDDEN),
        "len2.weight": torch.zeros(1, LEN_HIDDEN),
        "len2.bias": torch.zeros(1),
    }


class BlockDiffusion(torch.nn.Module):
    """The block draft (module docstring): decoder layers of a transformers Llama, used without
    their causal mask, plus the block tensors. Training and the engine run this same module.

    Args:
        draft: a ``LlamaForCausalLM`` (its layers, norm and rotary embedding; its embedding is the
            target's, frozen).
        head_tokens: ``(N,)`` ids the head predicts (None: the whole vocabulary).
        tensors: :func:`init_tensors`' keys -> tensors.
        arch: block and window.
    """

    def __init__(self, draft, head_tokens: torch.Tensor | None, tensors: dict, arch: BlockArch):
        super().__init__()
        self.draft, self.arch = draft, arch
        emb = draft.get_input_embeddings().weight
        V = emb.shape[0]
        ids = torch.arange(V) if head_tokens is None else head_tokens.long()
        self.register_buffer("head_tokens", ids, persistent=False)
        dt = draft.model.norm.weight.dtype
        head = draft.get_output_embeddings().weight.detach()[ids].to(dt)
        self.register_buffer("head_w", head, persistent=False)  # (N, C) frozen
        lacking = [k for k in init_tensors(1) if k not in tensors]
        if lacking:
            raise SpecdraftError(f"block draft lacks {PREFIX}{lacking[0]}")
        self.t = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(tensors[k].to(dt)) for k in init_tensors(1)}
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The block tensors by their stored names (``fc``, ``mask``, ``len1.weight`` ..)."""
        return {k: self.t[k.replace(".", "_")] for k in init_tensors(1)}

    def _attend(self, layer, x: torch.Tensor, ctx: torch.Tensor, cos_sin, mask: torch.Tensor):
        """One layer's attention: block queries over ``[context; block]`` keys (no causal mask)."""
        a = layer.self_attn
        B, T, _ = x.shape
        D = a.head_dim
        h = layer.input_layernorm(x)
        kv_in = torch.cat([layer.input_layernorm(ctx), h], 1)  # (B, W + T, C)
        q = a.q_proj(h).view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        k = a.k_proj(kv_in).view(B, kv_in.shape[1], -1, D).transpose(1, 2)  # (B, G, W + T, D)
        v = a.v_proj(kv_in).view(B, kv_in.shape[1], -1, D).transpose(1, 2)
        cos, sin = cos_sin
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -T:], sin[:, -T:])
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))  # (B, H, T, D)
        return x + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def forward(self, feats: torch.Tensor, valid: torch.Tensor, anchor: torch.Tensor, L: torch.Tensor):
        """The block's hidden states.

        Args:
            feats: ``(B, W, C)`` target features at positions ``L-1-W .. L-2`` (right-aligned).
            valid: ``(B, W)`` which of them are real (at least one per row).
            anchor: ``(B,)`` token L-1.
            L: ``(B,)`` committed lengths.

        Returns:
            ``(B, block, C)`` after the final norm; position i + 1 predicts draft token i.
        """
        B, W, _ = feats.shape
        T, t = self.arch.block, self.tensors()
        dt = t["fc"].dtype
        ctx = F.linear(feats.to(dt), t["fc"])  # (B, W, C)
        x = t["mask"].expand(B, T, -1).clone()
        x[:, 0] = self.draft.get_input_embeddings()(anchor).to(dt)
        positions = (L - 1 - W).unsqueeze(1) + torch.arange(W + T)  # (B, W + T)
        cos_sin = self.draft.model.rotary_emb(x, positions.clamp(min=0))
        mask = torch.cat([valid, torch.ones(B, T, dtype=torch.bool)], 1).unsqueeze(1).expand(B, T, W + T)
        for layer in self.draft.model.layers:
            x = self._attend(layer, x, ctx, cos_sin, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.draft.model.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``(..., C)`` -> ``(..., N)`` logits over the head's tokens."""
        return F.linear(h, self.head_w)

    def accepted_fraction(self, h: torch.Tensor) -> torch.Tensor:
        """``(B, block, C)`` -> ``(B,)`` the predicted ``(accepted + 1) / block``, in (0, 1)."""
        t = self.tensors()
        z = torch.cat([h[:, 0], h[:, 1:].mean(1)], -1)
        z = F.silu(F.linear(z, t["len1.weight"], t["len1.bias"]))
        return torch.sigmoid(F.linear(z, t["len2.weight"], t["len2.bias"]))[:, 0]

    def length(self, h: torch.Tensor) -> torch.Tensor:
        """``(B,)`` draft tokens to propose: ``clamp(round(a * block), 1, block - 1)``."""
        n = torch.round(self.accepted_fraction(h) * self.arch.block).long()
        return n.clamp(1, self.arch.block - 1)


class BlockDraftState(DraftState):
    """Each row's context window of target features.

    Attributes:
        feats: ``(B, W, C)`` the features at positions ``.. L-2`` (right-aligned).
        count: ``(B,)`` real features in the window.
        src: ``(B,)`` row of the last target forward's hidden states (-1: none).
        prev_L: ``(B,)`` committed length when that forward ran (-1: unknown).
    """

    def __init__(self, batch_size: int, window: int, width: int):
        super().__init__(batch_size)
        self.feats = torch.zeros(batch_size, window, width)
        self.count = torch.zeros(batch_size, dtype=torch.int64)
        self.src = torch.full((batch_size,), -1, dtype=torch.int64)
        self.prev_L = torch.full((batch_size,), -1, dtype=torch.int64)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.feats, self.count = self.feats[rows], self.count[rows]
        self.src, self.prev_L = self.src[rows], self.prev_L[rows]

    def append(self, other: BlockDraftState) -> None:
        super().append(other)
        self.feats = torch.cat([self.feats, other.feats])
        self.count = torch.cat([self.count, other.count])
        self.src = torch.cat([self.src, torch.full_like(other.src, -1)])
        self.prev_L = torch.cat([self.prev_L, other.prev_L])

    def take(self, hidden: torch.Tensor | None, L: torch.Tensor) -> None:
        """Slide the features the last target forward verified (``hidden (B', T, C)``) into the
        windows: ``L - prev_L`` of them per row; a row that missed a forward starts over."""
        if hidden is None:
            return
        T, W = hidden.shape[1], self.feats.shape[1]
        have = (self.src >= 0) & (self.prev_L >= 0)
        c = torch.where(have, L - self.prev_L, torch.zeros_like(L))
        missed = self.src >= hidden.shape[0]  # plain steps ran after rows left the batch: start over
        gap = (c > T) | missed
        c = torch.where(missed, 0, c.clamp(0, T))
        self.count = torch.where(gap, 0, self.count)
        j = torch.arange(T)
        rows = self.src.clamp(0, hidden.shape[0] - 1)
        new = hidden[rows].to(self.feats.dtype) * (j < c.unsqueeze(1)).unsqueeze(-1)
        both = torch.cat([self.feats, new], 1)  # (B, W + T, C): row b's window ends at W + c_b
        idx = c.unsqueeze(1) + torch.arange(W)  # (B, W)
        self.feats = both.gather(1, idx.unsqueeze(-1).expand(-1, -1, both.shape[2]))
        self.count = (self.count + c).clamp(max=W)


class DiffusionDrafter:
    """The block drafter in the engine (module docstring).

    Args:
        model: the :class:`BlockDiffusion` (eval, frozen).
        name: shown in statistics.
        adaptive: propose the length head's n (else every block token up to k: a fixed block length).
    """

    drafts_blocks = True  # one draft forward per block, whatever k (the cost-aware policy reads it)

    def __init__(self, model: BlockDiffusion, name: str, adaptive: bool = True):
        self.model = model.eval().requires_grad_(False)
        self.name, self.adaptive = name, adaptive
        self.vocab_size = model.draft.get_input_embeddings().weight.shape[0]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (-1,)

    def new_state(self, batch_size: int, capacity: int) -> BlockDraftState:
        return BlockDraftState(batch_size, self.model.arch.window, self.model.head_w.shape[1])

    def profile_step(self, batch: int, context: int):
        """A callable running one draft step for the profiler: a block forward over a full window
        of (random) features at ``context``, every block token's logits and the length head."""
        W, C = self.model.arch.window, self.model.head_w.shape[1]
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(batch, W, C, generator=g)
        valid = torch.ones(batch, W, dtype=torch.bool)
        anchor, L = torch.zeros(batch, dtype=torch.int64), torch.full((batch,), context)

        @torch.no_grad()
        def step():
            h = self.model(feats, valid, anchor, L)
            return self.model.logits(h[:, 1:]).argmax(-1), self.model.length(h)

        return step

    def observe(self, state, num_accepted, verified=None) -> None:
        pass  # the next proposal reads the verified features and the committed length

    def _tokens(self, logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B, k, N)`` head logits -> ``(B, k)`` draft ids and q ``(B, k, V)`` (None when greedy)."""
        if ctx.all_greedy:
            return self.model.head_tokens[logits.argmax(-1)], None
        B, k, _ = logits.shape
        full = logits.new_full((B, k, self.vocab_size), float("-inf"))
        full[:, :, self.model.head_tokens] = logits
        draft, probs = torch.zeros(B, k, dtype=torch.int64), None
        for i in range(k):  # q_i does not depend on earlier draft tokens: one pass made them all
            probs, _ = take_token(full[:, i].float(), ctx, draft, probs, i)
        return draft, probs

    @torch.no_grad()
    def propose(self, state: BlockDraftState, ctx: DraftContext, k: int) -> Proposal:
        B, L = ctx.lengths.shape[0], ctx.lengths
        state.take((ctx.target_hidden or {}).get(-1), L)
        state.src, state.prev_L = torch.arange(B), L.clone()
        k = min(k, self.model.arch.block - 1)
        have = state.count > 0
        tokens, probs = torch.zeros(B, k, dtype=torch.int64), None
        n = torch.full((B,), k)
        if bool(have.any()) and k > 0:
            W = state.feats.shape[1]
            valid = torch.arange(W) >= (W - state.count).unsqueeze(1)  # (B, W) right-aligned
            valid[:, -1] |= ~have  # rows without features: one slot so attention is defined (unused)
            anchor = ctx.tokens.gather(1, (L - 1).unsqueeze(1))[:, 0]
            h = self.model(state.feats, valid, anchor, L)  # (B, block, C)
            if self.adaptive:  # the head's n first: the LM head then runs on the positions proposed
                n = self.model.length(h).clamp(max=k)
            cols = int(n[have].max())
            tokens, probs = self._tokens(self.model.logits(h[:, 1 : cols + 1]), ctx)  # (B, cols)
        num_valid = torch.where(have, n, 0)
        bucket = num_valid.clone() if self.adaptive else None
        return Proposal(tokens, probs, num_valid, steps=torch.ones(B, dtype=torch.int64), bucket=bucket)
