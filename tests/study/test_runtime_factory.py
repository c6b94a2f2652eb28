"""One factory builds every compact runtime from weights (specdraft.models.runtime.compact_runtime):
the study's profiling stand-in and the draft search run Gemma 3 layers for a Gemma 3 target."""

import torch

from specdraft.bench.profile import DraftLatencies
from specdraft.design.data import TargetData
from specdraft.design.search import agreement, search_layers
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.models.gemma3 import Gemma3Runtime, Gemma3Weights
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.runtime import compact_runtime
from specdraft.models.tiny import tiny_llama
from specdraft.study.latency import _stand_in
from tests.helpers import plain_greedy
from tests.models.test_gemma3 import tiny_gemma3


def gemma_weights() -> Gemma3Weights:
    return Gemma3Weights.from_hf(tiny_gemma3(), torch.float32)


def test_compact_runtime_picks_the_class_by_the_weights_family():
    g = compact_runtime(gemma_weights(), [0, 2])
    assert type(g) is Gemma3Runtime and g.layer_ids == [0, 2]
    assert type(compact_runtime(LlamaWeights.from_hf(tiny_llama(seed=0), torch.float32))) is LlamaRuntime


def test_profiling_stand_in_of_a_gemma_target_is_its_first_gemma_layer():
    rt = Gemma3Runtime(gemma_weights())
    stand_in = _stand_in(rt, PromptLookupDrafter())
    assert type(stand_in) is Gemma3Runtime and stand_in.layer_ids == [0]


def test_draft_search_scores_gemma_layer_subsets_with_gemma_layers():
    """The full layer set agrees with the target's own greedy answers everywhere (a Llama runtime
    over the same weights would not: it skips Gemma's norms and embedding scale)."""
    w = gemma_weights()
    target = Gemma3Runtime(w)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    seqs = [torch.tensor(p + plain_greedy(target, p, 8)) for p in prompts]
    calib = TargetData(tokens=seqs, prompt_lens=[len(p) for p in prompts])
    assert agreement(compact_runtime(w), calib) == 1.0
    assert agreement(LlamaRuntime(w), calib) < 1.0
    latency = DraftLatencies(draft={f"depth{d}": 1e-3 * d for d in (1, 2, 3)}, target={1: 0.01, 9: 0.02})
    cands = search_layers(w, calib, max_depth=3, beam=1, latency=latency, extra=[[0, 1, 3]])
    assert [0, 1, 3] in [c.layers for c in cands] and all(0 <= c.alpha <= 1 for c in cands)
