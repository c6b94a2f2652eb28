"""Designed drafts (``specdraft design``) in the engine: a small Llama, often with a smaller LM head.

A designed draft's head may cover only a subset of the vocabulary (the tokens the target emits
most often, :mod:`specdraft.design.vocab`). :class:`SubsetHeadRuntime` computes logits for those
N rows only and hands the loop full-vocabulary logits with ``-inf`` elsewhere, so

- greedy: the draft proposes ``argmax`` over the subset; the target accepts a token only if it is
  the target's own argmax, so output equals plain decoding whatever the draft proposes;
- sampling: q (softmax of those logits, after the same temperature / top-k / top-p as p) is a
  full-vocabulary distribution that is exactly zero outside the subset. Every proposed token has
  q > 0, and rejection sampling (accept with ``min(1, p/q)``, else sample ``norm(max(p - q, 0))``)
  emits tokens distributed exactly as p for *any* q: the subset only lowers acceptance.

The target verifies over its whole vocabulary in both cases; ``tests/design`` checks both.

Spec strings (``--draft``):

- ``designed:PATH``: a draft directory (``specdraft design ... --out PATH``);
- ``designed:NAME``: ``drafts/NAME`` of this repository;
- ``designed:auto`` (what ``default`` means): the committed draft designed for this target when
  there is one, else prompt lookup (so ``--draft default`` works with every target).

Proposing only what pays (:class:`GatedDrafter`). On a CPU, verifying n > 1 tokens costs a
multiple of a 1-token step (``T_target(n) / T_target(1)`` is 2-4 on this AVX2 machine: the matmuls
leave the matrix-vector path), so a draft token that is likely rejected makes the step slower than
plain decoding. The drafter drafts k tokens, estimates the chance that the first i all pass as the
product of its own confidences ``P_i = prod_{j <= i} c_j`` (c: the draft's probability of its token;
distillation leaves it roughly calibrated), and proposes the prefix length m that maximises the
analytic model's tokens per unit time, ``(1 + sum_{i <= m} P_i) / cost(m)`` with ``cost(0) = 1``
(a plain step) and ``cost(m) = T_target(m + 1) / T_target(1) + (m - 1) T_draft / T_target(1)``;
m = 0 means "decode plainly this step". The ratios are measured once on the running machine
(:class:`VerifyCost`).

Which prefix is proposed depends only on the draft, never on the target. Greedy, that is all it
takes: the target accepts a token only if it is its own argmax, whatever is proposed. Sampling
needs more: rejection sampling assumes each proposed token is distributed as its q, so whether
position i is proposed may not depend on the token drawn there (gating on the sampled token's own
probability proposes likely draws more often than q does: with k = 1, q = (0.6, 0.4), p = (0.3, 0.7)
and "propose if q(x) > 0.5", P(A) = 0.42, not 0.3). Sampling rows therefore decide position by
position, before its token is drawn: c_i is ``max q_i`` (the draft's distribution, not its draw),
and position i is proposed when the best prefix of ``c_1 .. c_i`` continued with ``c_i`` reaches
it; the first position left out ends the proposal. The proposal length is then a stopping time of
the drafted tokens, and every proposed token is an unfiltered draw from its q
(``tests/test_tv_all_drafters.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal, take_token
from specdraft.drafters.model import ModelDrafter, catch_up_positions
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime, LlamaWeights

DRAFTS_DIR = Path(__file__).resolve().parents[2] / "drafts"


class SubsetHeadRuntime:
    """A runtime whose head scores only ``token_ids``; returns full-vocabulary logits (``-inf`` elsewhere).

    Args:
        runtime: the draft's runtime; its logits are over ``token_ids`` in that order ``(B, T, N)``.
        token_ids: ``(N,)`` full-vocabulary id of each head row.
        vocab_size: the full vocabulary size V.
    """

    def __init__(self, runtime, token_ids: torch.Tensor, vocab_size: int):
        if token_ids.numel() != runtime.vocab_size:
            raise SpecdraftError(f"head has {runtime.vocab_size} rows but {token_ids.numel()} token ids")
        if int(token_ids.max()) >= vocab_size or int(token_ids.min()) < 0 or token_ids.unique().numel() != token_ids.numel():
            raise SpecdraftError(f"head token ids must be distinct ids in 0..{vocab_size - 1}")
        self.runtime = runtime
        self.token_ids = token_ids.long()
        self.vocab_size = vocab_size
        self.max_context = runtime.max_context
        self.dtype = runtime.dtype

    def __repr__(self) -> str:
        return f"SubsetHeadRuntime({self.runtime!r}, head={self.token_ids.numel()}/{self.vocab_size})"

    def new_state(self, batch_size: int, capacity: int):
        return self.runtime.new_state(batch_size, capacity)

    def forward(self, state, tokens, positions, **kw):
        out = self.runtime.forward(state, tokens, positions, **kw)
        sub = out.logits  # (B, T, N)
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))  # (B, T, V)
        full.index_copy_(-1, self.token_ids, sub)
        out.logits = full
        return out


def draft_weights(draft, target_weights: LlamaWeights | None, head_tokens: torch.Tensor | None, dtype: torch.dtype) -> LlamaWeights:
    """Compact-runtime weights of a transformers draft.

    The embedding is the target's tensor when given (no copy); the head is the embedding's
    ``head_tokens`` rows (or the whole tied embedding). ``torch.qint8`` packs the draft's matmuls
    and its (smaller) head for the int8 runtime.
    """
    dense = torch.float32 if dtype == torch.qint8 else dtype
    w = LlamaWeights.from_hf(draft, dense)
    if target_weights is not None and target_weights.embed.shape == w.embed.shape and target_weights.dtype == dense:
        w.embed = target_weights.embed
        w.lm_head = target_weights.lm_head
    if head_tokens is not None:
        w.lm_head = w.lm_head[head_tokens].contiguous()  # (N, C)
    return w.quantize_int8() if dtype == torch.qint8 else w


def resolve_draft_dir(name: str) -> Path:
    """``designed:`` argument -> directory: an existing path, else ``drafts/<name>``."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    q = DRAFTS_DIR / name
    if q.is_dir():
        return q
    have = sorted(x.name for x in DRAFTS_DIR.iterdir() if (x / "specdraft.json").is_file()) if DRAFTS_DIR.is_dir() else []
    raise SpecdraftError(f"designed draft {name!r} not found: give a draft directory or one of {', '.join(have) or '(none committed)'}")


