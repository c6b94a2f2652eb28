"""Training a DREAM-style draft: the entropy-adaptive choice of the intermediate target, the loss
terms, and ``specdraft design build --kind dream`` end to end on the tiny target."""

import copy
import json

import pytest
import torch

from specdraft.cli import main
from specdraft.design.dream import (
    DreamDraftLM,
    attention_entropy,
    candidate_layers,
    default_layers,
    entropy_select,
    target_features,
)
from specdraft.design.prune import depth_prune
from specdraft.design.train import TrainConfig, train_offline
from specdraft.errors import SpecdraftError
from tests.helpers import TINY_BUILD, random_prompts, target_answers


def _uniform(S):  # causal attention spread evenly over the visible keys: the highest entropy
    a = torch.tril(torch.ones(S, S))
    return (a / a.sum(-1, keepdim=True)).expand(1, 2, S, S)


def _one_hot(S, key=0):  # every query on one key: entropy 0
    a = torch.zeros(1, 2, S, S)
    a[..., key] = 1.0
    return a


def test_entropy_selection_picks_the_most_concentrated_layer():
    S = 6
    assert torch.allclose(attention_entropy(_one_hot(S)), torch.zeros(1, S))
    assert torch.allclose(attention_entropy(_uniform(S))[0], torch.log(torch.arange(1.0, S + 1)))
    # layer 3 is concentrated on the first half of the positions, layer 5 on the second half
    half = torch.cat([_one_hot(S)[..., :3, :], _uniform(S)[..., 3:, :]], dim=2)
    other = torch.cat([_uniform(S)[..., :3, :], _one_hot(S)[..., 3:, :]], dim=2)
    ent = {2: attention_entropy(_uniform(S)), 3: attention_entropy(half), 5: attention_entropy(other)}
    pick = entropy_select(ent)[0].tolist()
    assert pick[1:3] == [3, 3] and pick[3:] == [5, 5, 5]  # (position 0 sees one key everywhere: a tie)


def test_candidate_and_default_layers():
    assert candidate_layers(32, 0.4) == list(range(1, 11))  # DREAM's range for a 32-layer target
    assert candidate_layers(2, 0.4) == [1]
    assert default_layers(30) == [7, 14, 21]
    assert max(default_layers(2)) <= 0


def test_target_features_are_the_layers_and_the_selected_inputs(tiny_pipe):
    target = tiny_pipe.target.model
    ids = torch.tensor([random_prompts([9], seed=3)[0]])
    memory, mid = target_features(target, ids, [0], 0.4)
    hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.allclose(memory[:, :, 0], hs[1], atol=1e-5)  # layer 0's output
    assert torch.allclose(mid, hs[1], atol=1e-5)  # a 2-layer target has one candidate: layer 1's input
    assert target.config._attn_implementation == "sdpa"  # restored


def test_a_bf16_target_runs_its_feature_pass_in_fp32_where_bf16_is_emulated(tiny_pipe, monkeypatch):
    """Without native bf16 the draft's feature pass runs an fp32 copy (the runtime's arithmetic);
    the caller's model stays as it was. Elsewhere the target itself runs."""
    from specdraft.models import llama

    target = copy.deepcopy(tiny_pipe.target.model).to(torch.bfloat16)
    draft = depth_prune(tiny_pipe.target.model, [0])
    monkeypatch.setattr(llama, "bf16_compute_dtype", lambda: torch.float32)
    copied = DreamDraftLM(draft, None, target)._target[0]
    assert copied.dtype == torch.float32 and target.dtype == torch.bfloat16
    w = target.model.layers[0].mlp.up_proj.weight
    assert torch.equal(copied.model.layers[0].mlp.up_proj.weight, w.float())  # widened exactly
    monkeypatch.setattr(llama, "bf16_compute_dtype", lambda: torch.bfloat16)
    assert DreamDraftLM(draft, None, target)._target[0] is target


