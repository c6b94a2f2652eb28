"""Pruning: a depth-pruned draft computes what the target's layer subset computes; width pruning
at full width is depth pruning; parameter budgets for the depth-vs-width comparison."""

import pytest
import torch

from specdraft.design.prune import depth_prune, ffn_for_budget, importance, param_count, width_prune
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.tiny import tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, num_layers=3, num_heads=4, num_kv_heads=2)


def test_depth_pruned_draft_equals_the_layer_subset_runtime(target):
    ids = torch.tensor([[7, 3, 9, 1, 2]])
    draft = depth_prune(target, [0, 2])
    rt = LlamaRuntime(LlamaWeights.from_hf(target, torch.float32), [0, 2])
    ref = rt.forward(rt.new_state(1, 8), ids, torch.arange(5).unsqueeze(0)).logits
    torch.testing.assert_close(draft(ids).logits, ref, rtol=1e-4, atol=1e-4)
    assert param_count(draft) == 2 * sum(p.numel() for p in target.model.layers[0].parameters()) + 64


def test_width_prune_at_full_width_is_depth_prune(target):
    calib = [torch.randint(0, 254, (20,), generator=torch.Generator().manual_seed(1))]
    scores = importance(target, calib, [1])
    assert scores.heads[1].shape == (4,) and (scores.heads[1] > 0).all() and scores.ffn[1].shape == (128,)
    full = width_prune(target, [1], scores, kv_heads=2, q_per_kv=2, ffn=128)
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(full(ids).logits, depth_prune(target, [1])(ids).logits, rtol=1e-4, atol=1e-4)


def test_narrow_draft_keeps_the_most_important_parts(target):
    calib = [torch.randint(0, 254, (30,), generator=torch.Generator().manual_seed(2))]
    scores = importance(target, calib, [0, 1])
    narrow = width_prune(target, [0, 1], scores, kv_heads=1, q_per_kv=1, ffn=32)
    cfg = narrow.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (1, 1, 32)
    top = scores.ffn[0].topk(32).indices.sort().values
    torch.testing.assert_close(
        narrow.model.layers[0].mlp.gate_proj.weight, target.model.layers[0].mlp.gate_proj.weight[top]
    )
    assert narrow(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 256)


def test_budget_gives_an_ffn_width_of_equal_parameter_count(target):
    budget = param_count(depth_prune(target, [0]))
    ffn = ffn_for_budget(target, 2, budget, kv_heads=1, q_per_kv=2)
    calib = [torch.arange(10)]
    narrow = width_prune(target, [0, 1], importance(target, calib, [0, 1]), kv_heads=1, q_per_kv=2, ffn=ffn)
    assert abs(param_count(narrow) - budget) <= 3 * 64 * 2


def test_bad_layers_and_widths_are_clear_errors(target):
    with pytest.raises(SpecdraftError, match="layer ids"):
        depth_prune(target, [0, 3])
    with pytest.raises(SpecdraftError, match="layer ids"):
        depth_prune(target, [1, 1])
    scores = importance(target, [torch.arange(5)], [0])
    with pytest.raises(SpecdraftError, match="kv_heads"):
        width_prune(target, [0], scores, kv_heads=3, q_per_kv=1, ffn=8)
