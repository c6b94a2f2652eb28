"""Training a block-diffusion draft: the labels and weights of a block batch, the teacher-forced
acceptance the length head learns, resume, and ``design build --kind diffusion`` end to end."""

import json

import pytest
import torch

from specdraft.cli import main
from specdraft.design.diffusion import DiffusionDraftLM, accepted_fraction
from specdraft.design.prune import depth_prune
from specdraft.design.train import TrainConfig, train_offline
from specdraft.drafters.diffusion import BlockArch
from specdraft.errors import SpecdraftError
from tests.helpers import TINY_BUILD, random_prompts, target_answers

ARCH = BlockArch(block=5, window=3)


@pytest.fixture(scope="module")
def data(tiny_pipe):
    return target_answers(tiny_pipe, random_prompts([5, 8, 6, 7], seed=6), max_new_tokens=10)


def _fresh(tiny_pipe):
    torch.manual_seed(0)
    return DiffusionDraftLM(depth_prune(tiny_pipe.target.model, [1]), None, ARCH, anchors=4)


def test_block_batch_labels_the_next_tokens_with_decaying_weights(tiny_pipe, data):
    model = _fresh(tiny_pipe).eval()
    batch = model.make_batch(data, [0], 0)
    P, tokens = data.prompt_lens[0], data.tokens[0]
    for a in range(batch.anchor.shape[0]):
        t = int(batch.L[a]) - 1  # the anchor's position
        assert int(batch.anchor[a]) == int(tokens[t])
        cols = batch.cols[batch.rows == a]
        assert torch.equal(batch.target[batch.rows == a], tokens[t + cols])  # full head: ids are rows
        n = int(batch.valid[a].sum())  # features at positions t-n .. t-1, never inside the prompt
        assert n == min(ARCH.window, t - P + 1)
        assert torch.equal(batch.feats[a, -n:], data.hidden[0][t - P + 1 - n : t - P + 1])
    assert torch.allclose(batch.weight, torch.exp(-(batch.cols - 1).float() / 7.0))


def test_accepted_fraction_is_the_leading_run_of_hits(tiny_pipe, data):
    batch = _fresh(tiny_pipe).eval().make_batch(data, [1], 0)
    pred = batch.target.clone()
    first = batch.rows == 0
    pred[first.nonzero()[1, 0]] = -5  # anchor 0: position 2 wrong -> 1 accepted
    a = accepted_fraction(pred, batch, ARCH.block)
    assert a[0] == pytest.approx(2 / ARCH.block)
    assert a[1] == pytest.approx(min(5, int((batch.rows == 1).sum()) + 1) / ARCH.block)


def test_a_killed_run_resumes_exactly(tiny_pipe, data, tmp_path):
    cfg = TrainConfig(steps=6, batch_size=2, lr=3e-3, warmup=1, checkpoint_every=1, eval_every=0)
    whole = _fresh(tiny_pipe)
    res = train_offline(whole, data, data, cfg, tmp_path / "a", progress=False)
    killed = _fresh(tiny_pipe)
    train_offline(killed, data, None, cfg, tmp_path / "b", progress=False, stop_after=3)
    resumed = _fresh(tiny_pipe)
    again = train_offline(resumed, data, None, cfg, tmp_path / "b", progress=False)
    assert again.resumed_from == 3
    for k, v in whole.own_state().items():
        assert torch.allclose(v, resumed.own_state()[k], atol=1e-6), k
    assert {"ce", "kl", "rkl", "len_mse"} <= set(res.history[-1])
    with pytest.raises(SpecdraftError, match="not a block-diffusion draft"):
        _fresh(tiny_pipe).load_own_state({k: v for k, v in whole.own_state().items() if k != "diffusion.fc"})


def test_build_kind_diffusion_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "d"
    argv = [*TINY_BUILD, "--kind", "diffusion"]
    rc = main([*argv, "--layers", "1", "--head", "64", "--block", "4", "--steps", "2", "--out", str(out)])
    assert rc == 0
    meta = json.loads((out / "specdraft.json").read_text())
    assert meta["kind"] == "diffusion" and meta["arch"] == {"block": 4, "window": 8}
    assert meta["recipe"]["offline"]["steps"] == 2
    assert "tokens_per_block" in meta["recipe"]["validation"]["trained"]["blocks"]
    from safetensors.torch import load_file

    assert {"diffusion.fc", "diffusion.mask", "diffusion.len2.bias"} <= set(
        load_file(str(out / "model.safetensors"))
    )
    gen = ["generate", "hello", "--target", "tiny", "--threads", "1", "--draft", f"designed:{out}"]
    assert main([*gen, "--max-new-tokens", "6", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plain = ["generate", "hello", "--target", "tiny", "--threads", "1", "--draft", "none"]
    assert main([*plain, "--max-new-tokens", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == res["tokens"]
    assert res["stats"]["drafted"] > 0
    # the alias, with the length head ignored (a fixed block length): the same tokens
    assert main([*gen[:-1], f"diffusion:{out},fixed", "--max-new-tokens", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == res["tokens"]


@pytest.mark.parametrize("spec", ["diffusion:", "diffusion:auto", "diffusion:x,wide"])
def test_bad_diffusion_spec_is_refused_before_loading(spec):
    from specdraft.registry import DraftSpec

    with pytest.raises(SpecdraftError, match="use diffusion:NAME"):
        DraftSpec.parse(spec)
