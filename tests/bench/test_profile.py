import json

import pytest
import torch

from specdraft import api, cli
from specdraft.bench.profile import (
    BUCKETS,
    LatencyProfile,
    engine_overhead,
    profile_latency,
    profile_pipeline,
)
from specdraft.commands.profile import int_list
from specdraft.errors import SpecdraftError
from specdraft.verify import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe():
    return api.load("tiny", "prune:0", dtype="fp32", draft_dtype="fp32")


def test_profile_measures_every_configuration_and_breaks_down_the_draft_step(pipe, tmp_path):
    prof = profile_pipeline(pipe, batch_sizes=(2, 1), new_tokens=(1, 3), context=32, repeats=3, warmup=1)
    assert prof.target == "tiny" and prof.draft == "prune:0" and prof.dtype == "fp32"
    assert prof.threads == 1 and prof.context == 32 and prof.repeats == 3
    assert set(prof.t_target) == {1, 2} and all(set(row) == {1, 3} for row in prof.t_target.values())
    assert all(t > 0 for row in prof.t_target.values() for t in row.values())
    assert set(prof.t_draft) == {1, 2} and all(t > 0 for t in prof.t_draft.values())
    # a model drafter's proposal was timed at 1 and DRAFT_FORWARDS tokens: each further forward
    # costs about what the first does (the tiny draft's forward dominates its token choice)
    assert set(prof.t_draft_next) == {1, 2}
    assert all(0.3 * prof.t_draft[b] < prof.t_draft_next[b] < 3 * prof.t_draft[b] for b in (1, 2))
    # the compact runtime's op sequence was recognised: every bucket is there and they add up
    assert set(prof.draft_breakdown) == set(BUCKETS)
    assert prof.breakdown_method.startswith("compact-runtime")
    assert sum(prof.draft_breakdown.values()) == pytest.approx(prof.t_draft[1], rel=1e-6)
    assert (
        prof.draft_breakdown["attention"] > 0
        and prof.draft_breakdown["mlp"] > 0
        and prof.draft_breakdown["lm_head"] > 0
    )

    path = tmp_path / "p.json"
    prof.save(path)
    assert LatencyProfile.load(path) == prof
    assert "T_target n=3" in prof.table() and "draft step (prune:0, fp32, batch 1)" in prof.table()