def find_default(target_model) -> Path | None:
    """The committed token-level draft (``drafts/*``) designed for this target, or None.

    Feature-conditioned drafts are never the default: they need engines built to hand them the
    target's hidden state, which not every caller does."""
    from specdraft.design.artifact import check_compatible, read_meta

    if not DRAFTS_DIR.is_dir():
        return None
    for d in sorted(DRAFTS_DIR.iterdir()):
        if not (d / "specdraft.json").is_file():
            continue
        try:
            meta = read_meta(d)
            check_compatible(meta, target_model, str(d))
        except SpecdraftError:
            continue
        if meta.kind == "layers":
            return d
    return None


def designed_drafter(spec: str, target, runtime, dtype: torch.dtype):
    """Build the drafter for a ``designed[:...]`` spec (see the module docstring).

    Args:
        spec: ``designed``, ``designed:auto``, ``designed:NAME`` or ``designed:PATH``.
        target: the target's :class:`~specdraft.models.loading.LoadedModel`.
        runtime: the target's runtime (its embedding tensor is shared when it is a compact runtime).
        dtype: compute dtype.
    """
    from specdraft.design.artifact import load_draft

    name = spec.split(":", 1)[1] if ":" in spec else "auto"
    if name == "auto":
        path = find_default(target.model)
        if path is None:
            from specdraft.drafters.prompt_lookup import PromptLookupDrafter

            return PromptLookupDrafter()
    else:
        path = resolve_draft_dir(name)
    draft, meta, extra = load_draft(path, target.model, torch.float32 if dtype == torch.qint8 else dtype)
    head = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
    tw = runtime.w if isinstance(runtime, LlamaRuntime) else None
    w = draft_weights(draft, tw, head, dtype)
    rt = LlamaRuntime(w)
    if head is not None:
        rt = SubsetHeadRuntime(rt, head, meta.vocab_size)
    if meta.kind == "feature":
        if "fc.weight" not in extra:
            raise SpecdraftError(f"feature draft {path} lacks fc.weight: corrupted")
        return FeatureDrafter(rt, extra["fc.weight"].to(w.compute_dtype), w.embed, f"designed:{path.name}")
    return GatedDrafter(rt, f"designed:{path.name}", target_runtime=runtime)


