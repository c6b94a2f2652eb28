"""Designed drafts for a Gemma 3 target (issue 20): pruning keeps the family and each layer's kind
(sliding-window or global), width pruning copies Gemma's extra norms, and a saved draft loads as a
Gemma draft on the compact Gemma runtime that speculates losslessly with a head subset."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft import registry
from specdraft.design.artifact import DraftMeta, load_draft, save_draft
from specdraft.design.prune import depth_prune, importance, width_prune
from specdraft.design.vocab import VocabSubset
from specdraft.engine import Engine
from specdraft.models.gemma3 import Gemma3Runtime, Gemma3Weights
from specdraft.policy import FixedK, VerifyCost
from tests.helpers import decode, plain_greedy, random_prompts
from tests.models.test_gemma3 import tiny_gemma3


@pytest.fixture(scope="module")
def target():
    return tiny_gemma3()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_depth_pruned_gemma_draft_keeps_its_layers_kinds_and_computes_the_subset(target):
    draft = depth_prune(target, [0, 2])
    assert draft.config.model_type == "gemma3_text"
    assert draft.config.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.tensor([[7, 3, 9, 1, 2, 8, 8, 5, 4, 6]])  # longer than the window (6)
    rt = Gemma3Runtime(Gemma3Weights.from_hf(target, torch.float32), [0, 2])
    ref = rt.forward(rt.new_state(1, 16), ids, torch.arange(10).unsqueeze(0)).logits
    torch.testing.assert_close(_logits(draft, ids), ref, rtol=1e-4, atol=1e-4)


def test_width_prune_at_full_width_is_depth_prune_with_every_norm(target):
    calib = [torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))]
    scores = importance(target, calib, [1, 2])
    full = width_prune(target, [1, 2], scores, kv_heads=2, q_per_kv=2, ffn=96)
    ids = torch.tensor([[5, 6, 7, 1, 2, 3, 4, 9]])
    torch.testing.assert_close(
        _logits(full, ids), _logits(depth_prune(target, [1, 2]), ids), rtol=1e-4, atol=1e-4
    )
    narrow = width_prune(target, [2], scores, kv_heads=1, q_per_kv=1, ffn=32)
    layer, src = narrow.model.layers[0], target.model.layers[2]
    for name in ("q_norm", "k_norm"):
        torch.testing.assert_close(getattr(layer.self_attn, name).weight, getattr(src.self_attn, name).weight)
    torch.testing.assert_close(layer.post_feedforward_layernorm.weight, src.post_feedforward_layernorm.weight)
    assert narrow.config.layer_types == ["full_attention"] and narrow.config.num_attention_heads == 1


def test_saved_gemma_draft_loads_and_speculates_losslessly_with_a_head_subset(target, tmp_path):
    calib = [torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3))]
    draft = width_prune(target, [0], importance(target, calib, [0]), kv_heads=2, q_per_kv=1, ffn=48)
    head = torch.arange(2, 66)  # 64 of the 96 ids
    meta = DraftMeta.for_target(target, "tiny-gemma", head=VocabSubset(head, 0.9), init_layers=[0], recipe={})
    save_draft(tmp_path / "d", draft, meta)
    loaded, _, _ = load_draft(tmp_path / "d", target)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    torch.testing.assert_close(_logits(loaded, ids), _logits(draft, ids))
    rt = Gemma3Runtime(Gemma3Weights.from_hf(target, torch.float32))
    t = registry.Target(SimpleNamespace(model=target), rt, torch.float32)
    drafter = registry.build_drafter(f"designed:{tmp_path / 'd'}", t)
    assert isinstance(drafter.runtime.runtime, Gemma3Runtime) and drafter.runtime.runtime.vocab_size == 64
    drafter.cost = VerifyCost([1.0] * 9, 0.0)  # free verification: every proposal goes to the target
    prompts = random_prompts([5, 9], vocab=96, seed=7)
    engine = Engine(rt, drafter, FixedK(3))
    assert decode(engine, prompts, 12) == [plain_greedy(rt, p, 12) for p in prompts]
    assert engine.stats.drafted > 0


def test_a_target_loaded_from_its_files_loads_its_model_for_a_designed_draft(target, tmp_path):
    """A Gemma 3 target with no drafter runs from its weight files alone (no transformers model);
    a designed draft built on it later loads the model then (it shares the embedding)."""
    from specdraft import api
    from specdraft.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_gemma3(vocab=len(tok))
    model.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    meta = DraftMeta.for_target(model, "tiny-gemma", init_layers=[0], recipe={})
    save_draft(tmp_path / "d", depth_prune(model, [0]), meta)
    pipe = api.load(str(tmp_path / "t"), "none", dtype="fp32", runtime="compact", threads=1)
    assert pipe.target.model is None
    drafter = api.make_drafter(f"designed:{tmp_path / 'd'}", pipe.target, pipe.runtime, torch.float32)
    assert pipe.target.model is not None and isinstance(drafter.runtime, Gemma3Runtime)
