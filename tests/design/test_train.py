"""Distillation on a tiny target: the loss falls, validation acceptance is measured, a killed run
resumes from its checkpoint and ends where an uninterrupted run ends, and bad checkpoints are refused."""

import pytest
import torch

from specdraft.design.data import generate_target_data
from specdraft.design.prune import depth_prune
from specdraft.design.train import CHECKPOINT, DraftLM, TrainConfig, load_checkpoint, train_offline, validate
from specdraft.errors import SpecdraftError
from tests.helpers import head_subset, plain_greedy, random_prompts


@pytest.fixture(scope="module")
def data(tiny_pipe):
    prompts = random_prompts([4, 9, 6, 12, 5, 7, 8, 10], seed=11)
    return generate_target_data(
        tiny_pipe.runtime, prompts, eos_ids=(), max_new_tokens=24, batch_size=3, topk=8, progress=False
    )


def test_data_is_the_targets_greedy_answer_with_its_topk(tiny_pipe, data):
    assert len(data) == 8 and data.num_response_tokens == 8 * 24
    for i in (0, 5):
        p = data.tokens[i][: data.prompt_lens[i]].tolist()
        assert data.tokens[i][data.prompt_lens[i] :].tolist() == plain_greedy(tiny_pipe.runtime, p, 24)
        assert torch.equal(data.topk_idx[i][:, 0], data.tokens[i][data.prompt_lens[i] :])  # greedy = top-1
        assert (data.topk_logp[i][:, :-1] >= data.topk_logp[i][:, 1:]).all() and (
            data.topk_logp[i] <= 0
        ).all()


def _model(tiny_pipe, head=None):
    return DraftLM(depth_prune(tiny_pipe.target.model, [0]), head)


CFG = {
    "steps": 6,
    "batch_size": 3,
    "max_len": 40,
    "lr": 3e-3,
    "warmup": 1,
    "checkpoint_every": 2,
    "eval_every": 3,
}


def test_loss_falls_and_validation_acceptance_rises(tiny_pipe, data, tmp_path):
    model = _model(tiny_pipe, head_subset(128))
    before = validate(model, data)
    res = train_offline(
        model, data, data, TrainConfig(**{**CFG, "steps": 30, "eval_every": 10}), tmp_path, progress=False
    )
    assert res.steps == 30 and len(res.history) == 3
    assert res.history[-1]["loss"] < res.history[0]["loss"]
    assert res.val["alpha"] > before["alpha"]
    assert res.val["mean_accepted_length"] >= 1.0


def test_killed_run_resumes_and_matches_an_uninterrupted_run(tiny_pipe, data, tmp_path):
    full = _model(tiny_pipe)
    res_full = train_offline(full, data, data, TrainConfig(**CFG), tmp_path / "a", progress=False)

    part = _model(tiny_pipe)
    # "killed" at step 5
    train_offline(part, data, data, TrainConfig(**CFG), tmp_path / "b", progress=False, stop_after=5)
    assert load_checkpoint(tmp_path / "b" / CHECKPOINT)["step"] == 4  # lost at most one interval
    resumed = _model(tiny_pipe)  # a new process: fresh weights, everything from the checkpoint
    res = train_offline(resumed, data, data, TrainConfig(**CFG), tmp_path / "b", progress=False)
    assert res.resumed_from == 4 and res.steps == 6
    assert res.history == res_full.history and len(res.history) == 2  # the running loss is resumed too
    for (name, a), b in zip(full.own_state().items(), resumed.own_state().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_corrupted_checkpoint_is_a_clear_error(tiny_pipe, data, tmp_path):
    (tmp_path / CHECKPOINT).write_bytes(b"\x80\x04 not a checkpoint")
    with pytest.raises(SpecdraftError, match="corrupted checkpoint"):
        train_offline(_model(tiny_pipe), data, None, TrainConfig(**CFG), tmp_path, progress=False)


def test_checkpoint_from_other_settings_is_refused(tiny_pipe, data, tmp_path):
    train_offline(_model(tiny_pipe), data, None, TrainConfig(**{**CFG, "steps": 2}), tmp_path, progress=False)
    with pytest.raises(SpecdraftError, match="other settings"):
        train_offline(
            _model(tiny_pipe), data, None, TrainConfig(**{**CFG, "lr": 1e-4}), tmp_path, progress=False
        )


def test_replay_keeps_each_block_up_to_the_first_rejection(tiny_pipe):
    from specdraft.design.train import collect_replay

    model = _model(tiny_pipe, head_subset(128))
    prompts = random_prompts([5, 8], seed=2)
    rep = collect_replay(model, tiny_pipe.runtime, prompts, k=3, max_new_tokens=10, eos_ids=())
    for s, p in enumerate(prompts):  # the decoded text is the target's greedy answer
        assert rep.data.tokens[s][len(p) :].tolist() == plain_greedy(tiny_pipe.runtime, p, 10)
    assert rep.drafted > 0 and all(0 <= pos < 3 for _, _, pos, _, _ in rep.items)
    # the recorded top-1 at each kept position is the target's token there
    for s, index, _, idx, _ in rep.items:
        assert int(idx[0]) == int(rep.data.tokens[s][index + 1])


def test_on_policy_rounds_train_and_resume(tiny_pipe, tmp_path):
    from specdraft.design.train import OnPolicyConfig, train_on_policy

    prompts = random_prompts([5, 8, 6, 7, 9, 4], seed=4)
    cfg = OnPolicyConfig(rounds=3, prompts_per_round=2, k=3, max_new_tokens=8, updates_per_round=2, lr=1e-3)
    a = _model(tiny_pipe)
    res = train_on_policy(a, tiny_pipe.runtime, prompts, cfg, tmp_path / "a", progress=False)
    assert res.steps == 3 and all(h["positions"] > 0 and h["loss"] == h["loss"] for h in res.history)
    b = _model(tiny_pipe)
    train_on_policy(b, tiny_pipe.runtime, prompts, cfg, tmp_path / "b", progress=False, stop_after=2)
    b = _model(tiny_pipe)
    res_b = train_on_policy(b, tiny_pipe.runtime, prompts, cfg, tmp_path / "b", progress=False)
    assert res_b.resumed_from == 2
    for (name, x), y in zip(a.own_state().items(), b.own_state().values()):
        torch.testing.assert_close(x, y, msg=name)
