"""Training a FlexDraft draft: the engine-side drafter computes what the training model computes,
training lowers the loss and resumes exactly, and ``design build --kind flex`` end to end."""

import json

import pytest
import torch

from specdraft.cli import main
from specdraft.design.flex import FlexDraftLM
from specdraft.design.train import TrainConfig, train_offline
from specdraft.drafters.base import DraftContext
from specdraft.drafters.flex import FlexDrafter, FlexWeights
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.policy import FixedK
from specdraft.verify import SamplingParams
from tests.helpers import TINY_BUILD, decode, head_subset, plain_greedy, random_prompts, target_answers


@pytest.fixture(scope="module")
def data(tiny_pipe):
    return target_answers(tiny_pipe, random_prompts([5, 8, 6, 7], seed=6), max_new_tokens=10, hidden=False)


def _fresh(tiny_pipe, head=None):
    torch.manual_seed(0)
    return FlexDraftLM(tiny_pipe.target.model, split=1, block=3, rank=16, anchors=4, head_tokens=head)


@pytest.mark.parametrize("subset", [False, True])
def test_drafter_matches_the_training_model(tiny_pipe, data, subset):
    head = head_subset(96, must=tuple(data.tokens[1].unique().tolist())) if subset else None
    model = _fresh(tiny_pipe, head)
    with torch.no_grad():
        model.up.normal_(0, 0.2)  # a live calibration
        model.mask.normal_()
    model.eval()
    batch = model.make_batch(data, [1], 320)
    q_train = torch.softmax(model.logits(batch).detach(), -1)  # (M, V)
    rt = model.runtime
    drafter = FlexDrafter(rt, FlexWeights.from_tensors(model.own_state(), 1, 2), block=3, head_tokens=head)
    compared = 0
    for a in range(4):  # each anchor p: the sequential draft after committing tokens 0..p+1
        p = int(batch.visible[0, a])
        kv = rt.new_state(1, 64)
        rt.forward(kv, batch.ids[:, : p + 1], torch.arange(p + 1).unsqueeze(0))
        ctx = DraftContext(
            batch.ids, torch.tensor([p + 2]), [SamplingParams(temperature=1.0)], [torch.Generator()], None, kv
        )
        q = drafter.propose(drafter.new_state(1, 64), ctx, 3).probs[0]  # (3, V)
        for j in range(3):
            hit = ((batch.rows == 0) & (batch.cols == a * 3 + j)).nonzero()
            if len(hit):
                q_head = q[j] if head is None else q[j, head]  # (zero outside the head)
                assert float(q_head.sum()) == pytest.approx(1.0, abs=1e-5)
                torch.testing.assert_close(q_head, q_train[int(hit[0, 0])], rtol=1e-4, atol=1e-5)
                compared += 1
    assert compared >= 8


def test_training_lowers_the_loss_and_resumes_exactly(tiny_pipe, data, tmp_path):
    cfg = TrainConfig(steps=6, batch_size=2, lr=3e-3, warmup=0, checkpoint_every=1, eval_every=0)
    whole = _fresh(tiny_pipe)
    first = whole.loss(whole.make_batch(data, [0, 1, 2, 3], 320), cfg)[0].item()
    res = train_offline(whole, data, data, cfg, tmp_path / "a", progress=False)
    whole.train()
    torch.manual_seed(1)
    assert whole.loss(whole.make_batch(data, [0, 1, 2, 3], 320), cfg)[0].item() < first
    assert res.val["alpha"] >= 0.0 and {"ce", "kl"} <= set(res.history[-1])
    killed = _fresh(tiny_pipe)
    train_offline(killed, data, None, cfg, tmp_path / "b", progress=False, stop_after=3)
    resumed = _fresh(tiny_pipe)
    assert train_offline(resumed, data, None, cfg, tmp_path / "b", progress=False).resumed_from == 3
    for k, v in whole.own_state().items():
        torch.testing.assert_close(v, resumed.own_state()[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(SpecdraftError, match="flex draft lacks"):
        _fresh(tiny_pipe).load_own_state({k: v for k, v in whole.own_state().items() if k != "flex.mask"})


@pytest.mark.parametrize("switch", [4, 0])
def test_a_trained_draft_is_accepted_while_decoding(tiny_pipe, data, tmp_path, switch):
    """Trained on the target's answers to these prompts, the draft is accepted far more than the
    untrained one (in the parallel step and in the sequential mode); output equals the target's."""
    prompts = [t[:p].tolist() for t, p in zip(data.tokens, data.prompt_lens)]
    rt = tiny_pipe.runtime
    model = _fresh(tiny_pipe)
    accepted = []
    for steps in (0, 150):
        if steps:
            cfg = TrainConfig(
                steps=steps, batch_size=4, lr=1e-2, warmup=0, checkpoint_every=150, eval_every=0
            )
            train_offline(model, data, None, cfg, tmp_path, progress=False)
        w = FlexWeights.from_tensors(model.own_state(), 1, 2)
        engine = Engine(rt, FlexDrafter(rt, w, block=3, switch_batch=switch), FixedK(3))
        assert decode(engine, prompts, 10) == [plain_greedy(rt, p, 10) for p in prompts]
        accepted.append(engine.stats.accepted / engine.stats.drafted)
    assert accepted[1] > max(0.3, 2 * accepted[0]), accepted


def test_build_kind_flex_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "f"
    argv = [*TINY_BUILD, "--kind", "flex", "--layers", "1"]
    assert main([*argv, "--head", "64", "--block", "3", "--steps", "2", "--out", str(out)]) == 0
    meta = json.loads((out / "specdraft.json").read_text())
    assert 64 <= len(meta["head_tokens"]) <= 65  # (EOS always in)
    assert meta["kind"] == "flex" and meta["arch"] == {"split": 1, "block": 3, "rank": 256}
    assert meta["recipe"]["offline"]["steps"] == 2 and not (out / "config.json").exists()
    recipe = (out / "RECIPE.md").read_text()
    assert "a FlexDraft split at target layer 1 " in recipe  # no layers of its own
    assert "--draft designed:f --dtype bf16\n" in recipe  # (the quantized runtime refuses it)
    gen = [
        "generate",
        "hello",
        "--target",
        "tiny",
        "--threads",
        "1",
        "--dtype",
        "fp32",
        "--max-new-tokens",
        "8",
    ]
    assert main([*gen, "--draft", f"designed:{out}", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*gen, "--draft", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == res["tokens"]
    assert res["stats"]["drafted"] > 0
    exp = ["design", "export", str(out), "--target", "tiny", "--threads", "1", "--out", str(tmp_path / "x")]
    assert main(exp) != 0 and "exports only in its own format" in capsys.readouterr().err
