"""FlexDraft: mask tokens in the verification forward leave the real rows bit-identical, each mask
group is the draft the sequential mode makes for that accepted count, and decoding stays lossless
in the parallel step, the sequential fallback and a batch that switches between them."""

from dataclasses import replace

import pytest
import torch

from specdraft.drafters.flex import FlexDrafter, FlexWeights, group_rows
from specdraft.engine import Engine, Request, decode_requests
from specdraft.errors import SpecdraftError
from specdraft.models.gemma3 import Gemma3Runtime
from specdraft.models.mask_rows import forward_with_masks, mask_hidden
from specdraft.models.tiny import tiny_llama
from specdraft.policy import FixedK
from tests.helpers import compact, decode, head_subset, plain_greedy, random_prompts


@pytest.fixture(scope="module")
def target():
    return compact(tiny_llama(num_layers=3, seed=5))


def weights(target, split=1, seed=0):
    """Untrained draft weights, perturbed so that the draft's projectors differ from the target's."""
    w = FlexWeights.init(target, split, rank=16, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return replace(
        w,
        mask=torch.randn(w.mask.shape, generator=g),
        wqkv=[q + 0.05 * torch.randn(q.shape, generator=g) for q in w.wqkv],
        up=0.1 * torch.randn(w.up.shape, generator=g),
    )


def prefilled(target, prompt):
    kv = target.new_state(1, 64)
    P = len(prompt) - 1
    target.forward(kv, torch.tensor([prompt[:P]]), torch.arange(P).unsqueeze(0))
    return kv


def clone(kv):
    out = type(kv).__new__(type(kv))
    out.k, out.v = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
    return out


def test_real_rows_are_bit_identical_with_and_without_mask_tokens(target):
    prompt = random_prompts([9], seed=1)[0]
    kv = prefilled(target, prompt)
    tokens = torch.tensor([[prompt[-1], 7, 8, 9]])  # [last, d_1 .. d_3]
    positions = (len(prompt) - 1 + torch.arange(4)).unsqueeze(0)
    plain_kv, masked_kv = clone(kv), clone(kv)
    plain = target.forward(plain_kv, tokens, positions, hidden_layers=(-1,))
    rows = group_rows(weights(target), positions, block=3)
    out, h = forward_with_masks(target, masked_kv, tokens, positions, rows, hidden_layers=(-1,))
    assert torch.equal(out.logits, plain.logits) and torch.equal(out.hidden[-1], plain.hidden[-1])
    assert all(torch.equal(a, b) for a, b in zip(plain_kv.k + plain_kv.v, masked_kv.k + masked_kv.v))
    assert h.shape == (1, 12, target.w.hidden_size) and torch.isfinite(h).all()


def test_each_group_is_the_sequential_draft_for_its_accepted_count(target):
    """Group n reads the real tokens up to P + n only: it equals one group run alone over a cache
    that holds nothing past P + n (the sequential mode's draft after n accepted tokens)."""
    prompt = random_prompts([7], seed=2)[0]
    w = weights(target)
    kv = prefilled(target, prompt)
    P = len(prompt) - 1
    tokens = torch.tensor([[prompt[-1], 3, 4, 5]])
    positions = (P + torch.arange(4)).unsqueeze(0)
    _, h = forward_with_masks(target, kv, tokens, positions, group_rows(w, positions, 2))
    for n in range(4):
        alone = clone(kv)
        for t in alone.k + alone.v:
            t[:, :, P + n + 1 :] = float("nan")  # slots the group must not read
        with torch.inference_mode():
            ref = mask_hidden(target, alone, group_rows(w, positions[:, n : n + 1], 2))
        torch.testing.assert_close(h[:, 2 * n : 2 * n + 2], ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(h[:, 0:2], h[:, 2:4])  # the groups differ: they read different prefixes


@pytest.mark.parametrize("batch, switch", [(1, 4), (3, 4), (3, 0), (5, 4)])
def test_greedy_output_equals_the_target_alone(target, batch, switch):
    """Parallel steps (batch <= switch), the sequential fallback (switch 0), and a batch that starts
    above the switch and drops below it as rows finish (5 rows of different lengths)."""
    prompts = random_prompts([5, 9, 3, 7, 11][:batch], seed=3)
    drafter = FlexDrafter(target, weights(target), block=3, switch_batch=switch)
    engine = Engine(target, drafter, FixedK(3))
    lengths = [20, 14, 24, 9, 17][:batch]  # rows leave at different steps
    outs = decode_requests(engine, [Request(p, n) for p, n in zip(prompts, lengths)])
    for p, n, got in zip(prompts, lengths, outs):
        assert got == plain_greedy(target, p, n)
    assert engine.stats.drafted > 0


@pytest.mark.parametrize("switch", [4, 0])
def test_a_head_subset_drafts_only_its_tokens(target, switch):
    prompts = random_prompts([6, 4], seed=4)
    head = head_subset(40)
    drafter = FlexDrafter(target, weights(target), block=3, switch_batch=switch, head_tokens=head)
    engine = Engine(target, drafter, FixedK(3))
    seen = []
    propose = drafter.propose
    drafter.propose = lambda *a: seen.append(propose(*a)) or seen[-1]
    assert decode(engine, prompts, 16) == [plain_greedy(target, p, 16) for p in prompts]
    drafted = torch.cat([p.tokens.flatten() for p in seen])
    assert drafted.numel() and torch.isin(drafted, head).all()


def test_the_engine_refuses_another_runtime(target):
    other = compact(tiny_llama(num_layers=3, seed=5))
    with pytest.raises(SpecdraftError, match="drafts inside its target's forward"):
        Engine(other, FlexDrafter(target, weights(target)))
    with pytest.raises(SpecdraftError, match="Llama-family targets only"):
        FlexDrafter(Gemma3Runtime(target.w), weights(target))
    with pytest.raises(SpecdraftError, match="split layer"):
        FlexWeights.init(target, 3)
