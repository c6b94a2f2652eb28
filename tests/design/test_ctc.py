"""Training a CTC draft: the anchors' labels and features, the loss terms, and ``specdraft design
build --kind ctc`` end to end on the tiny target."""

import json

import pytest
import torch

from specdraft.cli import main
from specdraft.design.ctc import CTCDraftLM, _walk, tree_report
from specdraft.design.prune import depth_prune
from specdraft.design.train import TrainConfig
from specdraft.errors import SpecdraftError
from specdraft.tree import TokenTree
from tests.helpers import TINY_BUILD, head_subset, random_prompts, target_answers


@pytest.fixture(scope="module")
def data(tiny_pipe):
    return target_answers(tiny_pipe, random_prompts([5, 8, 6], seed=2), max_new_tokens=12, batch_size=3)


def test_anchors_carry_the_next_feature_and_the_next_tokens(tiny_pipe, data):
    head = head_subset(200, must=tuple(t for s in data.tokens for t in s.tolist()))
    model = CTCDraftLM(depth_prune(tiny_pipe.target.model, [1]), head, slots=4, labels=3, anchors=5)
    torch.manual_seed(0)
    batch = model.make_batch(data, [0, 2], 64)
    assert torch.bincount(batch.anchor_rows, minlength=2).tolist() == [5, 5]
    for r, j, a, f, lab in zip(
        batch.anchor_rows, batch.anchor_cols, batch.anchor_block, batch.anchor_feat, batch.anchor_labels
    ):
        i = [0, 2][int(r)]
        P = data.prompt_lens[i]
        assert torch.equal(f, data.hidden[i][j + 1].float())
        assert torch.equal(model.head_tokens[lab], data.tokens[i][P + 1 + j : P + 4 + j])
        assert int(j) + 1 + 3 <= data.tokens[i].shape[0] - P  # n labels exist
    assert batch.anchor_block.tolist() == [0, 1, 2, 3, 4] * 2
    # labels outside the head subset: no anchor uses them
    said = {t for s in data.tokens for t in s.tolist()}
    other = torch.tensor([t for t in range(256) if t not in said][:8])
    small = CTCDraftLM(depth_prune(tiny_pipe.target.model, [1]), other, slots=4, labels=3)
    assert small.make_batch(data, [0, 1, 2], 64).anchor_rows.numel() == 0
    with pytest.raises(SpecdraftError, match="labels <= slots"):
        CTCDraftLM(depth_prune(tiny_pipe.target.model, [1]), None, slots=2, labels=3)


def test_loss_has_the_three_terms_and_the_ctc_term_trains_the_slots(tiny_pipe, data):
    torch.manual_seed(0)
    model = CTCDraftLM(depth_prune(tiny_pipe.target.model, [1]), None, slots=4, labels=2)
    batch = model.make_batch(data, [0, 1, 2], 64)
    loss, parts = model.loss(batch, TrainConfig())
    assert set(parts) >= {"soft_ce", "reg", "ctc"} and parts["ctc"] > 0
    loss.backward()
    assert model.ctc["slots"].grad.abs().sum() > 0 and model.ctc["blank_w"].grad.abs().sum() > 0
    # a sure alignment of the labels costs nothing: the CTC loss is the labels' log-likelihood
    hs = torch.zeros(1, 4, 64)
    lp = torch.full((1, 4, 257), -50.0)
    lp[0, [0, 1, 2, 3], [7, 256, 9, 9]] = 0.0  # 7, blank, 9, 9 -> [7, 9]
    model.slot_logprobs = lambda h: lp
    assert float(model.ctc_loss(hs, torch.tensor([[7, 9]]))) < 1e-3
    assert float(model.ctc_loss(hs, torch.tensor([[9, 7]]))) > 10


def test_tree_report_walks_the_candidate_trees_along_the_labels(tiny_pipe, data):
    tree = TokenTree.from_chains([[4, 5, 6], [4, 7], [8]])
    assert _walk(tree, [4, 5, 6]) == 3 and _walk(tree, [4, 7, 1]) == 2 and _walk(tree, [8, 8]) == 1
    assert _walk(tree, [5, 4]) == 0 and _walk(None, [4]) == 0
    torch.manual_seed(0)
    model = CTCDraftLM(depth_prune(tiny_pipe.target.model, [1]), None, slots=4, labels=2)
    rep = tree_report(model, data, budget=6)
    anchors = sum(
        max(0, min(len(h) - 2, len(t) - p - 1 - 2) + 1)
        for h, t, p in zip(data.hidden, data.tokens, data.prompt_lens)
    )
    assert rep["anchors"] == anchors and model.anchors == 16  # every anchor, then the training setting again
    assert 0 <= rep["first_token"] <= 1 and 0 <= rep["accepted_per_tree"] <= 2


def test_build_kind_ctc_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "d"
    argv = [*TINY_BUILD, "--kind", "ctc", "--layers", "1"]
    assert main([*argv, "--head", "64", "--steps", "2", "--batch-size", "2", "--out", str(out)]) == 0
    meta = json.loads((out / "specdraft.json").read_text())
    assert meta["kind"] == "ctc" and meta["arch"] == {"slots": 6, "labels": 3}
    assert meta["recipe"]["offline"]["steps"] == 2
    assert set(meta["recipe"]["validation"]["trained"]["trees"]) == {
        "anchors",
        "first_token",
        "accepted_per_tree",
    }
    from safetensors.torch import load_file

    assert {"fc.weight", "ctc.slots", "ctc.blank_w", "ctc.blank_b"} <= set(
        load_file(str(out / "model.safetensors"))
    )
    gen = ["generate", "hello", "--target", "tiny", "--threads", "1", "--draft", f"designed:{out}"]
    assert main([*gen, "--max-new-tokens", "6", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(res["tokens"]) == 6


def test_build_ctc_warm_started_from_a_feature_draft(tmp_path, monkeypatch, capsys):
    """``--init-from``: the CTC draft takes the feature draft's layers, fc and head (untrained here:
    ``--steps 0`` keeps them as they were); anything but a feature draft is refused in one line."""
    from safetensors.torch import load_file

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    base = [*TINY_BUILD, "--layers", "1", "--batch-size", "2"]
    feat, ctc = tmp_path / "feat", tmp_path / "ctc"
    assert main([*base, "--kind", "feature", "--head", "64", "--steps", "2", "--out", str(feat)]) == 0
    assert main([*base, "--kind", "ctc", "--init-from", str(feat), "--steps", "0", "--out", str(ctc)]) == 0
    a, b = load_file(str(feat / "model.safetensors")), load_file(str(ctc / "model.safetensors"))
    assert {k for k in b if not k.startswith("ctc.")} == set(a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = [json.loads((d / "specdraft.json").read_text()) for d in (feat, ctc)]
    assert meta[1]["head_tokens"] == meta[0]["head_tokens"] and meta[1]["kind"] == "ctc"
    trained = tmp_path / "trained"  # and it trains from there
    assert (
        main([*base, "--kind", "ctc", "--init-from", str(feat), "--steps", "2", "--out", str(trained)]) == 0
    )
    c = load_file(str(trained / "model.safetensors"))
    assert not torch.equal(c["fc.weight"], a["fc.weight"])
    assert not torch.equal(c["model.layers.0.mlp.up_proj.weight"], a["model.layers.0.mlp.up_proj.weight"])
    capsys.readouterr()
    assert (
        main([*base, "--kind", "ctc", "--init-from", str(ctc), "--steps", "0", "--out", str(tmp_path / "x")])
        != 0
    )
    assert "not a feature draft" in capsys.readouterr().err