# ------------------------------------------------------------------------------------ gating
@dataclasses.dataclass
class VerifyCost:
    """Step costs relative to a plain 1-token target step.

    Attributes:
        target: ``target[n - 1] = T_target(n) / T_target(1)`` for n = 1..len (flat beyond).
        draft: ``T_draft / T_target(1)``, one draft token.
    """

    target: list[float]
    draft: float

    def step(self, m: int) -> float:
        """Relative cost of a step that proposes m tokens (the first draft forward is sunk)."""
        if m == 0:
            return 1.0
        return self.target[min(m + 1, len(self.target)) - 1] + (m - 1) * self.draft

    @classmethod
    def measure(cls, target, draft, n_max: int = 8, context: int = 64, reps: int = 3) -> "VerifyCost":
        """Median latencies on this machine (target sizes and the draft interleaved)."""
        from specdraft.design.search import measure_latency

        ns = tuple(sorted({1, 2, 3, 5, n_max + 1}))
        lat = measure_latency(target, {"draft": draft}, ns=ns, context=context, reps=reps)
        t = lat.target_fn()
        t1 = max(t(1), 1e-9)
        return cls([t(n) / t1 for n in range(1, n_max + 2)], lat.draft["draft"] / t1)


def best_prefix(conf: torch.Tensor, cost: VerifyCost) -> torch.Tensor:
    """``(B, k)`` per-token confidences -> ``(B,)`` prefix lengths m maximising
    ``(1 + sum_{i <= m} P_i) / cost(m)``, ``P_i = prod_{j <= i} conf_j``."""
    B, k = conf.shape
    expected = 1 + torch.cat([torch.zeros(B, 1), conf.cumprod(1).cumsum(1)], 1)  # (B, k + 1): m = 0..k
    costs = torch.tensor([cost.step(m) for m in range(k + 1)])  # (k + 1,)
    return (expected / costs).argmax(1)


def _propose_sampled(conf: torch.Tensor, k: int, cost: VerifyCost) -> torch.Tensor:
    """Whether a sampling row proposes position i, from ``(B, i)`` confidences ``c_1 .. c_i`` known
    before token i is drawn (``c_j = max q_j``): later positions are taken to be as likely as
    position i, and it is proposed if the best prefix of that curve reaches it. ``(B,)`` bool."""
    i = conf.shape[1]
    ahead = torch.cat([conf, conf[:, -1:].expand(-1, k - i)], 1)  # (B, k)
    return best_prefix(ahead, cost) >= i


def _worth_continuing(cum: torch.Tensor, k: int, cost: VerifyCost) -> torch.Tensor:
    """After i drafted tokens (``cum`` ``(B, i)``: P_1..P_i), could a longer prefix still win,
    per row? P never grows, so ``1 + sum_{j <= i} P_j + (m - i) P_i`` bounds the expected tokens of
    every prefix m > i: stopping here never changes the chosen prefix. ``(B,)`` bool."""
    i = cum.shape[1]
    expected = 1 + torch.cat([torch.zeros(cum.shape[0], 1), cum.cumsum(1)], 1)  # (B, i + 1): m = 0..i
    best = (expected / torch.tensor([cost.step(m) for m in range(i + 1)])).max(1).values
    bound = torch.stack([(expected[:, -1] + (m - i) * cum[:, -1]) / cost.step(m) for m in range(i + 1, k + 1)]).max(0).values
    return bound > best


