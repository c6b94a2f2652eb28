"""The study's latency tables: profiles at several contexts, read between them (specdraft.study.latency)."""

import json

import pytest
import torch

from specdraft import api
from specdraft.study.latency import Latencies, draft_kind, draft_shape, measure_draft, measure_target


@pytest.fixture(scope="module")
def prune_pipe():
    return api.load("tiny", "prune:0", dtype="fp32", draft_dtype="fp32")


def test_measure_target_and_draft_then_read_between_contexts(prune_pipe):
    rt = prune_pipe.runtime
    target = measure_target(
        rt, batch_sizes=(1, 2), k_max=2, contexts=(16, 32), repeats=1, warmup=0, name="tiny"
    )
    assert sorted(target) == [16, 32]
    for c, prof in target.items():
        assert prof.context == c and prof.target == "tiny" and prof.draft == "none"
        assert set(prof.t_target) == {1, 2} and all(set(row) == {1, 2, 3} for row in prof.t_target.values())
    drafts = measure_draft(
        rt, prune_pipe.drafter, "prune:0", batch_sizes=(1, 2), contexts=(32, 16), repeats=1, warmup=0
    )
    assert sorted(drafts) == [16, 32] and all(
        set(p.t_draft) == {1, 2} and p.draft == "prune:0" for p in drafts.values()
    )
    # the breakdown at the first context only
    assert drafts[16].draft_breakdown and not drafts[32].draft_breakdown
    assert (
        draft_kind(prune_pipe.drafter) == "model"
        and draft_kind(api.load("tiny", "lookup").drafter) == "lookup"
    )

    lat = Latencies(target=target, drafts={"prune:0": drafts}, draft_kinds={"prune:0": "model"})
    t16, t32 = target[16].t_target[2][3], target[32].t_target[2][3]
    assert lat.target_time(2, 3, 16) == t16 and lat.target_time(2, 3, 24) == pytest.approx((t16 + t32) / 2)
    assert lat.target_time(2, 3, 500) == t32  # clamped to the longest context measured
    assert lat.target_time(2, 5, 16) == pytest.approx(target[16].curve.time(5, 2))  # linear beyond n = 3
    d1, d2 = drafts[16].t_draft[1], drafts[16].t_draft[2]
    assert lat.draft_time("prune:0", 1, 8) == d1 and lat.draft_time("prune:0", 4, 16) == d2  # clamped
    assert lat.breakdown("prune:0") == drafts[16].draft_breakdown
    assert lat.draft_calls("prune:0", 4) == 4
    # a proposal of three forwards: the first, then twice what each further one adds
    n1 = drafts[16].t_draft_next[1]
    assert lat.draft_time("prune:0", 1, 16, calls=3) == pytest.approx(d1 + 2 * n1)
    assert lat.draft_time("prune:0", 1, 16, calls=0) == 0.0
    # the engine's own work: plain steps from the target's profile, speculative ones from the draft's
    assert lat.engine_time(None, 2) == target[16].t_engine[2] and not target[32].t_engine
    assert lat.engine_time("prune:0", 1) == drafts[16].t_engine[1] > 0

    back = Latencies.from_dict(json.loads(json.dumps(lat.as_dict())))  # what the result store keeps
    assert back == lat and back.target_time(1, 2, 20) == lat.target_time(1, 2, 20)


def test_draft_shape_of_pruned_and_subset_head_drafts(prune_pipe):
    from specdraft.design.prune import with_head

    rt, drafter = prune_pipe.runtime, prune_pipe.drafter
    shape = draft_shape(drafter)
    lw = rt.w.layers[0]
    per_layer = lw.wqkv.numel() + lw.wo.numel() + lw.w_gate_up.numel() + lw.w_down.numel()
    C = rt.w.embed.shape[1]
    assert shape == {
        "layers": 1,
        "query_heads": rt.w.n_heads,
        "kv_heads": rt.w.n_kv_heads,
        "ffn": lw.w_down.shape[1],
        "head_rows": rt.vocab_size,
        "layer_parameters": per_layer,
        "head_parameters": rt.vocab_size * C,
    }
    # a designed draft's subset head counts its own rows, not the vocabulary it hands back
    subset = with_head(drafter, torch.arange(8))
    assert draft_shape(subset)["head_rows"] == 8 and draft_shape(subset)["head_parameters"] == 8 * C
    assert draft_shape(api.load("tiny", "lookup").drafter) is None
