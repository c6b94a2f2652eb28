"""Offline acceptance: measure many (draft, k) pairs against cached target continuations.

This is how the original study measured acceptance (Yan et al., "Decoding Speculative Decoding",
Sec. 4): generate the target's greedy continuation of each prompt once and cache it; then, for a
draft, propose from the *true* prefix at every position of that continuation and count how many
draft tokens match it. Under greedy decoding this is exact, not an estimate: the draft's proposal
at a position depends only on the committed prefix, and the committed prefix is always the target's
own continuation. So a single pass that proposes ``k_max`` tokens at every position gives the
accepted length of every k <= k_max (a greedy proposal of k tokens is the first k of a proposal
of k_max), and :func:`simulate` replays speculative decoding from those counts for any k and any
batch size (rows advance by accepted + 1, the batch shrinks as rows finish) without running the
target again.

Vocabulary (as :mod:`specdraft.verify`): at continuation position ``i`` (``i`` tokens already
generated) ``matched[i]`` is the length of the prefix of the draft's proposal that equals the
target's next tokens; a step there emits ``min(matched[i], k) + 1`` tokens (accepted drafts plus
the recovered/bonus token).

The same pass yields the draft's language-modelling quality on the target's text: perplexity of
the continuation under the draft, and top-1 agreement (the draft's argmax is the target's token).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from specdraft.drafters.base import DraftContext
from specdraft.drafters.model import ModelDrafter
from specdraft.engine import Engine, Request, decode_requests
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaKV
from specdraft.models.loading import cache_root
from specdraft.models.runtime import Runtime
from specdraft.verify import SamplingParams

# Bump when the cached continuation format or how it is generated changes.
_FORMAT = 1


# ------------------------------------------------------------------------------------------------
# Target continuations (generated once, cached on disk)
# ------------------------------------------------------------------------------------------------


@dataclass
class Sequence:
    """A prompt and the target's greedy continuation of it.

    Attributes:
        prompt: prompt token ids (what the engine is given).
        continuation: the target's greedy output, EOS included when it stopped there.
    """

    prompt: list[int]
    continuation: list[int]


def continuation_key(target: str, dtype: str, prompts: list[list[int]], max_new_tokens: int) -> str:
    """Cache key of a continuation set: target identity, dtype, the prompts' ids and the length."""
    h = hashlib.sha256(f"format={_FORMAT} target={target} dtype={dtype} n={max_new_tokens}".encode())
    for p in prompts:
        h.update(b"|" + ",".join(map(str, p)).encode())
    return h.hexdigest()[:20]


def continuations_dir() -> Path:
    """``<specdraft cache>/study/continuations``."""
    return cache_root() / "study" / "continuations"