def test_a_gated_drafter_is_timed_stopping_after_one_token_or_drafting_them_all():
    from specdraft.drafters.base import DraftContext
    from specdraft.drafters.gated import GatedDrafter
    from specdraft.policy import VerifyCost

    target = api.load("tiny", "none", dtype="fp32")
    pays = VerifyCost([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.0)  # a longer proposal never costs more
    gated = GatedDrafter(api.load("tiny", "prune:0", dtype="fp32").drafter.runtime, "gated", cost=pays)
    ctx = DraftContext(torch.randint(50, (2, 17)), torch.full((2,), 16), [SamplingParams()] * 2, [None] * 2)
    state = gated.new_state(2, 24)
    gated.propose(state, ctx, 1)

    def steps(**hold):
        state.fed = ctx.lengths - 1
        if not hold:
            return gated.propose(state, ctx, 4).steps.tolist()
        with gated.drafting(**hold):
            return gated.propose(state, ctx, 4).steps.tolist()

    assert steps() == [4, 4]  # drafts on: every token pays
    assert steps(every_token=False) == [1, 1] and steps(every_token=True) == [4, 4]
    assert gated.cost is pays  # restored
    prof = profile_latency(target.runtime, gated, batch_sizes=(1,), new_tokens=(1,), context=16, repeats=2)
    assert prof.t_draft_next[1] > 0.3 * prof.t_draft[1]  # four forwards were timed against one


def test_engine_overhead_is_the_step_time_outside_the_forwards():
    lookup = api.load("tiny", "lookup", dtype="fp32")
    plain = engine_overhead(lookup.runtime, batch_sizes=(1, 2), context=16, steps=4)
    spec = engine_overhead(lookup.runtime, lookup.drafter, batch_sizes=(2,), context=16, k=3, steps=4)
    assert set(plain) == {1, 2} and set(spec) == {2}
    # verification, commit and bookkeeping: more than nothing, less than a step's whole wall time
    assert all(0 < t < 0.05 for t in [*plain.values(), *spec.values()])


def test_int8_draft_breakdown_follows_the_quantized_matmuls():
    pipe = api.load("tiny", "prune:0,1", dtype="fp32", draft_dtype="int8")
    prof = profile_pipeline(pipe, new_tokens=(1,), context=16, repeats=2, warmup=0)
    assert prof.draft_dtype == "int8" and prof.breakdown_method.startswith("compact-runtime")
    assert set(prof.draft_breakdown) == set(BUCKETS) and prof.draft_breakdown["mlp"] > 0


def test_prompt_lookup_and_target_only():
    lookup = api.load("tiny", "lookup", dtype="fp32")
    prof = profile_pipeline(lookup, new_tokens=(1,), context=16, repeats=2, warmup=0)
    assert set(prof.draft_breakdown) == {"lookup", "python"} and prof.draft_dtype == ""
    target_only = profile_latency(lookup.runtime, None, new_tokens=(1, 2), context=16, repeats=2, warmup=0)
    assert target_only.draft == "none" and target_only.t_draft == {} and target_only.draft_breakdown == {}
    with pytest.raises(SpecdraftError, match="no draft measurements"):
        target_only.draft_time()


def test_target_time_interpolates_and_extrapolates():
    prof = LatencyProfile(
        "t", "d", "fp32", 1, 200, 3, 1, t_target={1: {1: 1.0, 3: 3.0, 5: 4.0}}, t_draft={1: 0.5}
    )
    assert prof.target_time(3) == 3.0
    assert prof.target_time(2) == pytest.approx(2.0)
    assert prof.target_time(4) == pytest.approx(3.5)
    assert prof.target_time(7) == pytest.approx(5.0)  # the last segment's slope
    assert prof.draft_time(1) == 0.5
    with pytest.raises(SpecdraftError, match="batch 4"):
        prof.target_time(1, batch=4)


def test_bad_arguments(pipe, tmp_path):
    with pytest.raises(SpecdraftError, match=">= 1"):
        profile_latency(pipe.runtime, batch_sizes=(0,))
    with pytest.raises(SpecdraftError, match="exceeds"):
        profile_latency(pipe.runtime, context=10_000)
    with pytest.raises(SpecdraftError, match="cannot read"):
        (tmp_path / "x.json").write_text("{}")
        LatencyProfile.load(tmp_path / "x.json")
    assert int_list("1-3,8") == [1, 2, 3, 8]
    with pytest.raises(SpecdraftError):
        int_list("a")


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "prof.json"
    argv = [
        "profile",
        "--target",
        "tiny",
        "--draft",
        "prune:0",
        "--dtype",
        "fp32",
        "--draft-dtype",
        "fp32",
        "--batch",
        "1,2",
        "--new-tokens",
        "1-2",
        "--context",
        "16",
        "--repeats",
        "2",
        "--threads",
        "1",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    d = json.loads(out.read_text())
    assert d["t_target"].keys() == {"1", "2"} and d["threads"] == 1
    assert "T_target n=1" in capsys.readouterr().out


def test_designed_draft_with_a_head_subset_is_broken_down_by_its_compact_runtime(tmp_path):
    from specdraft.bench.hf_baselines import pruned_hf_model
    from specdraft.design.artifact import DraftMeta, save_draft

    pipe = api.load("tiny", "none", dtype="fp32")
    meta = DraftMeta.for_target(pipe.target.model, "tiny")
    meta.head_tokens = list(range(0, 256, 2))
    path = save_draft(tmp_path / "d", pruned_hf_model(pipe.target.model, [0]), meta)
    drafter = api.make_drafter(f"designed:{path}", pipe.target, pipe.runtime, torch.float32)
    prof = profile_latency(pipe.runtime, drafter, new_tokens=(1,), context=16, repeats=2, warmup=0)
    assert "SubsetHead" in type(drafter.runtime).__name__
    assert prof.breakdown_method.startswith("compact-runtime") and prof.draft_breakdown["lm_head"] > 0


class _Counting:
    """A runtime wrapper that counts its forwards (named ``runtime`` like a subset-head wrapper's
    inner model: the profiler must time the wrapper itself)."""

    def __init__(self, runtime):
        self.runtime, self.calls = runtime, 0

    def __getattr__(self, name):
        return getattr(self.runtime, name)

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.runtime.forward(*args, **kwargs)


def test_measure_latency_times_target_sizes_and_drafts_in_turn(pipe):
    from specdraft.bench.profile import measure_latency

    target, draft = _Counting(pipe.runtime), _Counting(pipe.drafter.runtime)
    lat = measure_latency(target, {"d": draft}, ns=(4, 1, 2), context=24, reps=3)
    assert sorted(lat.target) == [1, 2, 4] and set(lat.draft) == {"d"} and lat.context == 24
    assert all(t > 0 for t in [*lat.target.values(), *lat.draft.values()])
    # one prefill each, then a warm-up round and three timed rounds of every job
    assert target.calls == 1 + 4 * 3 and draft.calls == 1 + 4
    t = lat.curve().time
    assert t(2) == lat.target[2] and t(3) == pytest.approx((lat.target[2] + lat.target[4]) / 2)
    assert t(9) == lat.target[4]  # flat beyond the measured sizes
    with pytest.raises(SpecdraftError):
        measure_latency(pipe.runtime, {}, ns=(0, 1))


def test_profile_json_loads_into_the_same_latency_curve(tmp_path):
    """A stored profile (string keys in JSON) reads the same T_target as the one that wrote it."""
    table = {1: {1: 0.01, 4: 0.016}, 4: {1: 0.03, 4: 0.05}}
    prof = LatencyProfile("t", "d", "fp32", 1, 200, 3, 1, t_target=table)
    prof.save(tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["t_target"] == {"1": {"1": 0.01, "4": 0.016}, "4": {"1": 0.03, "4": 0.05}}
    back = LatencyProfile.load(tmp_path / "p.json")
    assert back.curve == prof.curve and back.target_time(2, batch=4) == pytest.approx(0.03 + 0.02 / 3)
    assert back.curve.time(1, batch=2) == pytest.approx(0.01 + 0.02 / 3)  # between measured batch sizes


class _Logged(_Counting):
    """A runtime wrapper that logs ``(name, new tokens)`` per forward."""

    def __init__(self, runtime, name, log):
        super().__init__(runtime)
        self.name, self.log = name, log

    def forward(self, state, tokens, *args, **kwargs):
        self.log.append((self.name, tokens.shape[1]))
        return super().forward(state, tokens, *args, **kwargs)


def test_compare_forwards_times_each_size_on_every_runtime_in_turn(pipe):
    from specdraft.bench.profile import compare_forwards

    log: list[tuple[str, int]] = []
    runtimes = {"a": _Logged(pipe.runtime, "a", log), "b": _Logged(pipe.drafter.runtime, "b", log)}
    times = compare_forwards(runtimes, (2, 1), context=24, reps=2)
    assert {n: sorted(t) for n, t in times.items()} == {"a": [1, 2], "b": [1, 2]}
    assert all(t > 0 for per in times.values() for t in per.values())
    assert log == [("a", 24), ("b", 24)] + [("a", 1), ("b", 1), ("a", 2), ("b", 2)] * 2
    with pytest.raises(SpecdraftError):
        compare_forwards(runtimes, (1,), context=pipe.runtime.max_context, reps=1)


def test_compare_forwards_times_a_tree_step_after_each_chain_step(pipe):
    """``trees``: per n, the chain step then a token-tree step of n tokens (a mask over the cache
    slots, siblings at one position) on the same runtime, reported as ``"<name> tree"``."""
    from specdraft.bench.profile import compare_forwards

    rt = _Counting(pipe.runtime)
    seen = []
    forward = rt.forward
    rt.forward = lambda s, t, p, **kw: (
        seen.append((p[0].tolist(), "attn_mask" in kw)) or forward(s, t, p, **kw)
    )
    times = compare_forwards({"a": rt}, (4, 1), context=24, reps=2, trees=True)
    assert {n: sorted(t) for n, t in times.items()} == {"a": [1, 4], "a tree": [1, 4]}
    assert all(t > 0 for per in times.values() for t in per.values())
    chain, tree = ([24, 25, 26, 27], False), ([24, 25, 25, 26], True)  # root, 2 children, a grandchild
    assert seen[-4:] == [([24], False), ([24], True), chain, tree]
