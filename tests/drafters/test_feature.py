"""The feature-conditioned (EAGLE-style) draft: the engine-side drafter computes exactly what the
training model computes, it trains, saves and loads, and decoding with it stays lossless."""

import pytest
import torch

from specdraft import api, kernels
from specdraft.design.artifact import DraftMeta, save_draft
from specdraft.design.feature import FeatureDraftLM
from specdraft.design.prune import depth_prune
from specdraft.design.train import TrainConfig, train_offline, validate
from specdraft.design.vocab import VocabSubset
from specdraft.drafters.base import DraftContext, TargetFeatures
from specdraft.drafters.feature import FeatureDrafter
from specdraft.engine import Engine
from specdraft.models.llama import LlamaRuntime
from specdraft.models.subset_head import SubsetHeadRuntime, draft_weights
from specdraft.policy import FixedK
from specdraft.verify import SamplingParams
from tests.helpers import decode, head_subset, kept_features, random_prompts, target_answers


@pytest.fixture(scope="module")
def data(tiny_pipe):
    prompts = random_prompts([4, 9, 6, 12, 5, 7], seed=21)
    return target_answers(tiny_pipe, prompts, max_new_tokens=16, batch_size=3)


def _model(tiny_pipe, head):
    torch.manual_seed(0)
    fc = torch.randn(64, 128) * 0.1
    return FeatureDraftLM(depth_prune(tiny_pipe.target.model, [0]), head, fc=fc)


def _drafter(tiny_pipe, model, head):
    w = draft_weights(model.draft, tiny_pipe.runtime.w, head, torch.float32)
    rt = SubsetHeadRuntime(LlamaRuntime(w), head, 256) if head is not None else LlamaRuntime(w)
    return FeatureDrafter(rt, model.fc.weight.detach(), tiny_pipe.runtime.w.embed, "feature")


@pytest.mark.parametrize("subset", [False, True])
def test_drafter_matches_the_training_model(tiny_pipe, data, subset):
    head = head_subset(96) if subset else None
    model = _model(tiny_pipe, head).eval()
    drafter = _drafter(tiny_pipe, model, head)
    i, c = 2, 5  # sequence 2; pretend the target just verified c positions and all were accepted
    P, hid = data.prompt_lens[i], data.hidden[i]
    tokens = data.tokens[i]
    L = P + c  # committed: prompt + c answer tokens; real features at positions P-1 .. P+c-2
    state = drafter.new_state(1, 64)
    kept = kept_features({-1: hid[:c].unsqueeze(0)}, [P - 1], 64)
    ctx = DraftContext(tokens.unsqueeze(0), torch.tensor([L]), [SamplingParams()], [None], features=kept)
    prop = drafter.propose(state, ctx, 3)
    with torch.no_grad():
        f = model.features(
            hid[:c].unsqueeze(0), tokens[P : P + c].unsqueeze(0), torch.arange(P - 1, P - 1 + c).unsqueeze(0)
        )
        first = model.tokens.head(f[0, -1]).argmax()
        expected = model.head_tokens[first]
        # the second draft token reads the draft's own feature
        f2 = model.features(
            torch.cat([hid[:c], f[0, -1:]]).unsqueeze(0),
            torch.cat([tokens[P : P + c], expected.view(1)]).unsqueeze(0),
            torch.arange(P - 1, P + c).unsqueeze(0),
        )
        second = model.head_tokens[model.tokens.head(f2[0, -1]).argmax()]
    assert prop.num_valid.tolist() == [3]
    assert prop.tokens[0, :2].tolist() == [int(expected), int(second)]


@pytest.mark.skipif(not kernels.available(), reason=f"native kernel: {kernels.status()}")
def test_causal_draft_steps_run_on_the_native_kernels(tiny_pipe, data, monkeypatch):
    """The draft's cache holds a row's context from its start at slot 0 (RoPE at relative positions,
    the test above checks it is the same draft), so its causal steps need no attention mask and take
    a native path as a decode step does, not torch's masked one."""
    paths = []
    choose = LlamaRuntime._path
    monkeypatch.setattr(LlamaRuntime, "_path", lambda rt, *a: paths.append(choose(rt, *a)) or paths[-1])
    drafter = _drafter(tiny_pipe, _model(tiny_pipe, None).eval(), None)
    i, c = 2, 5
    P, tokens = data.prompt_lens[i], data.tokens[i]
    kept = kept_features({-1: data.hidden[i][:c].unsqueeze(0)}, [P - 1], 64)
    ctx = DraftContext(tokens.unsqueeze(0), torch.tensor([P + c]), [SamplingParams()], [None], features=kept)
    drafter.propose(drafter.new_state(1, 64), ctx, 3)
    # the step's real pairs, then two drafted pairs: native attention ("fused": the tiny model's
    # layers in torch around it; "native": all of them in one call), not torch's masked attention
    assert len(paths) == 3 and set(paths) <= {"fused", "native"}, paths


