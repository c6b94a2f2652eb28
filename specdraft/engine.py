"""The decoding loop: prefill -> propose -> score -> verify -> commit/rollback, as step events.

One :class:`Engine` holds a batch of rows (requests) over a target runtime and an optional
drafter. Each :meth:`Engine.step` runs one speculative step for every active row and returns what
each row emitted as :class:`StepEvent` s. Requests can join (:meth:`Engine.add`, prefilled on their
own, then appended to the batch) and leave (finished, or :meth:`Engine.cancel`) between steps, which
is what the server's continuous batching needs. :func:`generate` is the simple driver;
:func:`decode_requests` runs it to the end and collects each request's tokens.

Invariant per row: the target's cache holds every committed token but the last (``L - 1`` of
``L``). A step feeds ``[last committed, d_1 .. d_k]`` at positions ``L - 1 .. L - 1 + k``: one
forward over k + 1 tokens gives the target's distribution after each prefix. After n are accepted,
the cache is valid up to position ``L - 1 + n``, which is exactly the new ``L' - 1`` (the
recovered/bonus token is the new unfed last token): rollback costs nothing.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdraft.drafters.base import DraftContext, Drafter, Proposal, TargetFeatures, Verified
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaKV
from specdraft.models.runtime import KVState, Runtime
from specdraft.policy import FixedK, KPolicy
from specdraft.prefix_cache import PrefixCache
from specdraft.stats import SpecStats
from specdraft.tree import TokenTree, verify_tree
from specdraft.verify import SamplingParams, TokenLogprob, greedy_tokens, token_logprobs, verify

_ids = itertools.count()


@dataclass
class Request:
    """One sequence to continue.

    Attributes:
        prompt: token ids (non-empty).
        max_new_tokens: upper bound on generated tokens (>= 1).
        params: sampling parameters; the row's ``torch.Generator`` is seeded from ``params.seed``.
        eos_ids: generation stops after emitting any of these.
        id: set by the engine when the request is added.
    """

    prompt: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: tuple[int, ...] = ()
    id: int = -1


@dataclass
class StepEvent:
    """What one row emitted in one step.

    Attributes:
        request_id: the row's request.
        tokens: output tokens this step (accepted drafts, then the recovered/bonus token).
        from_draft: per token, whether it was a draft token the target accepted.
        finished: no more tokens will come for this request.
        finish_reason: ``"stop"`` (EOS), ``"length"`` (max_new_tokens) or ``"cancelled"``.
        collapsed: the policy flagged this request at this step (its drafts are accepted far less
            than the drafter's average: an acceleration-collapse input, issue 17); once per request.
        source: per token, where it came from: the drafter's name (or a tree node's tag, such as
            ``"lookup"`` or ``"pool"``) for accepted drafts, ``"target"`` for the recovered / bonus
            token.
        logprobs: per token, its log-probability under the target and the most likely
            alternatives' (:class:`~specdraft.verify.TokenLogprob`), read from the logits that
            verified it; None unless the request's ``params.logprobs`` asks.
    """

    request_id: int
    tokens: list[int]
    from_draft: list[bool]
    finished: bool = False
    finish_reason: str | None = None
    collapsed: bool = False
    source: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class Engine:
    """A batch of rows decoded together with speculative decoding.

    Args:
        target: the model whose output is reproduced exactly.
        drafter: proposes draft tokens; None (or k = 0) is plain autoregressive decoding.
        policy: chooses the draft length k at each step.
        hidden_layers: target hidden states to hand to the drafter; None (the default): the ones the
            drafter names (``drafter.hidden_layers``: feature-level drafters), so every engine built
            over such a drafter feeds it.
        prefix_cache: keeps the keys and values of the rows that leave, for later prompts that begin
            with the same tokens (:mod:`specdraft.prefix_cache`); None: every prompt is prefilled whole.
    """

    def __init__(
        self,
        target: Runtime,
        drafter: Drafter | None = None,
        policy: KPolicy | None = None,
        *,
        hidden_layers: tuple[int, ...] | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        if drafter is not None and drafter.vocab_size not in (None, target.vocab_size):
            raise SpecdraftError(
                f"draft vocabulary ({drafter.vocab_size}) differs from the target's ({target.vocab_size}): "
                "a draft must share the target's tokenizer"
            )
        if (
            getattr(drafter, "proposes_trees", False)
            and "slots" not in inspect.signature(target.forward).parameters
        ):
            raise SpecdraftError(
                f"{drafter.name} proposes token trees, which {type(target).__name__} cannot verify "
                "(no tree attention mask): use the compact runtime (--runtime compact)"
            )
        if getattr(drafter, "drafts_in_forward", False) and getattr(drafter, "target", None) is not target:
            raise SpecdraftError(
                f"{drafter.name} drafts inside its target's forward: verify with that runtime"
            )
        self.target = target
        self.drafter = drafter
        self.policy = policy or FixedK(0 if drafter is None else 5)
        if getattr(drafter, "drafts_blocks", False) and hasattr(self.policy, "per_block"):
            self.policy.per_block = True  # one draft forward per block: charged once per step
        # a runtime whose chain steps can be ragged (forward(..., lengths=): row b feeds only its own
        # 1 + k_b tokens, the quantized runtime) verifies no padding; a policy that prices steps knows
        self.ragged = "lengths" in inspect.signature(target.forward).parameters
        if self.ragged and hasattr(self.policy, "ragged"):
            self.policy.ragged = True
        self.hidden_layers = getattr(drafter, "hidden_layers", ()) if hidden_layers is None else hidden_layers
        self.stats = SpecStats()
        self.requests: list[Request] = []
        self.generators: list[torch.Generator] = []
        self.generated = torch.zeros(0, dtype=torch.int64)  # (B,)
        self.lengths = torch.zeros(0, dtype=torch.int64)  # (B,) committed tokens
        self.tokens = torch.zeros(0, 0, dtype=torch.int64)  # (B, S) committed token buffer
        self.kv = None
        self.draft_state = None
        self.target_hidden: dict = {}
        self.features: TargetFeatures | None = None  # every committed position's, for feature drafters
        self.collapsed: set[int] = set()  # request ids the policy flagged (rows that left included)
        self.prefix_cache = prefix_cache

    # ------------------------------------------------------------------ batch membership
    @property
    def active(self) -> int:
        return len(self.requests)

    @property
    def reserve(self) -> int:
        """Cache room a request needs past ``prompt + max_new_tokens``: the most draft tokens a step
        can verify (``policy.k_max``) plus two. A caller that budgets prompts leaves this much."""
        return self.policy.k_max + 2

    def add(self, requests: list[Request]) -> list[int]:
        """Prefill new requests together and append them to the batch; returns their ids."""
        if not requests:
            return []
        for r in requests:
            if not r.prompt:
                raise SpecdraftError("empty prompt: give at least one token")
            if r.max_new_tokens < 1:
                raise SpecdraftError(f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
            if len(r.prompt) + r.max_new_tokens > self.target.max_context:
                raise SpecdraftError(
                    f"prompt ({len(r.prompt)} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds the "
                    f"target's context window ({self.target.max_context})"
                )
        t0 = time.perf_counter()
        n = len(requests)
        capacity = max(len(r.prompt) + r.max_new_tokens for r in requests) + self.reserve
        capacity = max(capacity, self.tokens.shape[1])
        lengths = torch.tensor([len(r.prompt) for r in requests])
        tokens = torch.zeros(n, capacity, dtype=torch.int64)
        for i, r in enumerate(requests):
            tokens[i, : len(r.prompt)] = torch.tensor(r.prompt)
        kv, prefill = self._prefill(requests, tokens, lengths, capacity)
        draft_state = self.drafter.new_state(n, capacity) if self.drafter is not None else None

        for r in requests:
            r.id = next(_ids)
            g = torch.Generator()
            g.manual_seed(r.params.seed if r.params.seed is not None else int(torch.randint(2**62, ())))
            self.generators.append(g)
        if self.kv is None:
            self.kv, self.draft_state, self.tokens = kv, draft_state, tokens
        else:
            self._grow(capacity)
            self.kv.append(kv)
            if draft_state is not None:
                self.draft_state.append(draft_state)
            self.tokens = torch.cat([self.tokens, tokens])
        if self.drafter is not None and self.hidden_layers:
            self._add_feature_rows(lengths, prefill)
        self.requests += requests
        self.lengths = torch.cat([self.lengths, lengths])
        self.generated = torch.cat([self.generated, torch.zeros(n, dtype=torch.int64)])
        spent = time.perf_counter() - t0
        self.stats.prefill_time += spent
        self.stats.total_time += spent
        return [r.id for r in requests]

    def _prefill(
        self, requests: list[Request], tokens: torch.Tensor, lengths: torch.Tensor, capacity: int
    ) -> tuple[KVState, dict[int, torch.Tensor]]:
        """The target's cache of the new rows' prompts but the last token (the first step feeds it),
        and the hidden states the drafter reads there (``{layer: (n, P, C)}`` by position). Rows with
        the same prompt (a server request's ``n`` choices) share one forward, its cache rows copied;
        a prompt the prefix cache holds the start of prefills only the rest (:meth:`_cached`)."""
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(r.prompt), len(first)) for r in requests]
        unique = torch.tensor([source.index(u) for u in range(len(first))])  # a row per prompt
        kv = self.target.new_state(len(first), capacity)
        tokens, lengths = tokens[unique], lengths[unique]
        start, cached = self._cached(kv, [requests[int(i)].prompt for i in unique])
        P, T = int(lengths.max()) - 1, int((lengths - 1 - start).max())
        prefill = {}
        if T > 0:  # positions start .. L - 2 of each row; right padding past a row's end is harmless
            positions = (start.unsqueeze(1) + torch.arange(T)).clamp(max=capacity - 1)
            prefill = self.target.forward(
                kv,
                tokens.gather(1, positions),
                positions,
                logits_index=(lengths - 2 - start).clamp(min=0).unsqueeze(1),
                hidden_layers=self.hidden_layers,
            ).hidden
        if cached and self.hidden_layers:  # features by position: the cached ones, then the forward's
            prefill = _by_position(self.hidden_layers, prefill, cached, start, lengths - 1, P)
        if len(first) < len(requests):
            rows = torch.tensor(source)
            kv.select_rows(rows)
            prefill = {i: h[rows] for i, h in prefill.items()}
        return kv, prefill

    def _cached(self, kv: KVState, prompts: list[list[int]]) -> tuple[torch.Tensor, list]:
        """Row b of ``kv`` takes the prefix cache's longest match with ``prompts[b]`` (at most its
        positions before the last token): ``(B,)`` the positions filled, and per row its entry's
        features ``{layer: (n, C)}`` (an empty list when nothing was filled)."""
        start = torch.zeros(len(prompts), dtype=torch.int64)
        if self.prefix_cache is None or not isinstance(kv, LlamaKV):
            return start, []
        found = [self.prefix_cache.match(p, self.hidden_layers) for p in prompts]
        if not any(n for _, n in found):
            return start, []
        for b, ((entry, n), prompt) in enumerate(zip(found, prompts)):
            start[b] = min(n, len(prompt) - 1)
            if start[b] > 0:
                self.prefix_cache.fill(entry, int(start[b]), kv, b)
        return start, [entry.hidden if entry is not None else {} for entry, _ in found]

    def _grow(self, capacity: int) -> None:
        if capacity > self.tokens.shape[1]:
            grown = torch.zeros(self.tokens.shape[0], capacity, dtype=torch.int64)
            grown[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = grown

    def _keep(self, keep: list[int]) -> None:
        if self.prefix_cache is not None and isinstance(self.kv, LlamaKV):
            kept = set(keep)
            self._store([b for b in range(self.active) if b not in kept])
        rows = torch.tensor(keep, dtype=torch.int64)
        self.requests = [self.requests[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        self.lengths, self.generated, self.tokens = (
            self.lengths[rows],
            self.generated[rows],
            self.tokens[rows],
        )
        if keep:
            self.kv.select_rows(rows)
            if self.draft_state is not None:
                self.draft_state.select_rows(rows)
            if self.features is not None:
                self.features.hidden = {i: h[rows] for i, h in self.features.hidden.items()}
                self.features.answer = self.features.answer[rows]
        else:
            self.kv = self.draft_state = self.features = None
            self.tokens = torch.zeros(0, 0, dtype=torch.int64)

    def _store(self, leaving: list[int]) -> None:
        """The prefix cache keeps each leaving row's committed tokens but the last (never fed: its
        keys and values are not in the cache) with their keys, values and kept features."""
        lengths = self.lengths.tolist()
        for b in leaving:
            n = lengths[b] - 1
            hidden = {} if self.features is None else {i: h[b] for i, h in self.features.hidden.items()}
            self.prefix_cache.store(self.tokens[b, :n].tolist(), self.kv, b, hidden)

    def cancel(self, request_id: int) -> StepEvent | None:
        """Drop a request between steps (client gone, stop string hit); frees its cache row."""
        for i, r in enumerate(self.requests):
            if r.id == request_id:
                self._keep([j for j in range(self.active) if j != i])
                return StepEvent(request_id, [], [], finished=True, finish_reason="cancelled")
        return None

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StepEvent]:
        """One speculative step for every active row."""
        if not self.active:
            return []
        params = [r.params for r in self.requests]
        ids = [r.id for r in self.requests]
        k = self.policy.choose(ids, self.draft_state.lag(self.lengths)) if self.drafter is not None else 0

        # 1. propose (for rows switched off too, when proposing is free: _shadowed)
        shadowed = self._shadowed(ids, k)
        t0 = time.perf_counter()
        prop = None
        if k > 0 or shadowed:
            ctx = DraftContext(
                self.tokens, self.lengths, params, self.generators, self.target_hidden, self.kv, self.features
            )
            if hasattr(self.policy, "hindsight_rows"):
                ctx.hindsight = self.policy.hindsight_rows(ids)
            prop = self.drafter.propose(self.draft_state, ctx, max(k, 1))
        shadow, prop = prop, (prop if k > 0 else None)  # k = 0: proposed for the off rows only
        if prop is not None and prop.hindsight is not None:  # before trim(): it may switch rows on
            self.policy.hindsight(ids, prop.hindsight)
        t1 = time.perf_counter()

        # 2. score and 3. verify: a chain [last, d_1..d_k], or a token tree per row
        if prop is not None and prop.trees is not None:
            out = self._tree_step(prop.trees, k, params, ids)
        elif self._drafts_in_forward():
            out = self._flex_step(prop, k, params, ids)
        else:
            out = self._chain_step(prop, k, params, ids)

        # 4. commit: truncate at EOS and max_new_tokens, write into the token buffer
        events, finished, emitted, spans = self._commit(out)
        if self.drafter is not None and self.hidden_layers:  # k = 0 steps too
            self._write_features(out.columns, spans)
        if out.proposed > 0:  # the drafter proposed, even if trim() left nothing to verify
            self.drafter.observe(self.draft_state, out.num_accepted, out.verified)
        t3 = time.perf_counter()

        self.stats.draft_time += t1 - t0
        self.stats.target_time += out.target_time
        self.stats.observe(out.num_valid, out.num_accepted, emitted, depth=out.depth)
        # a tree step teaches the policy per depth, its time at the tree's width (KPolicy.update)
        drafted, tree = (out.num_valid, {}) if out.depth is None else (out.depth, {"width": out.width})
        self.policy.update(
            out.proposed, drafted, out.num_accepted, t1 - t0, out.target_time, out.bucket, ids, **tree
        )
        if shadowed:
            self._tell_shadow(shadow, shadowed, out.tokens, ids)
        flagged = self.policy.collapsed - self.collapsed
        if flagged:
            self.collapsed |= flagged
            self.stats.collapsed += len(flagged)
            for ev in events:
                ev.collapsed = ev.request_id in flagged
        if finished:
            self._keep([b for b in range(self.active) if b not in finished])
        self.stats.total_time += t3 - t0
        return events

    def _shadowed(self, ids: list[int], k: int) -> list[int]:
        """Rows (indices) that verify nothing at this step because the policy switched them off and
        whose first proposed token the policy is told of (:meth:`specdraft.policy.CostAwareK.shadow`;
        nothing of it is verified): every such row when the drafter's proposals cost nothing
        (``proposes_free``, prompt lookup: it proposes for them even at k = 0), and the greedy ones
        when k > 0, where any drafter proposes for every row of the batch anyway (a sampled draft
        token matching the target's sample is not how often it would be accepted)."""
        free = getattr(self.drafter, "proposes_free", False)
        if not (free or k > 0) or not hasattr(self.policy, "unverified"):
            return []
        off = set(self.policy.unverified(ids))
        return [b for b, r in enumerate(ids) if r in off and (free or self.requests[b].params.greedy)]

    def _tell_shadow(self, prop: Proposal, rows: list[int], committed: list[list[int]], ids: list) -> None:
        """Each shadowed row's first proposed token against the token the target committed after
        its last one (its first draft token's fate under verification)."""
        if prop.trees is not None or prop.tokens.shape[1] == 0:
            return
        valid = prop.num_valid.tolist() if prop.num_valid is not None else None
        firsts = prop.tokens[:, 0].tolist()  # lists, not per-row tensor ops (see _commit)
        told = [b for b in rows if valid is None or valid[b] > 0]
        hits = [firsts[b] == committed[b][0] for b in told]
        self.policy.shadow([ids[b] for b in told], hits)

    def _write_features(self, columns: torch.Tensor | None, spans: list[tuple[int, int]]) -> None:
        """Keep the target's hidden states at the positions this step committed (``spans``: each
        row's position of column 0 and tokens emitted; a chain's columns ``0 .. emitted - 1``, a
        tree's accepted path ``columns (B, T)``) in :attr:`features`, so that a feature drafter's
        context is exact whatever steps ran since it last proposed."""
        hidden = {i: self.target_hidden[i] for i in self.hidden_layers if i in self.target_hidden}
        if not hidden:
            return
        B, S = self.active, self.tokens.shape[1]
        if self.features is None:  # every prompt was one token (no prefill): column 0 is its position
            first = torch.tensor([f for f, _ in spans], dtype=torch.int64)
            self.features = TargetFeatures(
                {i: h.new_zeros(B, S, h.shape[2]) for i, h in hidden.items()}, first
            )
        if columns is None:  # a chain: row b's columns 0 .. emitted_b - 1 at positions first_b on, a
            # slice copy per row (the gather below costs 4% of a quantized target's step at batch 1),
            # through numpy views where it can (each tensor operation is dear right after a forward)
            for i, h in hidden.items():
                dst, src = self.features.hidden[i], h
                if dst.dtype == src.dtype == torch.float32:
                    dst, src = dst.numpy(), src.numpy()
                for b, (f, e) in enumerate(spans):
                    dst[b, f : f + e] = src[b, :e]
            return
        T = columns.shape[1]
        first, emitted = torch.tensor(spans, dtype=torch.int64).unbind(1)
        committed = torch.arange(T) < emitted.unsqueeze(1)  # (B, T)
        rows = torch.arange(B).unsqueeze(1).expand(B, T)[committed]
        pos = (first.unsqueeze(1) + torch.arange(T))[committed]
        for i, h in hidden.items():
            picked = h.gather(1, columns.unsqueeze(-1).expand(-1, -1, h.shape[2]))  # (B, T, C) by position
            self.features.hidden[i][rows, pos] = picked[committed].to(self.features.hidden[i].dtype)

    def _add_feature_rows(self, lengths: torch.Tensor, prefill: dict) -> None:
        """Rows that joined keep their prompt's features, positions ``0 .. L - 2`` from the prefill
        (``{layer: (n, P, C)}``; empty when every new prompt is one token: the first step writes
        its position 0)."""
        old = self.features.hidden if self.features is not None else {}
        if not (old or prefill):
            return  # no layer's width known yet: the first step's write creates the rows
        S, n = self.tokens.shape[1], lengths.shape[0]
        grown = {}
        for i, ref in (old or prefill).items():
            new = ref.new_zeros(n, S, ref.shape[2])
            if i in prefill:
                new[:, : prefill[i].shape[1]] = prefill[i]
            if i in old:
                pad = ref.new_zeros(ref.shape[0], S - ref.shape[1], ref.shape[2])
                new = torch.cat([torch.cat([ref, pad], 1), new])
            grown[i] = new
        if self.features is None:
            self.features = TargetFeatures(grown, lengths - 1)
        else:
            self.features.hidden = grown
            self.features.answer = torch.cat([self.features.answer, lengths - 1])

    def _chain_step(
        self, prop: Proposal | None, k: int, params: list, ids: list[int], forward=None
    ) -> _Outcome:
        """Score ``[last committed, d_1..d_k]`` at positions ``L-1 .. L-1+k`` and verify the chain
        (``forward``: the target's forward, or one that does more, as :meth:`_flex_step`'s)."""
        B, L = self.active, self.lengths
        draft_probs, bucket, proposed = None, None, 0
        if prop is not None:
            num_valid = prop.num_valid if prop.num_valid is not None else torch.full((B,), k)
            proposed = int(num_valid.max())  # the draft time was spent on these
            bucket = prop.bucket
            num_valid = self.policy.trim(num_valid, bucket, ids)
            k = int(num_valid.max())  # trim columns nobody proposed or verifies
            draft_tokens = prop.tokens[:, :k]
            draft_probs = prop.probs[:, :k] if prop.probs is not None else None
        if prop is None or k == 0:
            k, num_valid = 0, torch.zeros(B, dtype=torch.int64)
            draft_tokens = torch.zeros(B, 0, dtype=torch.int64)
        t1 = time.perf_counter()
        last = self.tokens.gather(1, (L - 1).unsqueeze(1))  # (B, 1)
        inp = torch.cat([last, draft_tokens], dim=1)  # (B, k + 1)
        positions = (L - 1).unsqueeze(1) + torch.arange(k + 1)  # (B, k + 1)
        ragged = {"lengths": 1 + num_valid} if self.ragged and k and forward is None else {}
        out = (forward or self.target.forward)(
            self.kv, inp, positions, hidden_layers=self.hidden_layers, **ragged
        )
        self.target_hidden = out.hidden
        target_time = time.perf_counter() - t1
        nv = num_valid if k else None
        verdict = verify(draft_tokens, draft_probs, out.logits, params, self.generators, nv)
        accepted = verdict.num_accepted.tolist()  # lists, not per-row tensor ops (see _commit)
        name = self.drafter.name if self.drafter is not None else "draft"
        tokens = [row[: a + 1] for row, a in zip(verdict.tokens.tolist(), accepted)]
        sources = [[name] * a + ["target"] for a in accepted]
        verified = None
        if proposed > 0:
            fed = [row[: 1 + v] for row, v in zip(inp.tolist(), num_valid.tolist())]
            verified = _verified(fed, [list(range(-1, len(f) - 1)) for f in fed], out.logits, tokens)
        n = verdict.num_accepted
        return _Outcome(tokens, n, sources, verified, num_valid, proposed, bucket, target_time, out.logits)

    def _drafts_in_forward(self) -> bool:
        """Whether this step is a parallel draft-and-verify step (a drafter that drafts inside the
        target's forward, and a batch no larger than its switch size); else the ordinary loop."""
        return getattr(self.drafter, "drafts_in_forward", False) and self.active <= self.drafter.switch_batch

    def _flex_step(self, prop: Proposal | None, k: int, params: list, ids: list[int]) -> _Outcome:
        """A chain step whose verification forward also carries the drafter's mask tokens
        (:mod:`specdraft.drafters.flex`): the target's rows are verified as :meth:`_chain_step` does,
        and the mask group of each row's accepted count becomes its next draft."""
        groups = []

        def forward(kv, inp, positions, **kw):
            out, hidden = self.drafter.forward_with_masks(kv, inp, positions, **kw)
            groups.append(hidden)  # (B, k + 1, m, C)
            return out

        out = self._chain_step(prop, k, params, ids, forward)
        bonus = torch.tensor([t[-1] for t in out.tokens])  # the recovered / bonus token per row
        self.drafter.take(
            self.draft_state, groups[0], out.num_accepted, bonus, self.lengths + out.num_accepted + 1
        )
        return out

    def _tree_step(self, trees: list[TokenTree | None], k: int, params: list, ids: list[int]) -> _Outcome:
        """Score every row's tree ``[root, nodes]`` in one forward (rows padded to the largest tree
        with nodes under the root that nothing sees), verify each, and move the accepted path's
        cache entries to the slots of their positions (a chain step's layout).

        ``policy.trim`` does not cut trees: a row it cuts to 0 (a row the policy switched off)
        verifies no tree; any other row verifies its whole tree (at most k nodes)."""
        B, L = self.active, self.lengths
        empty = TokenTree(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        trees = [empty if t is None else t for t in trees]
        if len(trees) != B or max(t.num_nodes for t in trees) > k:
            raise SpecdraftError(f"a tree proposal needs {B} trees of at most k = {k} nodes")
        proposed = max(t.num_nodes for t in trees)
        keep = self.policy.trim(torch.tensor([t.num_nodes for t in trees]), None, ids)  # (B,)
        trees = [t if int(keep[b]) > 0 else empty for b, t in enumerate(trees)]
        N = max(t.num_nodes for t in trees)
        padded = [_pad(t, N) for t in trees]
        root_pos = (L - 1).tolist()
        S = self.kv.capacity
        last = self.tokens.gather(1, (L - 1).unsqueeze(1))  # (B, 1)
        inp = torch.cat([last, torch.stack([t.tokens for t in padded])], dim=1)  # (B, N + 1)
        positions = torch.stack([t.positions(r) for t, r in zip(padded, root_pos)])  # (B, N + 1)
        slots = torch.stack([t.slots(r) for t, r in zip(padded, root_pos)])  # (B, N + 1)
        mask = torch.stack([t.step_mask(r, S) for t, r in zip(padded, root_pos)])  # (B, N + 1, S)
        t1 = time.perf_counter()
        out = self.target.forward(
            self.kv, inp, positions, hidden_layers=self.hidden_layers, attn_mask=mask, slots=slots
        )
        self.target_hidden = out.hidden
        target_time = time.perf_counter() - t1
        tokens, sources, n = [], [], torch.zeros(B, dtype=torch.int64)
        columns = torch.arange(N + 1).repeat(B, 1)  # (B, N + 1) the accepted path's, root first
        for b, tree in enumerate(trees):
            verdict = verify_tree(tree, out.logits[b, : tree.num_nodes + 1], params[b], self.generators[b])
            n[b] = verdict.num_accepted
            columns[b, 1 : 1 + int(n[b])] = 1 + verdict.nodes
            if n[b] and not bool((verdict.nodes == torch.arange(int(n[b]))).all()):
                self.kv.move_slots(b, slots[b, 1 + verdict.nodes], root_pos[b] + 1)
            tokens.append(verdict.tokens.tolist())
            tags = tree.sources or (self.drafter.name,) * tree.num_nodes
            sources.append([tags[i] for i in verdict.nodes.tolist()] + ["target"])
        fed = [[int(last[b, 0]), *t.tokens.tolist()] for b, t in enumerate(trees)]
        parents = [[-1, *(t.parents + 1).tolist()] for t in trees]
        verified = _verified(fed, parents, out.logits, tokens)
        num_valid = torch.tensor([t.num_nodes for t in trees])
        depth = torch.tensor([int(t.depth.max()) if t.num_nodes else 0 for t in trees])
        return _Outcome(
            tokens,
            n,
            sources,
            verified,
            num_valid,
            proposed,
            None,
            target_time,
            out.logits,
            depth,
            N + 1,
            columns,
        )

    def _commit(
        self, out: _Outcome
    ) -> tuple[list[StepEvent], list[int], torch.Tensor, list[tuple[int, int]]]:
        """Append each row's verified tokens, cut at EOS and max_new_tokens; returns the events, the
        rows that finished, ``(B,)`` tokens emitted per row, and per row the position of the step's
        column 0 (its length before, less one) with the tokens emitted. Python lists and one numpy view of
        the token buffer, not per-row tensor operations: each costs tens of microseconds right after
        a forward has streamed the weights through the caches (results/step-overhead-2026-12-05),
        and this runs at every step."""
        lengths, generated = self.lengths.tolist(), self.generated.tolist()
        accepted, buffer = out.num_accepted.tolist(), self.tokens.numpy()
        events, finished, emitted = [], [], []
        for b, r in enumerate(self.requests):
            room = r.max_new_tokens - generated[b]
            toks = out.tokens[b][:room]
            reason = "length" if len(toks) == room else None
            for j, t in enumerate(toks):
                if t in r.eos_ids:
                    toks, reason = toks[: j + 1], "stop"
                    break
            emitted.append(len(toks))
            buffer[b, lengths[b] : lengths[b] + len(toks)] = toks
            from_draft = [j < accepted[b] for j in range(len(toks))]
            source = out.sources[b][: len(toks)]
            ev = StepEvent(r.id, toks, from_draft, reason is not None, reason, source=source)
            if r.params.logprobs is not None:
                ev.logprobs = self._logprobs(out, b, toks, r.params.logprobs)
            events.append(ev)
            if reason is not None:
                finished.append(b)
            if out.verified is not None:
                out.verified.committed[b] = toks
        spans = [(L - 1, e) for L, e in zip(lengths, emitted)]
        emitted = torch.tensor(emitted, dtype=torch.int64)
        self.lengths = self.lengths + emitted
        self.generated = self.generated + emitted
        return events, finished, emitted, spans

    @staticmethod
    def _logprobs(out: _Outcome, b: int, toks: list[int], top: int) -> list[TokenLogprob]:
        """Row b's output tokens ``toks`` with their logprobs: token j was predicted by the step's
        column j (a tree step: the accepted path's j-th column, :attr:`_Outcome.columns`)."""
        rows = (
            out.logits[b, : len(toks)] if out.columns is None else out.logits[b, out.columns[b, : len(toks)]]
        )
        return token_logprobs(rows, toks, top)


@dataclass
class _Outcome:
    """One step's verification per row, before EOS / max_new_tokens cut it.

    Attributes:
        tokens: accepted tokens, then the recovered / bonus token.
        num_accepted: ``(B,)`` accepted draft tokens (tree: nodes on the accepted path).
        sources: where each of ``tokens`` came from (a drafter's or node's tag; ``"target"``).
        verified: what the drafter is told (None when it proposed nothing).
        num_valid: ``(B,)`` tokens verified per row (tree: nodes).
        proposed: most tokens (nodes) any row proposed.
        bucket: the proposal's classes, for the policy.
        target_time: seconds of the target forward.
        logits: ``(B, T, V)`` the target forward's (for :attr:`StepEvent.logprobs`).
        depth: ``(B,)`` tree depth per row, for per-depth statistics (None: a chain).
        width: tokens each row fed the target (a tree step: the most nodes + 1).
        columns: ``(B, T)`` per row, the target forward's columns of the committed positions in
            order (a tree step: the accepted path, root first); None: a chain's ``0, 1, ..``.
    """

    tokens: list[list[int]]
    num_accepted: torch.Tensor
    sources: list[list[str]]
    verified: Verified | None
    num_valid: torch.Tensor
    proposed: int
    bucket: torch.Tensor | None
    target_time: float
    logits: torch.Tensor
    depth: torch.Tensor | None = None
    width: int = 0
    columns: torch.Tensor | None = None


def _by_position(
    layers: tuple[int, ...],
    hidden: dict[int, torch.Tensor],
    cached: list[dict],
    start: torch.Tensor,
    end: torch.Tensor,
    P: int,
) -> dict[int, torch.Tensor]:
    """Prefill features ``{layer: (B, P, C)}`` by position: row b's cached ones (``cached[b]``) at
    positions below ``start[b]``, the forward's columns (``hidden``, none when no row needed a
    forward; column j at ``start[b] + j``) from there to ``end[b]``."""
    out = {}
    for i in layers:
        ref = hidden[i] if i in hidden else next(c[i] for c in cached if c)
        by_pos = ref.new_zeros(len(cached), P, ref.shape[-1])
        for b, (s, e) in enumerate(zip(start.tolist(), end.tolist())):
            if s:
                by_pos[b, :s] = cached[b][i][:s]
            if e > s:
                by_pos[b, s:e] = hidden[i][b, : e - s]
        out[i] = by_pos
    return out


def _pad(tree: TokenTree, n: int) -> TokenTree:
    """``tree`` with nodes appended under the root up to n nodes (their logits are not read)."""
    extra = n - tree.num_nodes
    if not extra:
        return tree
    zeros = torch.zeros(extra, dtype=torch.int64)
    return TokenTree(torch.cat([tree.tokens, zeros]), torch.cat([tree.parents, zeros - 1]))


class _TargetNext(Sequence):
    """:attr:`Verified.target_next` of one step, taken from its logits on first read: only a phrase
    pool reads it, and the argmax over ``(B, T, V)`` logits would otherwise cost every drafter's
    step a pass over them (at Gemma 3's 262k vocabulary, batch 8, k = 4: 10M floats)."""

    def __init__(self, logits: torch.Tensor, lengths: list[int]):
        self._logits, self._lengths, self._rows = logits, lengths, None

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, b):
        if self._rows is None:
            nxt = greedy_tokens(self._logits)  # (B, T)
            self._rows = [nxt[i, :n].tolist() for i, n in enumerate(self._lengths)]
            self._logits = None
        return self._rows[b]


def _verified(fed: list[list[int]], parents: list[list[int]], logits: torch.Tensor, tokens: list) -> Verified:
    """The :class:`Verified` of a step that fed ``fed`` (per row) and got ``logits (B, T, V)``."""
    return Verified(
        inputs=fed,
        parents=parents,
        target_next=_TargetNext(logits, [len(f) for f in fed]),
        committed=[list(t) for t in tokens],
    )


def generate(engine: Engine, requests: list[Request]) -> Iterator[StepEvent]:
    """Decode ``requests`` together until all finish, yielding step events as they come.

    If the caller stops iterating early, the remaining rows are dropped so the engine is reusable.
    """
    ids = set(engine.add(requests))
    try:
        while any(r.id in ids for r in engine.requests):
            yield from engine.step()
    finally:
        for r in list(engine.requests):
            if r.id in ids:
                engine.cancel(r.id)


def prompt_logprobs(target: Runtime, prompt: list[int], top: int, chunk: int = 256) -> list[TokenLogprob]:
    """Each prompt token's logprob given the tokens before it (the first token's: None) and the
    ``top`` most likely alternatives' there: the target's forward over the prompt but its last token,
    ``chunk`` positions at a time (a long prompt's logits are never held at once)."""
    state = target.new_state(1, len(prompt))
    out = [TokenLogprob(prompt[0], None)]
    for s in range(0, len(prompt) - 1, chunk):
        fed = prompt[s : min(s + chunk, len(prompt) - 1)]  # position p predicts token p + 1
        positions = torch.arange(s, s + len(fed)).unsqueeze(0)
        logits = target.forward(state, torch.tensor([fed]), positions).logits[0]
        out += token_logprobs(logits, prompt[s + 1 : s + 1 + len(fed)], top)
    return out


def decode_requests(engine: Engine, requests: list[Request]) -> list[list[int]]:
    """Decode ``requests`` together to the end; the output tokens of each, in the given order."""
    out: dict[int, list[int]] = {}
    for ev in generate(engine, requests):
        out.setdefault(ev.request_id, []).extend(ev.tokens)
    return [out.get(r.id, []) for r in requests]
