"""The per-row cap wrappers: RowCappedDrafter lowers each row's num_valid, CappedPolicy bounds k."""

import torch

from specdraft.drafters.base import DraftContext, DraftState, Proposal
from specdraft.drafters.capped import RowCappedDrafter
from specdraft.policy import CappedPolicy, FixedK
from specdraft.verify import SamplingParams


class _FixedDrafter:
    """Proposes token 7 everywhere, for all k positions."""

    name, vocab_size = "fixed", None

    def new_state(self, batch_size, capacity):
        return DraftState(batch_size)

    def propose(self, state, ctx, k):
        return Proposal(torch.full((ctx.lengths.shape[0], k), 7))

    def observe(self, state, num_accepted, verified=None):
        pass


def test_row_caps_lower_num_valid_per_row():
    d = RowCappedDrafter(_FixedDrafter())
    d.caps = torch.tensor([0, 2, 5])
    params, gens = [SamplingParams()] * 3, [None] * 3
    ctx = DraftContext(torch.zeros(3, 4, dtype=torch.int64), torch.tensor([2, 3, 4]), params, gens)
    prop = d.propose(d.new_state(3, 8), ctx, 3)
    assert prop.num_valid.tolist() == [0, 2, 3]
    assert prop.tokens.shape == (3, 3)


def test_capped_policy_takes_the_smaller_k_and_keeps_the_reserve():
    p = CappedPolicy(FixedK(5))
    assert p.k_max == 5 and p.choose() == 5
    p.cap = 2
    assert p.choose() == 2
    p.cap = 0
    assert p.choose() == 0