class GatedDrafter(ModelDrafter):
    """A model drafter that proposes only the prefix of its k tokens that is expected to pay
    (module docstring), and stops drafting as soon as no longer prefix can pay for any row.
    Greedy rows choose the prefix after drafting; sampling rows choose it position by position,
    before each token is drawn, which keeps rejection sampling exact. ``cost`` is measured on the
    first proposal unless given.

    Args:
        runtime: the draft's runtime.
        name: shown in statistics.
        target_runtime: the target's runtime, timed once to get :class:`VerifyCost`.
        cost: the cost model (skips the measurement), e.g. ``VerifyCost([1.0] * 9, 0.0)`` to
            always propose all k.
    """

    stops_early = True  # proposals carry per-row ``steps`` (cost models and offline replays use them)

    def __init__(self, runtime, name: str, target_runtime=None, cost: VerifyCost | None = None):
        super().__init__(runtime, name)
        self.target_runtime = target_runtime
        self.cost = cost

    def propose(self, state, ctx: DraftContext, k: int) -> Proposal:
        if self.cost is None:
            if self.target_runtime is None:
                raise SpecdraftError("GatedDrafter needs a target runtime or a cost model")
            self.cost = VerifyCost.measure(self.target_runtime, self.runtime)
        B, L = ctx.lengths.shape[0], ctx.lengths
        # catch up on committed tokens the draft has not seen, as ModelDrafter does
        pending = L - state.fed  # (B,)
        P = int(pending.max())
        positions = catch_up_positions(state.fed, L, P)
        tokens = ctx.tokens.gather(1, positions.clamp(max=ctx.tokens.shape[1] - 1))
        logits = self.runtime.forward(state.kv, tokens, positions, logits_index=(pending - 1).unsqueeze(1)).logits[:, 0]

        sampling = torch.tensor([not p.greedy for p in ctx.params])  # (B,)
        draft = torch.zeros(B, k, dtype=torch.int64)
        conf = torch.zeros(B, k)  # the draft's probability of its argmax at each position
        probs = None
        made = k
        steps = torch.full((B,), k, dtype=torch.int64)  # forwards each row needs on its own
        num_valid = torch.full((B,), k, dtype=torch.int64)  # sampling rows: set where they stop
        going = torch.ones(B, dtype=torch.bool)
        for i in range(k):
            probs, q = take_token(logits, ctx, draft, probs, i)
            conf[:, i] = logits.float().softmax(-1).max(-1).values
            if q is not None:
                # sampling rows: max q_i, and propose token i or stop, both fixed before it was drawn
                conf[:, i] = torch.where(sampling, q.max(-1).values, conf[:, i])
                cut = going & sampling & ~_propose_sampled(conf[:, : i + 1], k, self.cost)
                num_valid[cut] = i
                steps[cut] = i + 1
                going &= ~cut
            if i + 1 < k:
                stop = going & ~sampling & ~_worth_continuing(conf[:, : i + 1].cumprod(1), k, self.cost)
                steps[stop] = i + 1
                going &= ~stop
                if not going.any():
                    made = i + 1
                    break
                logits = self.runtime.forward(state.kv, draft[:, i : i + 1], (L + i).unsqueeze(1)).logits[:, 0]
        state.fed = L.clone()
        state.base = L.clone()
        state.k = made
        # greedy rows: the best prefix of all drafted tokens (any proposal leaves greedy output exact)
        num_valid = torch.where(sampling, num_valid, best_prefix(conf[:, :made], self.cost))
        return Proposal(tokens=draft, probs=probs, num_valid=num_valid, steps=steps)


# ------------------------------------------------------------------------------------ feature drafts
class FeatureDraftState(DraftState):
    """The feature draft's cache, and where each row's target features are.

    Attributes:
        src: ``(B,)`` row of the last target forward's hidden states that belongs to each row
            (-1: a row that joined since, or none yet).
        prev_L: ``(B,)`` committed length when that forward ran (-1: unknown).
        start: ``(B,)`` first position of the draft's context; cache slots before it are masked
            (-1: no context yet).
    """

    def __init__(self, runtime, batch_size: int, capacity: int):
        super().__init__(batch_size)
        self.kv = runtime.new_state(batch_size, capacity)
        self.src = torch.full((batch_size,), -1, dtype=torch.int64)
        self.prev_L = torch.full((batch_size,), -1, dtype=torch.int64)
        self.start = torch.full((batch_size,), -1, dtype=torch.int64)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.kv.select_rows(rows)
        self.src, self.prev_L, self.start = self.src[rows], self.prev_L[rows], self.start[rows]

    def append(self, other: "FeatureDraftState") -> None:
        super().append(other)
        self.kv.append(other.kv)
        self.src = torch.cat([self.src, torch.full_like(other.src, -1)])
        self.prev_L = torch.cat([self.prev_L, other.prev_L])
        self.start = torch.cat([self.start, other.start])


