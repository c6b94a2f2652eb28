"""The block-diffusion drafter: its feature window is what training reads, decoding with it equals
the target alone, the length head caps every proposal, and a block costs one draft forward."""

import pytest
import torch

from specdraft.design.diffusion import DiffusionDraftLM
from specdraft.design.prune import depth_prune
from specdraft.design.train import TrainConfig, train_offline
from specdraft.drafters.base import DraftContext
from specdraft.drafters.diffusion import BlockArch, DiffusionDrafter
from specdraft.engine import Engine
from specdraft.policy import CappedPolicy, CostAwareK, FixedK
from specdraft.verify import SamplingParams
from tests.helpers import decode, head_subset, plain_greedy, random_prompts, target_answers

ARCH = BlockArch(block=6, window=3)


@pytest.fixture(scope="module")
def data(tiny_pipe):
    prompts = random_prompts([4, 9, 6, 12, 5, 7], seed=21)
    return target_answers(tiny_pipe, prompts, max_new_tokens=16, batch_size=3)


def _model(tiny_pipe, head=None):
    torch.manual_seed(0)
    return DiffusionDraftLM(depth_prune(tiny_pipe.target.model, [0]), head, ARCH)


@pytest.fixture(scope="module")
def trained(tiny_pipe, data, tmp_path_factory):
    """A few steps on the target's answers: enough for some accepted blocks."""
    model = _model(tiny_pipe)
    cfg = TrainConfig(steps=30, batch_size=6, lr=3e-3, warmup=2, checkpoint_every=30, eval_every=0)
    train_offline(model, data, None, cfg, tmp_path_factory.mktemp("diffusion"), progress=False)
    return model


@pytest.mark.parametrize("subset", [False, True])
def test_proposal_is_what_training_predicts_from_the_same_window(tiny_pipe, data, subset):
    head = head_subset(96, must=tuple(data.tokens[2].tolist())) if subset else None
    model = _model(tiny_pipe, head).eval()
    drafter = DiffusionDrafter(model.block, "diffusion", adaptive=False)
    i, c = 2, 5  # the target just verified c positions of answer 2 and all were accepted
    P, hid, tokens = data.prompt_lens[i], data.hidden[i], data.tokens[i]
    state = drafter.new_state(1, 64)
    state.src[:], state.prev_L[:] = 0, P
    ctx = DraftContext(
        tokens.unsqueeze(0), torch.tensor([P + c]), [SamplingParams()], [None], {-1: hid[:c].unsqueeze(0)}
    )
    prop = drafter.propose(state, ctx, 5)
    assert state.count.tolist() == [3] and torch.equal(state.feats[0], hid[c - 3 : c])
    batch = model.make_batch(data, [i], 0)  # evenly spaced anchors; pick anchor j = c - 1
    a = int((batch.L == P + c).nonzero()[0, 0])
    with torch.no_grad():
        h = model.block(
            batch.feats[a : a + 1], batch.valid[a : a + 1], batch.anchor[a : a + 1], batch.L[a : a + 1]
        )
        want = model.head_tokens[model.block.logits(h[0, 1:]).argmax(-1)]
    assert prop.tokens[0].tolist() == want.tolist()
    assert prop.num_valid.tolist() == [5] and prop.steps.tolist() == [1] and prop.bucket is None


def test_window_slides_and_restarts_after_a_missed_forward(tiny_pipe):
    drafter = DiffusionDrafter(_model(tiny_pipe).block, "diffusion")
    state = drafter.new_state(2, 64)
    state.src[:], state.prev_L[:] = torch.tensor([1, 0]), torch.tensor([10, 20])
    state.count[:] = torch.tensor([2, 3])
    state.feats[:] = -1.0
    hidden = torch.arange(2 * 4 * 64, dtype=torch.float32).view(2, 4, 64)
    state.take(hidden, torch.tensor([12, 27]))  # row 0 accepted 1 (2 new features); row 1 missed one
    assert state.count.tolist() == [3, 3]
    assert torch.equal(state.feats[0, 0], torch.full((64,), -1.0)) and torch.equal(
        state.feats[0, 1:], hidden[1, :2]
    )
    assert torch.equal(state.feats[1], hidden[0, 1:])  # restarted: only the last forward's features


