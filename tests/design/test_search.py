"""The layer search and the depth/width comparison on the tiny target (2 layers, vocab 256): with a
fixed latency table the choice is the analytic model's, not the machine's."""

import pytest
import torch

from specdraft import analytic
from specdraft.bench.profile import DraftLatencies
from specdraft.design.compare import compare_depth_width, spread
from specdraft.design.data import generate_target_data
from specdraft.design.search import agreement, search_layers
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime
from tests.helpers import random_prompts

# T_target(n) measured at n = 1, 2, 4, 8 (n = 9 is read flat: 17 ms), T_draft by depth
LATENCY = DraftLatencies(
    draft={"depth1": 0.002, "depth2": 0.004}, target={1: 0.010, 2: 0.011, 4: 0.013, 8: 0.017}
)


@pytest.fixture(scope="module")
def calib(tiny_pipe):
    prompts = random_prompts([5, 8, 6, 9], seed=3)
    return generate_target_data(
        tiny_pipe.runtime, prompts, eos_ids=(), max_new_tokens=12, batch_size=4, topk=4, progress=False
    )


def test_agreement_is_teacher_forced_greedy_acceptance(tiny_pipe, calib):
    w = tiny_pipe.runtime.w
    assert agreement(LlamaRuntime(w), calib) == 1.0  # the target agrees with its own answers
    one = agreement(LlamaRuntime(w, [0]), calib)
    assert 0.0 <= one < 1.0
    # restricted to a head that holds every answer token, nothing changes
    answers = sorted({int(t) for toks, p in zip(calib.tokens, calib.prompt_lens) for t in toks[p:]})
    assert agreement(LlamaRuntime(w), calib, head=torch.tensor(answers)) == 1.0


def test_search_layers_ranks_subsets_by_the_analytic_model(tiny_pipe, calib):
    w = tiny_pipe.runtime.w
    lines = []
    cands = search_layers(w, calib, max_depth=2, beam=1, k_max=8, latency=LATENCY, log=lines.append)
    assert sorted(tuple(c.layers) for c in cands) == [(0,), (0, 1), (1,)] and len(lines) == 3
    assert [c.tokens_per_s for c in cands] == sorted((c.tokens_per_s for c in cands), reverse=True)
    t_target = LATENCY.curve().time
    for c in cands:
        t_draft = LATENCY.draft[f"depth{len(c.layers)}"]
        assert c.alpha == agreement(LlamaRuntime(w, c.layers), calib) and c.t_draft == t_draft
        assert c.k == analytic.best_k(c.alpha, t_draft, t_target, 8)
        assert c.speedup == pytest.approx(analytic.speedup(c.alpha, c.k, t_draft, t_target))
    full = next(c for c in cands if c.layers == [0, 1])
    # every token accepted: k = 8, 9 tokens per 8 draft steps and a target forward over 9 (flat: 17 ms)
    assert full.alpha == 1.0 and full.k == 8 and full.mean_accepted_length == 9.0
    assert full.speedup == pytest.approx(9 / (8 * 0.004 + 0.017) * 0.010)
    assert cands[0] == full  # the target as its own draft wins here
    # beam 0: only the extra subsets (by default the first d - 1 layers plus the last)
    only = search_layers(w, calib, max_depth=2, beam=0, latency=LATENCY)
    assert [c.layers for c in only] == [[0, 1]] and only[0].as_dict()["speedup"] == round(full.speedup, 6)


def test_search_layers_measures_latency_when_none_is_given(tiny_pipe, calib):
    cands = search_layers(tiny_pipe.runtime.w, calib, max_depth=1, beam=0, extra=[[1]])
    c = cands[0]
    assert c.layers == [1] and c.t_draft > 0 and 0 <= c.k <= 8 and c.tokens_per_s > 0 and c.speedup > 0


def test_compare_depth_width_rows(tiny_pipe, tmp_path):
    rows = compare_depth_width(
        tiny_pipe,
        budget_layers=1,
        deep=(2,),
        val_prompts=3,
        progress=False,
        data_kw={"max_new_tokens": 6, "batch_size": 3, "sources": ("gsm8k",), "cache": tmp_path},
    )
    assert [r["name"] for r in rows] == ["shallow-wide 1L", "deep-narrow 2L"]
    wide, deep = rows
    assert wide["depth"] == 1 and wide["layers"] == [0] and deep["layers"] == spread(2, 2) == [0, 1]
    assert deep["params"] <= wide["params"] * 1.1  # narrowed to the shallow draft's budget
    assert deep["kv_heads"] <= wide["kv_heads"] and deep["ffn"] < wide["ffn"]
    for r in rows:
        assert (
            0.0 <= r["alpha"] <= 1.0
            and r["t_draft_ms"] > 0
            and 0 <= r["k"] <= 8
            and r["predicted_speedup"] > 0
        )
        assert sorted(r["t_target_ms"]) == [1, 2, 4, 6, 8]
        # the prediction reads the measured table flat beyond n = 8 (figures rounded to microseconds)
        t_target = analytic.LatencyCurve(
            {1: {n: ms / 1e3 for n, ms in r["t_target_ms"].items()}}, beyond="flat"
        ).time
        speedup = analytic.speedup(r["alpha"], r["k"], r["t_draft_ms"] / 1e3, t_target)
        assert r["predicted_speedup"] == pytest.approx(speedup, rel=0.05)


def test_bad_latency_table_sizes_are_refused(tiny_pipe):
    from specdraft.bench.profile import measure_latency

    with pytest.raises(SpecdraftError, match="exceeds the target's window"):
        measure_latency(tiny_pipe.runtime, {}, ns=(1, 4), context=tiny_pipe.runtime.max_context)
