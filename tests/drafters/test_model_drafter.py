"""The model drafter: k autoregressive draft steps over its own cache, catching up after each step."""

import torch

from specdraft.drafters.base import DraftContext
from specdraft.drafters.model import ModelDrafter
from specdraft.verify import SamplingParams
from tests.helpers import plain_greedy, random_prompts


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
