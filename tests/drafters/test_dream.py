"""The DREAM-style draft: the engine-side drafter computes exactly what the training model computes
(cross-attention over the target's intermediate layers included), and decoding with a saved and
reloaded draft stays lossless."""

import pytest
import torch

from specdraft import api
from specdraft.design.artifact import DraftMeta, save_draft
from specdraft.design.dream import DreamDraftLM, target_features
from specdraft.design.prune import depth_prune
from specdraft.design.vocab import VocabSubset
from specdraft.drafters.base import DraftContext
from specdraft.drafters.dream import DreamDrafter
from specdraft.engine import Engine
from specdraft.models.llama import LlamaRuntime
from specdraft.models.subset_head import SubsetHeadRuntime, draft_weights
from specdraft.verify import SamplingParams
from tests.helpers import decode, head_subset, kept_features, random_prompts, target_answers


@pytest.fixture(scope="module")
def data(tiny_pipe):
    prompts = random_prompts([4, 9, 6, 12, 5, 7], seed=21)
    return target_answers(tiny_pipe, prompts, max_new_tokens=16, batch_size=3)


def _model(tiny_pipe, head):
    torch.manual_seed(0)
    model = DreamDraftLM(
        depth_prune(tiny_pipe.target.model, [1]), head, tiny_pipe.target.model, fc=torch.randn(64, 128) * 0.1
    )
    with torch.no_grad():  # a live cross-attention block (it starts as the identity)
        model.cross["o"].normal_(0, 0.2)
        model.cross["mem_norm"].uniform_(0.5, 1.5)
    return model


def _drafter(tiny_pipe, model, head):
    w = draft_weights(model.draft, tiny_pipe.runtime.w, head, torch.float32)
    rt = SubsetHeadRuntime(LlamaRuntime(w), head, 256) if head is not None else LlamaRuntime(w)
    cross = {k: v.detach() for k, v in model.cross.items()}
    return DreamDrafter(
        rt, model.fc.weight.detach(), cross, tiny_pipe.runtime.w.embed, "dream", model.layers, model.heads
    )


@pytest.mark.parametrize("subset", [False, True])
def test_drafter_matches_the_training_model(tiny_pipe, data, subset):
    head = head_subset(96) if subset else None
    model = _model(tiny_pipe, head).eval()
    drafter = _drafter(tiny_pipe, model, head)
    assert drafter.hidden_layers == (-1, *model.layers)
    i, c = 2, 5  # sequence 2; the target just verified c positions (P-1 .. P+c-2)
    P, hid, tokens = data.prompt_lens[i], data.hidden[i], data.tokens[i]
    memory, _ = target_features(
        tiny_pipe.target.model, tokens[: P + c].unsqueeze(0), model.layers, model.frac
    )
    mem = memory[:, P - 1 : P - 1 + c]  # (1, c, M, C)
    state = drafter.new_state(1, 64)
    hidden = {-1: hid[:c].unsqueeze(0), **{li: mem[:, :, j] for j, li in enumerate(model.layers)}}
    kept = kept_features(hidden, [P - 1], 64)
    ctx = DraftContext(tokens.unsqueeze(0), torch.tensor([P + c]), [SamplingParams()], [None], features=kept)
    prop = drafter.propose(state, ctx, 3)
    with torch.no_grad():
        pos = torch.arange(P - 1, P - 1 + c).unsqueeze(0)
        f, _ = model.features(hid[:c].unsqueeze(0), tokens[P : P + c].unsqueeze(0), pos, mem)
        first = model.head_tokens[model.tokens.head(f[0, -1]).argmax()]
        # the second draft token reads the draft's own feature and the last verified position's layers
        f2, _ = model.features(
            torch.cat([hid[:c], f[0, -1:]]).unsqueeze(0),
            torch.cat([tokens[P : P + c], first.view(1)]).unsqueeze(0),
            torch.arange(P - 1, P + c).unsqueeze(0),
            torch.cat([mem, mem[:, -1:]], dim=1),
        )
        second = model.head_tokens[model.tokens.head(f2[0, -1]).argmax()]
    assert prop.num_valid.tolist() == [3]
    assert prop.tokens[0, :2].tolist() == [int(first), int(second)]


def test_missing_layers_mean_no_proposal(tiny_pipe, data):
    drafter = _drafter(tiny_pipe, _model(tiny_pipe, None).eval(), None)
    state = drafter.new_state(1, 32)
    ctx = DraftContext(
        data.tokens[0][:10].unsqueeze(0),
        torch.tensor([8]),
        [SamplingParams()],
        [None],
        features=kept_features({-1: torch.zeros(1, 2, 64)}, [5], 32),
    )
    assert drafter.propose(state, ctx, 3).num_valid.tolist() == [0]  # the engine handed out no layer 0


def test_saved_draft_loads_by_kind_and_stays_lossless(tiny_pipe, tmp_path):
    head = head_subset(128)
    model = _model(tiny_pipe, head).eval()
    target = tiny_pipe.target.model
    meta = DraftMeta.for_target(
        target,
        "tiny",
        kind="dream",
        head=VocabSubset(head, 0.0),
        init_layers=[1],
        arch={"layers": model.layers, "heads": model.heads},
    )
    extra = {k: v for k, v in model.own_state().items() if k == "fc.weight" or k.startswith("cross.")}
    save_draft(tmp_path / "d", model.draft, meta, extra=extra)
    pipe = api.load("tiny", draft=f"designed:{tmp_path / 'd'}", dtype="fp32")
    assert isinstance(pipe.drafter, DreamDrafter)
    prompts = random_prompts([5, 11, 8], seed=9)
    engine = pipe.engine(3)
    assert engine.hidden_layers == (-1, *model.layers)
    got = decode(engine, prompts, 20)
    assert got == decode(Engine(pipe.runtime), prompts, 20)
    assert engine.stats.drafted > 0
    # the same proposals as the in-memory drafter (the round trip lost nothing)
    mine = Engine(
        tiny_pipe.runtime,
        _drafter(tiny_pipe, model, head),
        pipe.engine(3).policy,
        hidden_layers=engine.hidden_layers,
    )
    assert decode(mine, prompts, 20) == got and mine.stats.accepted == engine.stats.accepted
    assert mine.stats.drafted == engine.stats.drafted
    # the server's engine hands the drafter the target layers it reads too
    from specdraft.server.metrics import Metrics
    from specdraft.server.scheduler import Scheduler

    sched = Scheduler(pipe, pipe.engine(3).policy, max_batch=2, max_queue=2, metrics=Metrics())
    assert sched._new_engine().hidden_layers == (-1, *model.layers)