def test_recorded_hidden_states_are_the_targets_over_prompt_and_answer(tiny_pipe, data):
    """Rows join a refilled batch with prompts of other lengths: each sequence's prompt hidden states
    (the prefill's) and answer hidden states are one full forward's over its tokens."""
    rt = tiny_pipe.runtime
    for i, tokens in enumerate(data.tokens):
        P, S = data.prompt_lens[i], tokens.shape[0]
        out = rt.forward(
            rt.new_state(1, S),
            tokens[:-1].unsqueeze(0),
            torch.arange(S - 1).unsqueeze(0),
            hidden_layers=(-1,),
        )
        full = out.hidden[-1][0]  # (S - 1, C): positions 0 .. S - 2
        assert data.prompt_hidden[i].shape == (P - 1, full.shape[1])
        assert torch.allclose(data.prompt_hidden[i], full[: P - 1], atol=1e-4)
        assert torch.allclose(data.hidden[i], full[P - 1 :], atol=1e-4)


@pytest.mark.parametrize("c", [0, 4])
@pytest.mark.parametrize("pairs", [2, 100])
def test_a_drafter_reading_the_prompt_matches_the_training_model(tiny_pipe, data, pairs, c):
    """With ``prompt_pairs``, the engine-side drafter (fed the prefill's features, as the engine keeps
    them) drafts the token the training model's batch predicts at the same answer position, from the
    first step after the prefill on (``c = 0``: the last prompt pair's label is the answer's first
    token)."""
    model = _model(tiny_pipe, None).eval()
    model.prompt_pairs = pairs
    drafter = _drafter(tiny_pipe, model, None)
    drafter.prompt_pairs = pairs
    i = 3
    P, tokens = data.prompt_lens[i], data.tokens[i]
    L = P + c
    feats = torch.cat([data.prompt_hidden[i], data.hidden[i][:c]]).unsqueeze(0)  # positions 0 .. L - 2
    kept = TargetFeatures(kept_features({-1: feats}, [0], 64).hidden, torch.tensor([P - 1]))
    ctx = DraftContext(tokens.unsqueeze(0), torch.tensor([L]), [SamplingParams()], [None], features=kept)
    state = drafter.new_state(1, 64)
    prop = drafter.propose(state, ctx, 2)
    assert int(state.start[0]) == max(0, P - 1 - pairs)
    with torch.no_grad():
        batch = model.make_batch(data, [i], max_len=64)  # labelled: the answer's pairs only
        logits = model.head_logits(batch)
        answer_only = FeatureDraftLM(model.draft, None, fc=model.fc.weight.detach())
        without = answer_only.head_logits(answer_only.make_batch(data, [i], max_len=64))
    # labelled: the prompt's last pair, then the answer's (all but the last), as without prompt pairs
    assert logits.shape[0] == 1 + without.shape[0] == data.hidden[i].shape[0]
    assert prop.num_valid.tolist() == [2] and prop.tokens[0, 0] == logits[c].argmax()
    assert not torch.allclose(logits[1:], without, atol=1e-3)  # the prompt's pairs change the draft's logits


def test_no_features_yet_means_no_proposal(tiny_pipe):
    model = _model(tiny_pipe, None).eval()
    drafter = _drafter(tiny_pipe, model, None)
    state = drafter.new_state(2, 32)
    ctx = DraftContext(
        torch.zeros(2, 32, dtype=torch.int64), torch.tensor([5, 6]), [SamplingParams()] * 2, [None] * 2, {}
    )
    assert drafter.propose(state, ctx, 4).num_valid.tolist() == [0, 0]