def test_loss_terms_decrease_on_a_tiny_model(tiny_pipe):
    data = target_answers(tiny_pipe, random_prompts([5, 8, 6], seed=4), max_new_tokens=12)
    torch.manual_seed(0)
    model = DreamDraftLM(depth_prune(tiny_pipe.target.model, [1]), None, tiny_pipe.target.model, noise=0.0)
    batch = model.make_batch(data, [0, 1, 2], 32)
    opt = torch.optim.AdamW(model.trainable(), lr=3e-3)
    cfg = TrainConfig(steps=1)
    first, _ = model.loss(batch, cfg)
    parts0 = model.loss(batch, cfg)[1]
    for _ in range(20):
        loss, parts = model.loss(batch, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.95 * float(first.detach())
    assert parts["soft_ce"] < parts0["soft_ce"] and parts["reg"] < parts0["reg"]
    assert {"soft_ce", "reg", "mid"} <= set(parts)


def test_a_killed_run_resumes_exactly(tiny_pipe, tmp_path):
    data = target_answers(tiny_pipe, random_prompts([5, 8, 6, 7], seed=6), max_new_tokens=10)
    cfg = TrainConfig(steps=4, batch_size=2, max_len=24, lr=3e-3, warmup=1, checkpoint_every=1, eval_every=0)

    def fresh():
        torch.manual_seed(0)
        return DreamDraftLM(depth_prune(tiny_pipe.target.model, [1]), None, tiny_pipe.target.model)

    whole = fresh()
    train_offline(whole, data, None, cfg, tmp_path / "a", progress=False)
    killed = fresh()
    train_offline(killed, data, None, cfg, tmp_path / "b", progress=False, stop_after=2)
    resumed = fresh()
    res = train_offline(resumed, data, None, cfg, tmp_path / "b", progress=False)
    assert res.resumed_from == 2
    for k, v in whole.own_state().items():
        assert torch.allclose(v, resumed.own_state()[k], atol=1e-6), k
    assert not torch.equal(whole.cross["o"], torch.zeros_like(whole.cross["o"]))  # the block trained


def test_bad_layers_are_refused(tiny_pipe):
    with pytest.raises(SpecdraftError, match="layers must lie"):
        DreamDraftLM(depth_prune(tiny_pipe.target.model, [1]), None, tiny_pipe.target.model, layers=[1])


def test_build_kind_dream_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "d"
    argv = [*TINY_BUILD, "--kind", "dream", "--layers", "1"]
    rc = main([*argv, "--head", "64", "--steps", "3", "--batch-size", "2", "--out", str(out)])
    assert rc == 0
    meta = json.loads((out / "specdraft.json").read_text())
    assert meta["kind"] == "dream" and meta["arch"] == {"layers": [0], "heads": 4}
    assert meta["recipe"]["offline"]["steps"] == 3
    spec = json.loads((out / "speculators_config.json").read_text())
    assert spec["speculators_model_type"] == "dream" and spec["aux_hidden_state_layer_ids"] == [1]
    assert spec["draft_vocab_size"] == len(meta["head_tokens"])
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1
    from safetensors.torch import load_file

    w = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "cross.q", "cross.o", "d2t", "t2d"} <= set(w)
    ids = torch.tensor(meta["head_tokens"])
    assert torch.equal(torch.arange(len(ids)) + w["d2t"], ids) and int(w["t2d"].sum()) == len(ids)
    gen = ["generate", "hello", "--target", "tiny", "--threads", "1", "--draft", f"designed:{out}"]
    assert main([*gen, "--max-new-tokens", "6", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(res["tokens"]) == 6 and res["stats"]["drafted"] > 0
    # export: the full form (embedding, tokenizer, speculators config) loads back by its kind, the same
    hf = tmp_path / "hf"
    assert main(["design", "export", str(out), "--target", "tiny", "--threads", "1", "--out", str(hf)]) == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(hf).config.num_hidden_layers == 1
    assert json.loads((hf / "speculators_config.json").read_text()) == spec
    capsys.readouterr()
    assert main([*gen[:-1], f"designed:{hf}", "--max-new-tokens", "6", "--json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["tokens"] == res["tokens"] and again["stats"]["accepted"] == res["stats"]["accepted"]


def test_build_dream_warm_started_from_a_feature_draft(tmp_path, monkeypatch, capsys):
    """``--init-from``: the DREAM draft takes the feature draft's layers, fc and head, and its
    cross-attention starts as the identity, so untrained (``--steps 0``) it drafts exactly as the
    feature draft does."""
    from safetensors.torch import load_file

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    base = [*TINY_BUILD, "--layers", "1", "--batch-size", "2"]
    feat, dream = tmp_path / "feat", tmp_path / "dream"
    assert main([*base, "--kind", "feature", "--head", "64", "--steps", "2", "--out", str(feat)]) == 0
    assert (
        main([*base, "--kind", "dream", "--init-from", str(feat), "--steps", "0", "--out", str(dream)]) == 0
    )
    a, b = load_file(str(feat / "model.safetensors")), load_file(str(dream / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not b["cross.o"].any()
    meta = json.loads((dream / "specdraft.json").read_text())
    assert (
        meta["kind"] == "dream"
        and meta["head_tokens"] == json.loads((feat / "specdraft.json").read_text())["head_tokens"]
    )
    capsys.readouterr()
    runs = []
    for d in (feat, dream):
        gen = ["generate", "hello", "--target", "tiny", "--threads", "1", "--draft", f"designed:{d}"]
        assert main([*gen, "--max-new-tokens", "8", "--k", "3", "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["stats"]["drafted"] > 0
    same = ("drafted", "accepted", "per_position_acceptance")
    assert [runs[0]["stats"][k] for k in same] == [runs[1]["stats"][k] for k in same]
