"""The draft directory: compact and full forms, the target check, corrupted files, and the full
export used by plain transformers for assisted generation."""

import json

import pytest
import torch

from specdraft.design import artifact
from specdraft.design.artifact import DraftMeta, load_draft, read_meta, save_draft
from specdraft.design.prune import depth_prune
from specdraft.design.vocab import VocabSubset
from specdraft.errors import SpecdraftError
from specdraft.models.tiny import tiny_llama
from tests.helpers import head_subset


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


def _save(target, path, full=False):
    meta = DraftMeta.for_target(
        target, "tiny", head=VocabSubset(head_subset(64), 0.9), init_layers=[1], recipe={"command": "test"}
    )
    return save_draft(path, depth_prune(target, [1]), meta, full=full)


def test_compact_form_holds_only_the_drafts_own_tensors_and_round_trips(target, tmp_path):
    from safetensors.torch import load_file

    d = _save(target, tmp_path / "d")
    names = set(load_file(str(d / "model.safetensors")))
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"} <= names
    draft, meta, extra = load_draft(d, target)
    assert meta.init_layers == [1] and len(meta.head_tokens) == 64 and extra == {}
    assert draft.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.testing.assert_close(draft(ids).logits, depth_prune(target, [1])(ids).logits)


def test_loading_in_another_dtype_converts_the_draft_not_the_shared_target_tensors(tmp_path):
    target = tiny_llama(seed=0)
    d = _save(target, tmp_path / "d")
    draft, _, _ = load_draft(d, target, torch.bfloat16)
    assert draft.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert target.model.embed_tokens.weight.dtype == target.lm_head.weight.dtype == torch.float32
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight


def test_another_target_is_refused(target, tmp_path):
    d = _save(target, tmp_path / "d")
    with pytest.raises(SpecdraftError, match="embedding differs"):
        load_draft(d, tiny_llama(seed=7))
    with pytest.raises(SpecdraftError, match="vocabulary 256 and hidden size 64"):
        load_draft(d, tiny_llama(hidden_size=32, num_heads=2, num_kv_heads=1))


def test_corrupted_or_missing_files_are_clear_errors(target, tmp_path):
    d = _save(target, tmp_path / "d")
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:200])
    with pytest.raises(SpecdraftError, match="corrupted"):
        load_draft(d, target)
    (d / "specdraft.json").write_text("{not json")
    with pytest.raises(SpecdraftError, match="corrupted"):
        read_meta(d)
    with pytest.raises(SpecdraftError, match="not a designed draft"):
        read_meta(tmp_path)


def test_non_finite_weights_are_refused(target, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _save(target, tmp_path / "d")
    state = load_file(str(d / "model.safetensors"))
    state["model.norm.weight"][0] = float("nan")
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(SpecdraftError, match="non-finite"):
        load_draft(d, target)


def test_full_export_works_as_assistant_model_in_plain_transformers(target, tmp_path):
    from transformers import AutoModelForCausalLM

    d = _save(target, tmp_path / "full", full=True)
    assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 1
    assistant = AutoModelForCausalLM.from_pretrained(d)
    torch.testing.assert_close(assistant.model.embed_tokens.weight, target.model.embed_tokens.weight)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assisted = target.generate(
        ids, max_new_tokens=12, do_sample=False, assistant_model=assistant, pad_token_id=0
    )
    assert assisted.tolist() == plain.tolist()


def _files(d):
    return {f.name: f.read_bytes() for f in d.iterdir()}


def test_an_interrupted_overwrite_leaves_the_old_draft_whole(target, tmp_path, monkeypatch):
    """A kill while overwriting a draft must not leave old metadata beside new weights (or the reverse)."""
    import safetensors.torch

    d = _save(target, tmp_path / "d")
    old = _files(d)
    real = safetensors.torch.save_file

    def dies_after_writing(*a, **kw):
        real(*a, **kw)
        raise KeyboardInterrupt  # the kill lands after the weights, before the metadata

    monkeypatch.setattr(safetensors.torch, "save_file", dies_after_writing)
    meta = DraftMeta.for_target(target, "tiny", init_layers=[0, 1], recipe={"command": "second"})
    with pytest.raises(KeyboardInterrupt):
        save_draft(d, depth_prune(target, [0, 1]), meta)
    assert _files(d) == old
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # nothing left beside it
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    save_draft(
        d, depth_prune(target, [0, 1]), meta, add_files=lambda tmp: (tmp / "RECIPE.md").write_text("r")
    )
    new = _files(d)
    assert set(new) == {"config.json", "model.safetensors", "specdraft.json", "RECIPE.md"}
    assert all(new[f] != old[f] for f in old)
    assert read_meta(d).init_layers == [0, 1] and load_draft(d, target)[0].config.num_hidden_layers == 2
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_leftovers_of_a_killed_save_are_cleared_and_other_paths_refused(target, tmp_path):
    (tmp_path / ".d.new").mkdir()  # a save killed before its rename
    (tmp_path / ".d.new" / "config.json").write_text("{}")
    (tmp_path / ".d.old").mkdir()  # ... or between its two renames
    d = _save(target, tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and read_meta(d).init_layers == [1]
    (tmp_path / "e").mkdir()
    _save(target, tmp_path / "e")  # an empty directory is fine
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(SpecdraftError, match="not a draft directory"):
        _save(target, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_designed_auto_ranks_committed_drafts_by_the_measurements_listed(tmp_path):
    """designed:auto's ranking reads the bench JSONs the auto file lists: a draft's best row (any k)
    counts; rows of drafts not committed, or not designed, do not."""

    def row(speedup: float) -> dict:
        return {"all": {"speedup": speedup}}

    bench = {
        "drafters": {
            "designed:smollm2-135m-l2@1": row(0.9),
            "designed:smollm2-135m-l2@auto": row(1.05),
            "designed:smollm2-135m-feature": row(1.02),
            "designed:/elsewhere/not-committed@1": row(3.0),
            "lookup@auto": row(2.0),
        }
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "auto.json").write_text(json.dumps({"measurements": ["bench.json"]}))
    assert artifact.measured_speedups(tmp_path / "auto.json") == {
        "smollm2-135m-l2": 1.05,
        "smollm2-135m-feature": 1.02,
    }
    assert artifact.measured_speedups(tmp_path / "none.json") == {}