class FeatureDrafter:
    """EAGLE-style drafting from the target's final hidden state (see :mod:`specdraft.design.feature`).

    Each step it feeds the pairs ``(f_p, token p + 1)`` for the positions the target verified last
    step (their features are real), then drafts on its own predicted features. It needs the engine
    to hand it the target's final hidden state: build the engine with ``hidden_layers=(-1,)``
    (:attr:`hidden_layers`; ``Pipeline.engine`` does). Rows without features yet (the first step
    after the prompt) propose nothing that step. Wrong or missing features can only cost acceptance:
    verification is unchanged.

    Args:
        runtime: the draft's runtime (a :class:`LlamaRuntime`, maybe inside a :class:`SubsetHeadRuntime`);
            its embedding table is replaced per call by the fc outputs it should read.
        fc: ``(C, 2C)`` weight of the input projection over ``[feature, token embedding]``.
        embed: ``(V, C)`` the target's token embedding.
        name: shown in statistics.
    """

    hidden_layers = (-1,)

    def __init__(self, runtime, fc: torch.Tensor, embed: torch.Tensor, name: str):
        self.runtime = runtime
        self.core = runtime.runtime if isinstance(runtime, SubsetHeadRuntime) else runtime
        self.core.w = dataclasses.replace(self.core.w)  # its own weights record: .embed is rewritten per call
        self.fc = fc
        self.embed = embed
        self.name = name
        self.vocab_size = runtime.vocab_size

    def new_state(self, batch_size: int, capacity: int) -> FeatureDraftState:
        return FeatureDraftState(self.runtime, batch_size, capacity)

    def _forward(self, state, feats, tokens, positions, index=None):
        """Feed pairs ``(B, T)``; returns full logits at ``index`` (or the last column) and features there."""
        B, T = tokens.shape
        x = torch.nn.functional.linear(torch.cat([feats, self.embed[tokens].to(feats.dtype)], dim=-1), self.fc)  # (B, T, C)
        self.core.w.embed = x.reshape(B * T, -1)
        S = int(positions.max()) + 1
        slots = torch.arange(S)
        mask = (slots >= state.start.view(B, 1, 1)) & (slots <= positions.unsqueeze(-1))  # (B, T, S)
        index = torch.full((B, 1), T - 1) if index is None else index
        out = self.runtime.forward(state.kv, torch.arange(B * T).view(B, T), positions, hidden_layers=(-1,), attn_mask=mask, logits_index=index)
        f = out.hidden[-1].gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))[:, 0]  # (B, C)
        return out.logits[:, 0], f

    def propose(self, state: FeatureDraftState, ctx: DraftContext, k: int) -> Proposal:
        B = ctx.lengths.shape[0]
        L = ctx.lengths
        hid = (ctx.target_hidden or {}).get(-1)  # (B', T', C) from the last target forward, or None
        have = state.src >= 0 if hid is not None else torch.zeros(B, dtype=torch.bool)
        draft = torch.zeros(B, k, dtype=torch.int64)
        probs = None
        if bool(have.any()):
            T_prev = hid.shape[1]
            known = state.prev_L >= 0
            c = torch.where(known, L - state.prev_L, torch.full_like(L, T_prev)).clamp(1, T_prev)  # (B,) real pairs
            c = torch.where(have, c, torch.ones_like(c))
            gap = ~known | (L - state.prev_L > T_prev) | (state.start < 0)
            state.start = torch.where(have & gap, L - 1 - c, state.start)
            C = int(c.max())
            j = torch.arange(C)
            positions = (L - 1 - c).unsqueeze(1) + j  # (B, C): pairs p = L-1-c .. L-2, padding after
            src = state.src.clamp(min=0)
            feats = hid[src][:, : min(C, T_prev)]  # (B, C, dim)
            if feats.shape[1] < C:
                feats = torch.cat([feats, feats.new_zeros(B, C - feats.shape[1], feats.shape[2])], 1)
            feats = feats * (j < c.unsqueeze(1)).unsqueeze(-1)
            tok = ctx.tokens.gather(1, (positions + 1).clamp(max=ctx.tokens.shape[1] - 1))  # token p + 1
            logits, f = self._forward(state, feats.to(self.fc.dtype), tok, positions, (c - 1).unsqueeze(1))
            for i in range(k):
                probs, _ = take_token(logits, ctx, draft, probs, i)
                if i + 1 < k:  # pair (f_hat at L-2+i+1, d_i+1) at position L-1+i
                    pos = (L - 1 + i).unsqueeze(1)
                    logits, f = self._forward(state, f.unsqueeze(1), draft[:, i : i + 1], pos)
        state.src = torch.arange(B)
        state.prev_L = L.clone()
        return Proposal(tokens=draft, probs=probs, num_valid=torch.where(have, k, 0))

    def observe(self, state: FeatureDraftState, num_accepted: torch.Tensor) -> None:
        pass  # what was committed is read from ctx.lengths at the next proposal
