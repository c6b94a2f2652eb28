"""The model drafter: k autoregressive draft steps over its own cache, catching up after each step
(and reading back, after steps without drafts, what proposals there would have got)."""

import pytest
import torch

from specdraft.drafters.base import DraftContext
from specdraft.drafters.gated import GatedDrafter
from specdraft.drafters.model import ModelDrafter
from specdraft.engine import Engine
from specdraft.policy import VerifyCost
from specdraft.verify import SamplingParams
from tests.drafters.test_feature_context import Asking, run
from tests.helpers import plain_greedy, random_prompts
from tests.test_tv_all_drafters import PROMPT, _distilled, make_case, peaked


def context(buffer: torch.Tensor, lengths: list[int], params=None) -> DraftContext:
    n = buffer.shape[0]
    params = params or [SamplingParams()] * n
    gens = [torch.Generator().manual_seed(b) for b in range(n)]
    return DraftContext(buffer, torch.tensor(lengths), params, gens)


def test_self_draft_proposes_the_greedy_continuation_and_catches_up(tiny):
    """Drive the drafter by hand through steps that accept all, some and none of its tokens."""
    prompts = random_prompts([3, 8])
    refs = [plain_greedy(tiny.target, p, 20) for p in prompts]
    full = [p + r for p, r in zip(prompts, refs)]
    drafter = ModelDrafter(tiny.target, "self")
    state = drafter.new_state(2, 40)
    buffer = torch.zeros(2, 40, dtype=torch.int64)
    lengths = [len(p) for p in prompts]
    for b, seq in enumerate(full):
        buffer[b, : len(seq)] = torch.tensor(seq)  # the buffer past `lengths` is never read
    k = 4
    for accepted in ([4, 1], [0, 4], [2, 0], [4, 4]):
        prop = drafter.propose(state, context(buffer, lengths), k)
        assert prop.probs is None and prop.tokens.shape == (2, k)
        for b in range(2):
            assert prop.tokens[b].tolist() == full[b][lengths[b] : lengths[b] + k]
        n = torch.tensor(accepted)
        drafter.observe(state, n)
        old = list(lengths)
        lengths = [L + a + 1 for L, a in zip(lengths, accepted)]  # accepted + recovered/bonus
        # the draft's cache keeps what it fed: last committed + d_1..d_{k-1}
        assert state.fed.tolist() == [L + min(a, k - 1) for L, a in zip(old, accepted)]


def test_sampling_rows_get_q_and_greedy_rows_a_point_mass(tiny):
    prompts = random_prompts([5, 5], seed=3)
    buffer = torch.tensor(prompts)
    drafter = ModelDrafter(tiny.other, "other")
    params = [SamplingParams(temperature=1.0), SamplingParams()]
    prop = drafter.propose(drafter.new_state(2, 16), context(buffer, [5, 5], params), 3)
    assert prop.probs.shape == (2, 3, 256)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(2, 3))
    q_of_tokens = prop.probs.gather(-1, prop.tokens.unsqueeze(-1)).squeeze(-1)
    assert (q_of_tokens > 0).all()
    assert (prop.probs[1].max(-1).values == 1).all()  # greedy row: one-hot at its argmax
    assert prop.tokens[1].tolist() == plain_greedy(tiny.other, prompts[1], 3)


def test_state_rows_leave_and_join(tiny):
    drafter = ModelDrafter(tiny.target, "self")
    prompts = random_prompts([4, 6, 5], seed=4)
    a = drafter.new_state(2, 16)
    buf = torch.zeros(2, 16, dtype=torch.int64)
    buf[0, :4], buf[1, :6] = torch.tensor(prompts[0]), torch.tensor(prompts[1])
    drafter.propose(a, context(buf, [4, 6]), 2)
    drafter.observe(a, torch.tensor([0, 2]))
    a.select_rows(torch.tensor([1]))
    b = drafter.new_state(1, 24)
    a.append(b)
    assert a.batch_size == 2 and a.fed.tolist() == [7, 0]
    buf2 = torch.zeros(2, 24, dtype=torch.int64)
    seq1 = prompts[1] + plain_greedy(tiny.target, prompts[1], 8)
    buf2[0, : len(seq1)] = torch.tensor(seq1)
    buf2[1, :5] = torch.tensor(prompts[2])
    prop = drafter.propose(a, context(buf2, [9, 5]), 3)
    assert prop.tokens[0].tolist() == seq1[9:12]
    assert prop.tokens[1].tolist() == plain_greedy(tiny.target, prompts[2], 3)


class ReadBack:
    """Wraps a model drafter; keeps, per row it read back, the row's committed tokens and outcomes."""

    def __init__(self, inner):
        self.inner, self.read = inner, []
        self.name, self.vocab_size = inner.name, inner.vocab_size

    def new_state(self, batch_size, capacity):
        return self.inner.new_state(batch_size, capacity)

    def propose(self, state, ctx, k):
        prop = self.inner.propose(state, ctx, k)
        for b, L in enumerate(ctx.lengths.tolist()):
            if prop.hindsight is not None and prop.hindsight[b]:
                self.read.append((ctx.tokens[b, :L].tolist(), prop.hindsight[b]))
        return prop

    def observe(self, state, num_accepted, verified=None):
        self.inner.observe(state, num_accepted, verified)


def fresh_first_token(drafter: ModelDrafter, tokens: list[int]) -> int:
    """The first draft token of a fresh draft fed ``tokens`` at once (a greedy proposal, k = 1)."""
    state = drafter.new_state(1, len(tokens) + 1)
    return int(drafter.propose(state, context(torch.tensor([tokens + [0]]), [len(tokens)]), 1).tokens[0, 0])


@pytest.mark.parametrize("read_back", [15, 3])
@pytest.mark.parametrize("name", ["model", "pruned-head", "gated"])
def test_hindsight_tells_what_proposals_at_the_catch_up_positions_would_have_got(name, read_back):
    """A proposal after steps without drafts reads back, at each caught-up position but the last (at
    most ``read_back``), whether the greedy draft token there is the one the target committed: the n
    outcomes of a row of length L are those of proposals at lengths L - n .. L - 1, each what a fresh
    draft fed the row's tokens up to there proposes, against the committed token. Stretches of 6 steps
    without drafts exceed a cap of 3. Both outcomes occur, so the check can fail; greedy output stays
    plain decoding's."""
    target = peaked(seed=10, scale=12.0)
    if name == "gated":  # proposes every token it drafts
        drafter = GatedDrafter(_distilled(), "gated", cost=VerifyCost([1.0] * 9, 0.0))
    else:
        drafter = make_case(name, target).drafter
    drafter.read_back = read_back
    rec = ReadBack(drafter)
    prompts = [PROMPT + [i] * (1 + 2 * i) for i in range(3)]
    lengths = [30, 12, 22]
    engine = Engine(target, rec, Asking(1, (1, 0, 0, 0, 0, 0, 0)))
    assert run(engine, prompts, lengths, 2) == run(Engine(target), prompts, lengths, 2)
    outcomes = []
    for tokens, read in rec.read:
        L, n = len(tokens), len(read)
        assert n <= read_back
        for j, hit in enumerate(read):
            assert hit == (fresh_first_token(drafter, tokens[: L - n + j]) == tokens[L - n + j])
            outcomes.append(hit)
    assert len(outcomes) >= 12 and 0 < sum(outcomes) < len(outcomes), outcomes
    assert read_back == 15 or max(len(r) for _, r in rec.read) == read_back  # the cap was reached
