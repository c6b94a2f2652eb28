import pytest

from specdraft import api, lossless
from specdraft.bench import harness
from specdraft.bench.harness import Run
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.policy import CostAwareK, FixedK, HeuristicK, make_policy
from specdraft.stats import SpecStats
from tests.helpers import plain_greedy


@pytest.fixture(scope="module")
def pipe():
    return api.load("tiny", "prune:0", dtype="fp32", draft_dtype="fp32")


def recorder(name: str, calls: list[str], tokens: list[int]) -> harness.Method:
    def decode(ids, max_new_tokens, params):
        calls.append(name)
        return tokens[:max_new_tokens]

    return harness.baseline_method(name, decode)


def test_interleave_rotates_the_order_by_prompt():
    assert [harness.interleave("AB", i) for i in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert [harness.interleave("ABC", i) for i in range(4)] == [
        list("ABC"),
        list("BCA"),
        list("CAB"),
        list("ABC"),
    ]
    assert harness.interleave([], 5) == []


def test_run_prompt_runs_in_interleaved_order_and_returns_in_method_order():
    calls: list[str] = []
    methods = [recorder("a", calls, [1, 2]), recorder("b", calls, [1, 3]), recorder("c", calls, [4])]
    runs = harness.run_prompt(methods, [7, 8], 1, 8)
    assert calls == ["b", "c", "a"]
    assert list(runs) == ["a", "b", "c"]
    assert runs["b"].tokens == [1, 3] and runs["b"].stats is None and runs["b"].prefill_seconds == 0.0
    assert all(r.seconds >= 0 for r in runs.values())


def test_every_policy_has_k_max_and_the_engine_reserves_room_for_it(pipe):
    policies = [
        FixedK(0),
        FixedK(3),
        HeuristicK(k_max=11),
        CostAwareK(k_max=6),
        make_policy("auto"),
        make_policy("heuristic"),
    ]
    assert [p.k_max for p in policies] == [0, 3, 11, 6, 8, 16]
    for p in policies:
        assert Engine(pipe.runtime, pipe.drafter, p).reserve == p.k_max + 2
    assert Engine(pipe.runtime).reserve == 2  # plain decoding: k = 0


def test_prompt_budget_leaves_the_largest_engine_reserve(pipe):
    rt = pipe.runtime
    plain = harness.engine_method("plain", rt)
    spec = harness.engine_method("spec", rt, pipe.drafter, HeuristicK(k_max=12))
    base = harness.baseline_method("hf", lambda ids, n, p: [])
    assert harness.prompt_budget(rt, [plain, base], 8) == rt.max_context - 8 - 2
    assert harness.prompt_budget(rt, [plain, spec, base], 8) == rt.max_context - 8 - 14
    assert harness.prompt_budget(rt, [plain, spec], 8, max_prompt_tokens=40) == 40


def test_engine_method_decodes_like_plain_greedy_and_keeps_its_policy(pipe):
    ids = pipe.encode("Who wrote Hamlet?")
    policy = make_policy("auto")
    plain = harness.engine_method("plain", pipe.runtime, eos_ids=pipe.eos_ids)
    spec = harness.engine_method("spec", pipe.runtime, pipe.drafter, policy, eos_ids=pipe.eos_ids)
    ref = plain_greedy(pipe.runtime, ids, 8, pipe.eos_ids)
    first = plain.run(ids, 8)
    assert first.tokens == ref and first.stats.drafted == 0 and first.stats.generated == len(ref)
    assert 0 < first.prefill_seconds < first.seconds
    for _ in range(2):
        run = spec.run(ids, 8)
        assert run.tokens == ref and run.stats.target_forwards > 0
    assert policy.t_draft is not None  # the one policy saw both calls


class FlagsSecondRow(FixedK):
    """Fixed k, flagging the second row it sees as collapsed (as a watching policy would)."""

    def choose(self, rows=None, lag=None) -> int:
        if len(rows) > 1 and not self.collapsed:
            self.collapsed = frozenset(rows[1:2])
        return self.k


def test_run_batch_decodes_the_prompts_together_and_counts_each_step(pipe):
    prompts = [pipe.encode("Who wrote Hamlet?"), pipe.encode("Hi"), pipe.encode("Write a poem.")]
    refs = [plain_greedy(pipe.runtime, p, 6, ()) for p in prompts]
    plain = harness.engine_method("plain", pipe.runtime).run_batch(prompts, 6)
    assert plain.outputs == refs and plain.steps == [6, 6, 6] and plain.collapsed == []
    assert plain.tokens_fed == 18 and plain.stats.target_forwards == 6  # one token per row per forward
    assert 0 < plain.stats.prefill_time < plain.first_token_seconds < plain.seconds

    spec_policy = FlagsSecondRow(3)
    spec = harness.engine_method("spec", pipe.runtime, pipe.drafter, spec_policy).run_batch(prompts, 6)
    assert spec.outputs == refs and spec.collapsed == [1]
    assert len(set(spec.request_ids)) == 3 and spec.request_ids[1] in spec_policy.collapsed
    assert max(spec.steps) == spec.stats.target_forwards and sum(spec.steps) == spec.stats.steps
    assert set(spec.stats.k_history) == {3} and spec.tokens_fed == 4 * sum(spec.steps)
    alone = harness.engine_method("spec", pipe.runtime, pipe.drafter, FixedK(3)).run_batch(prompts[:1], 6)
    assert alone.tokens_fed == sum(k + 1 for k in alone.stats.k_history)
    with pytest.raises(SpecdraftError, match="not an engine"):
        harness.baseline_method("hf", lambda ids, n, p: []).run_batch(prompts, 6)


def test_engine_runs_time_their_first_token_and_totals_rate_the_rest(pipe):
    run = harness.engine_method("plain", pipe.runtime).run(pipe.encode("Hi"), 6)
    assert run.prefill_seconds < run.first_token_seconds < run.seconds
    t = harness.Totals()
    t.add(Run([1, 2, 3, 4], 2.0, first_token_seconds=0.5))
    t.add(Run([5, 6], 1.0, first_token_seconds=0.5))
    assert t.runs == 2 and t.first_token_seconds == 1.0
    assert t.after_first_tokens_per_s == pytest.approx((6 - 2) / (3.0 - 1.0))
    assert harness.Totals().after_first_tokens_per_s == 0.0


def test_run_prompts_interleaves_and_sums_each_method():
    calls: list[str] = []
    methods = [recorder("a", calls, [1, 2, 3]), recorder("b", calls, [4])]
    totals = harness.run_prompts(methods, [[7], [8], [9]], 2)
    assert calls == ["a", "b", "b", "a", "a", "b"] and list(totals) == ["a", "b"]
    assert totals["a"].outputs == [[1, 2]] * 3 and totals["a"].tokens == 6 and totals["b"].runs == 3


def test_agreement_counts_identical_outputs_common_prefixes_and_positions():
    outs = [[1, 2, 3], [1, 2, 3], [1, 2], [5]]
    refs = [[1, 2, 3], [1, 9, 3], [1, 2, 4], [6]]
    agree = harness.agreement(outs, refs)
    assert agree["identical_outputs"] == 1 and agree["prompts"] == 4
    assert agree["mean_common_prefix"] == pytest.approx((3 + 1 + 2 + 0) / 4)  # a prefix stops at its end
    assert agree["positionwise"] == pytest.approx((3 + 2 + 2 + 0) / (3 + 3 + 2 + 1))
    assert harness.agreement([], [])["positionwise"] == 0.0


def test_totals_are_sums_of_tokens_over_sums_of_seconds():
    stats = SpecStats(steps=2, accepted=2, generated=4, prefill_time=0.5)
    t = harness.Totals()
    t.add(Run([1, 2, 3, 4], 1.0, stats), lossless.IDENTICAL)
    t.add(Run([5] * 12, 3.0), lossless.TIE_DIVERGENT)
    t.add(Run([6], 1.0), lossless.DIVERGENT)
    assert t.tokens == 17 and t.seconds == 5.0
    assert t.tokens_per_s == pytest.approx(17 / 5.0)  # not the mean of 4, 4 and 1 tok/s
    assert t.decode_tokens_per_s == pytest.approx(17 / 4.5)
    assert t.stats.generated == 4 and t.stats.mean_accepted_length == 2.0
    assert t.mismatches == 2 and t.classes[lossless.IDENTICAL] == 1
    assert harness.Totals().tokens_per_s == 0.0


def test_equality_classifies_against_plain_greedy(pipe):
    ids = pipe.encode("Who wrote Hamlet?")
    ref, margins = lossless.plain_greedy_margins(pipe.runtime, ids, 8, pipe.eos_ids)
    # equal outputs: no model call at all
    assert harness.equality(None, ids, ref, list(ref), 8, pipe.eos_ids, 0.0) == (lossless.IDENTICAL, None)
    changed = list(ref)
    changed[3] = (changed[3] + 1) % 256
    args = (pipe.runtime, ids, ref, changed, 8, pipe.eos_ids)
    assert harness.equality(*args, tol=0.0) == (lossless.DIVERGENT, 3)
    assert harness.equality(*args, tol=float(margins[3]) + 1.0) == (lossless.TIE_DIVERGENT, 3)


def test_tolerance_is_zero_in_fp32_only(pipe):
    assert harness.runtime_precision(pipe.runtime) == "fp32"
    assert harness.tolerance(pipe.runtime) == 0.0
    assert harness.tolerance(pipe.runtime, 1.5) == 1.5
    bf16 = api.load("tiny", "none", dtype="bf16").runtime
    # "bf16 weights, fp32 compute" on the native path
    assert harness.runtime_precision(bf16).startswith("bf16")
    assert harness.tolerance(bf16) == lossless.DEFAULT_TOLERANCE


def test_warm_up_runs_each_method_once():
    calls: list[str] = []
    harness.warm_up([recorder("a", calls, [1]), recorder("b", calls, [2])], [3], 4)
    assert calls == ["a", "b"]


def test_decode_requests_keeps_the_order_of_the_requests(pipe):
    from specdraft.engine import Request, decode_requests

    prompts = [
        pipe.encode("Who wrote Hamlet?"),
        pipe.encode("Hi"),
        pipe.encode("Write a poem about the sea."),
    ]
    out = decode_requests(Engine(pipe.runtime), [Request(p, 6, eos_ids=pipe.eos_ids) for p in prompts])
    assert out == [plain_greedy(pipe.runtime, p, 6, pipe.eos_ids) for p in prompts]
