"""``design build --kind feature --second-weight W``: the feature draft also learns its second draft
position, which reads its own predicted feature (EAGLE-3's training-time test, one step deep). The
loss adds exactly that position's losses, with gradient through the draft's own feature; the weight
travels into the recipe; bad values are one line."""

import json

import pytest
import torch

from specdraft.cli import main
from specdraft.design.feature import FeatureDraftLM
from specdraft.design.prune import depth_prune
from specdraft.design.train import TrainConfig
from tests.helpers import TINY_BUILD, random_prompts, target_answers

BASE = [*TINY_BUILD, "--layers", "1", "--batch-size", "2", "--kind"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))


def test_the_loss_adds_the_second_positions_losses_through_the_drafts_own_feature(tiny_pipe):
    data = target_answers(tiny_pipe, random_prompts([4, 9, 6], seed=3), max_new_tokens=12, batch_size=3)
    torch.manual_seed(0)
    model = FeatureDraftLM(depth_prune(tiny_pipe.target.model, [0]), None, fc=torch.randn(64, 128) * 0.1)
    model.noise = 0.0  # the same input features in every call below
    batch, cfg = model.make_batch(data, [0, 1, 2], 40), TrainConfig()
    first, _ = model.loss(batch, cfg)
    model.second_weight = 0.5
    both, parts = model.loss(batch, cfg)
    full = model.features(batch.feats, batch.ids, batch.positions)
    h2 = model._second(batch, batch.feats, full)[batch.rows, batch.cols]
    later = batch.cols > 0
    assert "second_ce" in parts and not later.all() and later.any()
    kept = type(batch)(**{**batch.__dict__, "weight": batch.weight * later})
    second, _ = model._losses(h2, kept, cfg)
    assert torch.allclose(both, first + 0.5 * second)
    # the drafted feature is the draft's own prediction, and the gradient goes through it
    own = torch.autograd.grad(second, full, retain_graph=True)[0]
    assert own.abs().sum() > 0


def test_the_weight_is_recorded_and_bad_values_are_one_line(tmp_path, capsys):
    out = tmp_path / "f"
    assert main([*BASE, "feature", "--second-weight", "0.5", "--steps", "2", "--out", str(out)]) == 0
    meta = json.loads((out / "specdraft.json").read_text())
    assert meta["recipe"]["config"]["second_weight"] == 0.5
    assert "alpha_2" in meta["recipe"]["validation"]["trained"]
    assert "second draft position" in (out / "RECIPE.md").read_text()
    for bad in (["layers", "--second-weight", "1"], ["feature", "--second-weight", "-1"]):
        assert main([*BASE, *bad, "--steps", "0", "--out", str(tmp_path / "x")]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--second-weight" in err[0]