@pytest.mark.parametrize("pairs", [0, 3])
def test_the_second_position_reads_the_drafts_own_feature(tiny_pipe, data, pairs, tmp_path):
    """``second_position``'s one masked forward gives, at every labelled pair, what drafting gives:
    the real pairs before it, then the pair of the draft's own feature (predicted one pair earlier,
    from real features) with the real next token; and ``validate`` reports its rate as ``alpha_2``."""
    model = _model(tiny_pipe, head_subset(96))
    model.prompt_pairs = pairs
    cfg = TrainConfig(steps=25, batch_size=3, max_len=40, lr=3e-3, warmup=1, eval_every=25)
    train_offline(model, data, data, cfg, tmp_path, progress=False)  # so that some positions hit
    model.eval()
    batch = model.make_batch(data, [0, 3, 4], max_len=12)
    hit1, hit2, first_right = model.second_position(batch)
    assert torch.equal(hit1, model.predict(batch) == batch.target)
    expected = []
    with torch.no_grad():
        h = model.features(batch.feats, batch.ids, batch.positions)
        for b, t in zip(batch.rows.tolist(), batch.cols.tolist()):
            if t == 0:
                expected.append(False)
                continue
            feats = torch.cat([batch.feats[b, :t], h[b, t - 1 : t]])  # real pairs, then the drafted one
            f = model.features(
                feats[None], batch.ids[b : b + 1, : t + 1], batch.positions[b : b + 1, : t + 1]
            )
            expected.append(model.tokens.head(f[0, -1]).argmax().item())
    labels = batch.target.tolist()
    assert hit2.tolist() == [e is not False and e == y for e, y in zip(expected, labels)] and hit2.any()
    first = {
        (b, t): bool(p == y)
        for b, t, p, y in zip(
            *(x.tolist() for x in (batch.rows, batch.cols, model.predict(batch), batch.target))
        )
    }
    assert first_right.tolist() == [
        first.get((b, t - 1), False) for b, t in zip(batch.rows.tolist(), batch.cols.tolist())
    ]
    assert first_right.any()
    stats = validate(model, data)
    assert 0.0 <= stats["alpha_2"] <= 1.0 and stats["mean_accepted_length"] >= 1.0


def test_trains_saves_loads_and_stays_lossless(tiny_pipe, data, tmp_path):
    head = head_subset(128)
    model = _model(tiny_pipe, head)
    before = validate(model, data)["alpha"]
    res = train_offline(
        model,
        data,
        data,
        TrainConfig(steps=25, batch_size=3, max_len=40, lr=3e-3, warmup=1, eval_every=25),
        tmp_path / "w",
        progress=False,
    )
    assert res.val["alpha"] > before
    target = tiny_pipe.target.model
    meta = DraftMeta.for_target(target, "tiny", kind="feature", head=VocabSubset(head, 0.0), init_layers=[0])
    save_draft(tmp_path / "f", model.draft, meta, extra={"fc.weight": model.fc.weight})
    pipe = api.load("tiny", draft=f"designed:{tmp_path / 'f'}", dtype="fp32")
    assert isinstance(pipe.drafter, FeatureDrafter)
    prompts = random_prompts([5, 11, 8], seed=9)
    engine = pipe.engine(3)
    assert engine.hidden_layers == (-1,)
    got = decode(engine, prompts, 20)
    assert got == decode(Engine(pipe.runtime), prompts, 20)
    assert engine.stats.drafted > 0 and engine.stats.accepted > 0
    sampled = decode(pipe.engine(3), prompts, 12, SamplingParams(temperature=0.8, seed=1))
    assert [len(s) for s in sampled] == [12, 12, 12]


def test_an_engine_feeds_the_layers_its_drafter_names_unless_told_otherwise(tiny_pipe):
    """``Engine(target, drafter)`` hands a feature drafter the target states it names (so the study's
    online runs and the profiler, which build engines plainly, measure it drafting); an explicit
    ``hidden_layers=()`` hands none, and the drafter then proposes nothing."""
    drafter = _drafter(tiny_pipe, _model(tiny_pipe, None).eval(), None)
    prompts = random_prompts([5, 8], seed=12)
    fed = Engine(tiny_pipe.runtime, drafter, FixedK(3))
    assert fed.hidden_layers == (-1,)
    assert decode(fed, prompts, 12) == decode(Engine(tiny_pipe.runtime), prompts, 12)
    assert fed.stats.drafted > 0
    starved = Engine(tiny_pipe.runtime, drafter, FixedK(3), hidden_layers=())
    decode(starved, prompts, 12)
    assert starved.stats.drafted == 0