def generate_continuations(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    batch_size: int = 8,
) -> list[list[int]]:
    """The target's greedy continuation of each prompt (plain decoding, ``batch_size`` rows at a time)."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        reqs = [
            Request(p, max_new_tokens, SamplingParams(), eos_ids) for p in prompts[start : start + batch_size]
        ]
        out += decode_requests(Engine(runtime), reqs)
    return out


def cached_continuations(
    runtime: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    *,
    target: str,
    dtype: str,
    cache_dir: Path | None = None,
    batch_size: int = 8,
) -> list[Sequence]:
    """Load the target's continuations from the cache, generating (and caching) them if missing.

    The file is written to a temporary name and renamed, so an interrupted run leaves no partial
    cache behind.
    """
    cache_dir = cache_dir or continuations_dir()
    path = cache_dir / f"{continuation_key(target, dtype, prompts, max_new_tokens)}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("prompts") == prompts:
                return [Sequence(p, c) for p, c in zip(prompts, data["continuations"])]
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a damaged cache entry is regenerated
    conts = generate_continuations(runtime, prompts, max_new_tokens, eos_ids, batch_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cont-", dir=cache_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(
            {
                "target": target,
                "dtype": dtype,
                "max_new_tokens": max_new_tokens,
                "prompts": prompts,
                "continuations": conts,
            },
            f,
        )
    os.replace(tmp, path)
    return [Sequence(p, c) for p, c in zip(prompts, conts)]


# ------------------------------------------------------------------------------------------------
# Proposals from every prefix
# ------------------------------------------------------------------------------------------------


@dataclass
class OfflineProposals:
    """What a draft proposes at every position of one cached continuation.

    Attributes:
        prompt_len: prompt tokens P (row ``i`` has committed ``P + i`` tokens).
        matched: ``matched[i]``, for ``i`` in ``0..N-1``: how many leading tokens of the draft's
            ``k_max``-token proposal from the true prefix equal the target's next tokens (capped at
            the ``N - i`` tokens the continuation still has).
        valid: tokens the draft actually proposed there (``k_max`` for model drafts; the n-gram's
            continuation length for prompt lookup, possibly 0).
        steps: draft forwards the draft needed there, for a drafter that stops early (a gated
            designed draft); None: k per step (or one search for prompt lookup).
        nll: the draft's ``-log q(c_i | prefix)`` of the target's next token (None: no q).
        top1: whether the draft's argmax is the target's next token (None: no q).
    """

    prompt_len: int
    matched: list[int]
    valid: list[int]
    nll: list[float] | None = None
    top1: list[bool] | None = None
    steps: list[int] | None = None

    def __len__(self) -> int:
        return len(self.matched)


def _seed_rows(kv: LlamaKV, one: LlamaKV) -> None:
    """Copy a one-row cache into every row of ``kv`` (each row then diverges on its own)."""
    for dst, src in zip(kv.k + kv.v, one.k + one.v):
        dst.copy_(src.expand_as(dst))


def _teacher_forced(runtime: Runtime, seq: torch.Tensor, prompt_len: int, capacity: int):
    """One pass over the whole sequence: a one-row cache and the draft's logits at the positions
    that predict the continuation (``P - 1 .. P + N - 2``)."""
    one = runtime.new_state(1, capacity)
    T = seq.shape[0]
    index = torch.arange(prompt_len - 1, T - 1).unsqueeze(0)  # (1, N)
    out = runtime.forward(one, seq.unsqueeze(0), torch.arange(T).unsqueeze(0), logits_index=index)
    return one, out.logits[0]  # (N, V)


def offline_proposals(
    drafter, seq: Sequence, k_max: int, *, row_budget_bytes: int = 256 << 20
) -> OfflineProposals:
    """Propose ``k_max`` tokens from the true prefix at every continuation position.

    Every position is one row of a batch that runs the drafter's own ``propose`` (the exact code
    the engine runs). For a :class:`ModelDrafter` over the compact runtime, one teacher-forced pass
    over the sequence gives the draft's cache for the shared prefix (copied into the rows, so a
    position costs only its k_max draft steps), its perplexity and top-1 agreement, and its first
    draft token at every position: positions where that token is already wrong accept nothing and
    are not proposed from at all (except for drafters that stop early, whose widths and draft
    forwards are recorded everywhere). Other drafters catch up on each row's prefix themselves.

    Args:
        drafter: any :class:`specdraft.drafters.base.Drafter`.
        seq: a prompt and its cached continuation.
        k_max: tokens to propose per position.
        row_budget_bytes: memory for the rows' caches; positions are processed in chunks.
    """
    P, N = len(seq.prompt), len(seq.continuation)
    if P < 1:
        raise SpecdraftError("offline acceptance needs a non-empty prompt")
    full = torch.tensor(seq.prompt + seq.continuation, dtype=torch.int64)  # (P + N,)
    capacity = P + N + k_max + 2
    cont = torch.tensor(seq.continuation + [-1] * k_max, dtype=torch.int64)  # padded: never matches

    if getattr(drafter, "hidden_layers", ()):
        raise SpecdraftError(
            f"draft {getattr(drafter, 'name', drafter)!r} reads the target's hidden states; offline "
            "acceptance replays drafts from token prefixes only: measure it online (specdraft bench)"
        )
    fast = isinstance(drafter, ModelDrafter) and isinstance(drafter.runtime.new_state(1, 1), LlamaKV)
    nll = top1 = None
    one = None
    if fast:
        one, logits = _teacher_forced(drafter.runtime, full, P, capacity)  # (N, V)
        logp = torch.log_softmax(logits, -1)
        target_next = torch.tensor(seq.continuation)
        nll = (-logp.gather(1, target_next.unsqueeze(1)).squeeze(1)).tolist()
        top1 = (logits.argmax(-1) == target_next).tolist()
        per_row = sum(t.numel() * t.element_size() for t in one.k + one.v)
        chunk = max(1, min(N, row_budget_bytes // max(per_row, 1)))
    else:
        chunk = max(1, min(N, 64))

    matched = [0] * N
    valid = [k_max] * N
    steps: list[int] | None = None
    positions = list(range(N))
    # A drafter that stops early (GatedDrafter) decides how far to draft, and how many tokens to
    # propose, from all its tokens' confidences: it is proposed from everywhere, so that every
    # position's width and draft forwards are its own.
    stops_early = getattr(drafter, "stops_early", False)
    if fast and k_max > 1 and not stops_early:
        # The teacher-forced pass already gave every position's first draft token: where it is
        # wrong, nothing is accepted, whatever follows. Only the other rows need k_max steps.
        positions = [i for i in positions if top1[i]]
    elif fast and k_max <= 1:
        matched = [int(t) for t in top1]
        positions = []
    greedy = SamplingParams()
    for c0 in range(0, len(positions), chunk):
        rows = torch.tensor(positions[c0 : c0 + chunk], dtype=torch.int64)  # continuation positions
        R = rows.shape[0]
        lengths = P + rows  # (R,) committed tokens per row
        state = drafter.new_state(R, capacity)
        if fast:
            _seed_rows(state.kv, one)
            state.fed = lengths - 1  # the cache holds the true prefix; only the last token is re-fed
        ctx = DraftContext(full.expand(R, -1).clone(), lengths, [greedy] * R, [None] * R)
        prop = drafter.propose(state, ctx, k_max)
        nv = prop.num_valid if prop.num_valid is not None else torch.full((R,), k_max)
        draft = prop.tokens[:, :k_max]  # (R, k_max)
        truth = cont[rows.unsqueeze(1) + torch.arange(k_max)]  # (R, k_max) target's next tokens
        ok = (draft == truth) & (torch.arange(k_max) < nv.unsqueeze(1))
        for i, m, v in zip(rows.tolist(), ok.int().cumprod(1).sum(1).tolist(), nv.tolist()):
            matched[i], valid[i] = m, v  # m: accepted prefix length
        if prop.steps is not None:
            steps = steps or [k_max] * N
            for i, n in zip(rows.tolist(), prop.steps.tolist()):
                steps[i] = n
    return OfflineProposals(P, matched, valid, nll, top1, steps)


@dataclass
class DraftQuality:
    """A draft's language-modelling quality on target text.

    Attributes:
        tokens: continuation tokens scored.
        perplexity: ``exp(mean -log q(target token))`` over the tokens the draft gives q > 0 (all of
            them, unless its head covers only part of the vocabulary).
        top1_agreement: fraction of positions where the draft's argmax is the target's token.
        zero_prob_fraction: fraction of target tokens with q = 0 (outside a truncated head), which
            the perplexity leaves out (with them it would be infinite).
    """

    tokens: int
    perplexity: float | None
    top1_agreement: float
    zero_prob_fraction: float = 0.0


def draft_quality(proposals: list[OfflineProposals]) -> DraftQuality | None:
    """Perplexity and top-1 agreement over several continuations (None for drafters without q)."""
    if not proposals or any(p.nll is None for p in proposals):
        return None
    nll = [x for p in proposals for x in p.nll]
    top1 = [x for p in proposals for x in p.top1]
    if not nll:
        return None
    finite = [x for x in nll if math.isfinite(x)]
    ppl = math.exp(sum(finite) / len(finite)) if finite else None
    return DraftQuality(len(nll), ppl, sum(top1) / len(top1), 1 - len(finite) / len(nll))


# ------------------------------------------------------------------------------------------------
# Replaying speculative decoding
# ------------------------------------------------------------------------------------------------


class SimStep(NamedTuple):
    """One batched step of a replay.

    Attributes:
        rows: active rows.
        width: draft tokens the target scores per row (the widest proposal in the batch).
        context: the longest row's committed tokens (the attention span of the step).
        emitted: output tokens of all rows.
        first: the first step of its batch (where a draft model also catches up on the prompt).
        draft_steps: draft forwards of the step (the most any row needed) for a drafter that
            stops early; None: k (a draft model) or one search (prompt lookup).
    """

    rows: int
    width: int
    context: int
    emitted: int
    first: bool
    draft_steps: int | None = None


@dataclass
class Simulation:
    """Speculative decoding replayed from offline proposals, for one k and one batch size.

    Attributes:
        k: draft length.
        batch: rows decoded together (sequences are taken ``batch`` at a time, in order).
        row_steps: steps summed over rows (each row-step is one row in one target forward).
        generated: output tokens.
        accepted: accepted draft tokens.
        drafted: draft tokens proposed.
        steps: one :class:`SimStep` per batched step.
    """

    k: int
    batch: int
    row_steps: int = 0
    generated: int = 0
    accepted: int = 0
    drafted: int = 0
    steps: list[SimStep] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Output tokens per row-step, bonus token included (as :class:`SpecStats`)."""
        return (self.accepted + self.row_steps) / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def simulate(proposals: list[OfflineProposals], k: int, batch: int) -> Simulation:
    """Replay greedy speculative decoding with draft length k, ``batch`` sequences at a time.

    Each row at continuation position ``i`` drafts ``min(k, valid[i])`` tokens, accepts
    ``a = min(matched[i], drafted)`` of them and emits ``min(a + 1, N - i)`` tokens (the engine
    stops a row at its last cached token: EOS or max_new_tokens). Rows that finish leave the
    batch, as in :class:`specdraft.engine.Engine`. Steps, widths and output tokens equal a real
    engine run's; accepted counts can fall short in a row's last step, where the engine also
    verifies drafts beyond the last token it keeps and the cached continuation has ended.
    """
    if k < 0 or batch < 1:
        raise SpecdraftError(f"need k >= 0 and batch >= 1, got k={k}, batch={batch}")
    sim = Simulation(k, batch)
    for start in range(0, len(proposals), batch):
        group = [p for p in proposals[start : start + batch] if len(p)]
        pos = [0] * len(group)
        first = True
        while True:
            active = [r for r, p in enumerate(group) if pos[r] < len(p)]
            if not active:
                break
            width = context = emitted_all = 0
            steps = None
            for r in active:
                p, i = group[r], pos[r]
                if p.steps is not None:
                    steps = max(steps or 0, min(k, p.steps[i]))
                drafted = min(k, p.valid[i])
                a = min(p.matched[i], drafted)
                emitted = min(a + 1, len(p) - i)
                width = max(width, drafted)
                context = max(context, p.prompt_len + i)
                sim.row_steps += 1
                sim.drafted += drafted
                sim.accepted += a
                sim.generated += emitted
                emitted_all += emitted
                pos[r] = i + emitted
            sim.steps.append(SimStep(len(active), width, context, emitted_all, first, steps if k else None))
            first = False
    return sim