def test_greedy_output_equals_the_target_alone(tiny_pipe, trained):
    target = tiny_pipe.runtime
    prompts = random_prompts([5, 11, 8], seed=3)
    drafter = DiffusionDrafter(trained.block, "diffusion")
    for policy in (FixedK(5), CostAwareK(k_max=5)):
        engine = Engine(target, drafter, policy, hidden_layers=drafter.hidden_layers)
        out = decode(engine, prompts, 24)
        assert out == [plain_greedy(target, p, 24) for p in prompts]
        assert engine.stats.drafted > 0
        if isinstance(policy, FixedK):  # (the cost-aware policy may find blocks do not pay here)
            assert engine.stats.accepted > 0


@pytest.mark.parametrize("bias, n", [(-20.0, 1), (0.0, 3), (20.0, 5)])
def test_length_head_caps_every_proposal(tiny_pipe, trained, bias, n):
    """a = sigmoid(bias) with a zero second layer: n = clamp(round(a * 6), 1, 5) tokens per block,
    and the engine never verifies past it (with a fixed k of 5)."""
    model = _model(tiny_pipe)
    model.load_own_state(trained.own_state())
    with torch.no_grad():
        model.block.t["len2_weight"].zero_()
        model.block.t["len2_bias"].fill_(bias)
    drafter = DiffusionDrafter(model.block, "diffusion")
    engine = Engine(tiny_pipe.runtime, drafter, FixedK(5), hidden_layers=drafter.hidden_layers)
    decode(engine, random_prompts([6, 9], seed=4), 20)
    drafted = engine.stats.drafted_per_position
    assert drafted[n - 1] > 0 and all(d == 0 for d in drafted[n:])


def test_the_cost_aware_policy_charges_one_draft_forward_per_block(tiny_pipe, trained):
    """The engine marks the policy for a block drafter: T_draft is a step's draft time (not per
    token), charged once whatever k, so the best k is longer than a per-token charge gives."""
    drafter = DiffusionDrafter(trained.block, "diffusion")
    policy = CostAwareK(k_max=4, watch=None, guard=None)  # the model's choice, unchecked (SafeArm)
    Engine(tiny_pipe.runtime, drafter, policy, hidden_layers=drafter.hidden_layers)
    assert policy.per_block and not CostAwareK().per_block
    capped = CappedPolicy(CostAwareK(k_max=4))  # the server's wrapper passes it on
    Engine(tiny_pipe.runtime, drafter, capped, hidden_layers=drafter.hidden_layers)
    assert capped.inner.per_block
    per_token = CostAwareK(k_max=4, watch=None, guard=None)
    for p in (policy, per_token):
        for i in range(40):  # blocks of 4 drafts, 4 or 2 accepted; T_target(n) = 1 + 0.075 (n - 1)
            p.update(4, torch.tensor([4]), torch.tensor([4 if i % 2 else 2]), 1.2, 1.3)
        p.update(0, torch.tensor([0]), torch.tensor([0]), 0.0, 1.0)
    assert policy.t_draft == pytest.approx(1.2) and per_token.t_draft == pytest.approx(0.3)
    assert policy.choose() == 4 and per_token.choose() == 2


def test_the_study_charges_one_draft_forward_per_block(tiny_pipe, trained):
    from specdraft.bench.profile import profile_latency
    from specdraft.study.latency import Latencies, draft_kind

    drafter = DiffusionDrafter(trained.block, "diffusion")
    assert draft_kind(drafter) == "block"
    lat = Latencies(target={}, draft_kinds={"d": draft_kind(drafter)})
    assert [lat.draft_calls("d", k) for k in (0, 1, 5)] == [0, 1, 1]
    prof = profile_latency(
        tiny_pipe.runtime, drafter, new_tokens=(1,), context=16, repeats=3, warmup=1, breakdown=False
    )
    # the profiled draft step is the block forward (a propose without features would do nothing)
    step = drafter.profile_step(1, 16)
    tokens, n = step()
    assert tokens.shape == (1, ARCH.block - 1) and 1 <= int(n[0]) <= ARCH.block - 1
    assert prof.t_draft[1] > 0
