"""A model drafter that proposes only what pays (:class:`GatedDrafter`).

On a CPU, verifying n > 1 tokens costs a multiple of a 1-token step
(``T_target(n) / T_target(1)`` is 2-4 on this AVX2 machine: the matmuls leave the matrix-vector
path), so a draft token that is likely rejected makes the step slower than plain decoding. The
drafter drafts k tokens, estimates the chance that the first i all pass as the product of its own
confidences ``P_i = prod_{j <= i} c_j`` (c: the draft's probability of its token;
distillation leaves it roughly calibrated), and proposes the prefix length m that maximises the
analytic model's tokens per unit time, ``(1 + sum_{i <= m} P_i) / cost(m)`` with ``cost(0) = 1``
(a plain step) and ``cost(m) = T_target(m + 1) / T_target(1) + (m - 1) T_draft / T_target(1)``;
m = 0 means "decode plainly this step". The ratios are measured once on the running machine
(:class:`~specdraft.policy.VerifyCost`).

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

The cost model and the prefix rule (:class:`~specdraft.policy.VerifyCost`,
:func:`~specdraft.policy.best_prefix`) live with the other k-policies in :mod:`specdraft.policy`.
"""

from __future__ import annotations

import contextlib

import torch

from specdraft.drafters.base import DraftContext, Proposal, take_token
from specdraft.drafters.model import ModelDrafter, ModelDraftState
from specdraft.errors import SpecdraftError
from specdraft.policy import VerifyCost, best_prefix, worth_continuing


def _propose_sampled(conf: torch.Tensor, k: int, cost: VerifyCost) -> torch.Tensor:
    """Whether a sampling row proposes position i, from ``(B, i)`` confidences ``c_1 .. c_i`` known
    before token i is drawn (``c_j = max q_j``): later positions are taken to be as likely as
    position i, and it is proposed if the best prefix of that curve reaches it. ``(B,)`` bool."""
    i = conf.shape[1]
    ahead = torch.cat([conf, conf[:, -1:].expand(-1, k - i)], 1)  # (B, k)
    return best_prefix(ahead, cost) >= i


class GatedDrafter(ModelDrafter):
    """A model drafter that proposes only the prefix of its k tokens that is expected to pay
    (module docstring), and stops drafting as soon as no longer prefix can pay for any row.
    Greedy rows choose the prefix after drafting; sampling rows choose it position by position,
    before each token is drawn, which keeps rejection sampling exact. ``cost`` is measured when
    the first batch starts (:meth:`new_state`) unless given.

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

    def new_state(self, batch_size: int, capacity: int) -> ModelDraftState:
        """The draft's state; the cost model is measured here the first time (when the first
        request joins), so that no proposal's draft time, which policies learn from, carries it."""
        if self.cost is None:
            if self.target_runtime is None:
                raise SpecdraftError("GatedDrafter needs a target runtime or a cost model")
            self.cost = VerifyCost.measure(self.target_runtime, self.runtime)
        return super().new_state(batch_size, capacity)

    @contextlib.contextmanager
    def drafting(self, every_token: bool):
        """Inside the block, draft all k tokens (``every_token``) or stop after the first, whatever
        the confidences, each position doing the work it does in a real proposal: how the latency
        profiler times proposals of a known length (random contexts stop it anywhere)."""
        n = len(self.cost.target)
        never = VerifyCost([1.0] + [1e9] * (n - 1), 1e9)  # no proposal pays: stop after one token
        cost, self.cost = self.cost, VerifyCost([1.0] * n, 0.0) if every_token else never
        try:
            yield
        finally:
            self.cost = cost

    def propose(self, state, ctx: DraftContext, k: int) -> Proposal:
        B, L = ctx.lengths.shape[0], ctx.lengths
        logits, seen = self.catch_up(state, ctx, read=True)  # as ModelDrafter does

        sampling = torch.tensor([not p.greedy for p in ctx.params])  # (B,)
        draft = torch.zeros(B, k, dtype=torch.int64)
        conf = torch.zeros(B, k)  # the draft's probability of its argmax at each position
        probs = None
        made = k
        steps = torch.full((B,), k, dtype=torch.int64)  # forwards each row needs on its own
        num_valid = torch.full((B,), k, dtype=torch.int64)  # sampling rows: set where they stop
        going = torch.ones(B, dtype=torch.bool)
        for i in range(k):
            probs, q = take_token(logits, ctx, draft, probs, i, self.head)
            conf[:, i] = logits.float().softmax(-1).max(-1).values
            if q is not None:
                # sampling rows: max q_i, and propose token i or stop, both fixed before it was drawn
                conf[:, i] = torch.where(sampling, q.max(-1).values, conf[:, i])
                cut = going & sampling & ~_propose_sampled(conf[:, : i + 1], k, self.cost)
                num_valid[cut] = i
                steps[cut] = i + 1
                going &= ~cut
            if i + 1 < k:
                stop = going & ~sampling & ~worth_continuing(conf[:, : i + 1].cumprod(1), k, self.cost)
                steps[stop] = i + 1
                going &= ~stop
                if not going.any():
                    made = i + 1
                    break
                pos = (L + i).unsqueeze(1)  # (B, 1)
                logits = self.head_logits(state.kv, draft[:, i : i + 1], pos)
        state.fed = L.clone()
        state.base = L.clone()
        state.k = made
        # greedy rows: the best prefix of all drafted tokens (any proposal leaves greedy output exact)
        num_valid = torch.where(sampling, num_valid, best_prefix(conf[:, :made], self.cost))
        return Proposal(tokens=draft, probs=probs, num_valid=num_valid, steps=steps, hindsight=seen)
