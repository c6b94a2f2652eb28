"""The decoding loop: greedy speculative output is token-identical to plain greedy in float32 for
every drafter, k, policy and batch shape; EOS, budgets, cancel, rows joining, statistics."""

from dataclasses import replace

import pytest
import torch

from specdraft import kernels
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine, Request, generate, prompt_logprobs
from specdraft.errors import SpecdraftError
from specdraft.models.hf import HFRuntime
from specdraft.models.llama import LlamaRuntime
from specdraft.models.tiny import tiny_llama
from specdraft.policy import CostAwareK, FixedK, HeuristicK
from specdraft.verify import SamplingParams
from tests.helpers import (
    assert_target_logprobs,
    compact,
    decode,
    decode_logprobs,
    plain_greedy,
    random_prompts,
)

N = 24  # new tokens per prompt
# ragged: a one-token prompt (nothing to prefill), and a prompt that repeats itself (lookup hits)
PROMPTS = random_prompts([1, 7, 13]) + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]


@pytest.fixture(scope="module")
def reference(tiny):
    return [plain_greedy(tiny.target, p, N) for p in PROMPTS]


def make_drafter(tiny, name):
    if name == "self":  # every draft accepted
        return ModelDrafter(tiny.target, "self")
    if name == "other":  # an independently seeded model: (almost) nothing accepted
        return ModelDrafter(tiny.other, "other")
    if name == "prune":  # the target's layer 0 alone: some accepted (about a quarter)
        return ModelDrafter(LlamaRuntime(tiny.weights, [0]), "prune:0")
    return PromptLookupDrafter()


DRAFTERS = ["self", "other", "prune", "lookup"]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_batch1_equals_plain(tiny, reference, drafter, k):
    for i in (0, 3):  # the one-token prompt and the self-repeating one (the ragged test has all)
        prompt, ref = PROMPTS[i], reference[i]
        engine = Engine(tiny.target, make_drafter(tiny, drafter), FixedK(k))
        assert decode(engine, [prompt], N) == [ref]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_ragged_batch_equals_plain(tiny, reference, drafter, k):
    """Prompts of lengths 1, 7, 13 and 10 decoded together; each row accepts a different number."""
    engine = Engine(tiny.target, make_drafter(tiny, drafter), FixedK(k))
    assert decode(engine, PROMPTS, N) == reference


@pytest.mark.parametrize("policy", [HeuristicK, CostAwareK], ids=["heuristic", "cost-aware"])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_adaptive_policies_equal_plain(tiny, reference, drafter, policy):
    engine = Engine(tiny.target, make_drafter(tiny, drafter), policy())
    assert decode(engine, PROMPTS, N) == reference
    engine = Engine(tiny.target, make_drafter(tiny, drafter), policy())
    assert decode(engine, PROMPTS[2:3], N) == reference[2:3]


class TrimToOne(FixedK):
    """k = 4 asked for, then every row cut to one token; records the classes it was shown."""

    def __init__(self):
        super().__init__(4)
        self.seen = []

    def trim(self, num_valid, bucket, rows=None):
        self.seen.append(None if bucket is None else bucket.tolist())
        return num_valid.clamp(max=1)


@pytest.mark.parametrize("drafter", ["lookup", "prune"])
def test_policy_trim_cuts_proposals_and_stays_lossless(tiny, reference, drafter):
    policy = TrimToOne()
    engine = Engine(tiny.target, make_drafter(tiny, drafter), policy)
    assert decode(engine, PROMPTS, N) == reference
    assert len(engine.stats.drafted_per_position) == 1  # nothing past the first draft was verified
    assert engine.stats.drafted > 0
    if drafter == "lookup":  # classed by matched n-gram length (0: none), one entry per row
        assert all(b is not None and all(0 <= n <= 3 for n in b) for b in policy.seen)
        assert any(n > 0 for b in policy.seen for n in b)
    else:
        assert all(b is None for b in policy.seen)


def test_acceptance_matches_the_drafter_kind(tiny):
    """The three model drafts are what the equality tests claim: all, none, some accepted."""
    rates = {}
    for name in ("self", "other", "prune"):
        engine = Engine(tiny.target, make_drafter(tiny, name), FixedK(3))
        decode(engine, PROMPTS, N)
        rates[name] = engine.stats.acceptance_rate
    assert rates["self"] == 1.0
    assert rates["other"] < 0.05
    assert 0.1 < rates["prune"] < 0.95


@pytest.mark.parametrize("drafter", ["self", "other", "lookup"])
def test_hf_adapter_target_equals_plain(tiny, drafter):
    """The transformers adapter (batch 1) as target, and as the draft's runtime."""
    target = HFRuntime(tiny.model)
    if drafter == "self":
        d = ModelDrafter(HFRuntime(tiny.model), "self")
    elif drafter == "other":
        d = ModelDrafter(HFRuntime(tiny_llama(seed=1)), "other")
    else:
        d = PromptLookupDrafter()
    for prompt in PROMPTS[1:]:
        ref = plain_greedy(target, prompt, 16)
        for k in (1, 3):
            assert decode(Engine(target, d, FixedK(k)), [prompt], 16) == [ref]
    if drafter == "self":
        engine = Engine(target, d, FixedK(3))
        decode(engine, [PROMPTS[1]], 16)
        assert engine.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("drafter", ["prune", "lookup"])
def test_greedy_rows_stay_exact_next_to_sampling_rows(tiny, reference, drafter):
    engine = Engine(tiny.target, make_drafter(tiny, drafter), FixedK(3))
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=5, seed=2),
    ]
    out = decode(engine, PROMPTS, N, params)
    assert out[0] == reference[0] and out[2] == reference[2]
    assert all(len(o) == N for o in out)


# ------------------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("drafter", ["none", "prune", "lookup"])
def test_logprobs_are_the_targets_for_the_rows_that_ask(tiny, reference, drafter):
    """Greedy rows asking 3 and 0 alternatives, a sampled row asking 2, a row asking none; the
    reported logprobs are the target's over the output in one forward, whatever was accepted."""
    params = [
        SamplingParams(logprobs=3),
        SamplingParams(),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.8, seed=4, logprobs=2),
    ]
    drafts = None if drafter == "none" else make_drafter(tiny, drafter)
    got = decode_logprobs(Engine(tiny.target, drafts, FixedK(3)), PROMPTS, N, params)
    assert got[1] is None
    assert [g.token for g in got[0]] == reference[0] and [g.token for g in got[2]] == reference[2]
    for prompt, row, p in zip(PROMPTS, got, params):
        if p.logprobs is not None:
            assert_target_logprobs(tiny.model, prompt, row, p.logprobs)
            if p.logprobs and not p.temperature:  # greedy: the chosen token is the most likely
                assert all(g.top[0][0] == g.token for g in row)


def test_eos_stops_each_row_where_plain_decoding_does(tiny, reference):
    # pick, per row, a token from the middle of its plain output as that row's "EOS"
    eos = tuple(sorted({ref[len(ref) // 2] for ref in reference}))
    expected = []
    for prompt in PROMPTS:
        expected.append(plain_greedy(tiny.target, prompt, N, eos_ids=eos))
    assert all(len(e) < N and e[-1] in eos for e in expected)
    for drafter in ("self", "prune", "lookup"):
        engine = Engine(tiny.target, make_drafter(tiny, drafter), FixedK(8))
        reqs = [Request(p, N, eos_ids=eos) for p in PROMPTS]
        out, reasons = {}, {}
        for ev in generate(engine, reqs):
            out.setdefault(ev.request_id, []).extend(ev.tokens)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason
        assert [out[r.id] for r in reqs] == expected
        assert all(reasons[r.id] == "stop" for r in reqs)
        assert engine.active == 0


@pytest.mark.parametrize("max_new", [1, 2, 10])
def test_max_new_tokens_is_exact_even_when_a_step_accepts_more(tiny, reference, max_new):
    engine = Engine(tiny.target, make_drafter(tiny, "self"), FixedK(8))  # 9 tokens per step
    reqs = [Request(p, max_new) for p in PROMPTS]
    events = list(generate(engine, reqs))
    assert [[x for e in events if e.request_id == r.id for x in e.tokens] for r in reqs] == [
        ref[:max_new] for ref in reference
    ]
    finals = [e for e in events if e.finished]
    assert len(finals) == len(reqs) and all(e.finish_reason == "length" for e in finals)
    assert engine.stats.generated == max_new * len(reqs)


def test_from_draft_marks_accepted_tokens(tiny):
    engine = Engine(tiny.target, make_drafter(tiny, "self"), FixedK(3))
    events = list(generate(engine, [Request(PROMPTS[1], 8)]))
    assert [e.from_draft for e in events] == [[True, True, True, False], [True, True, True, False]]
    engine = Engine(tiny.target, make_drafter(tiny, "other"), FixedK(3))
    events = list(generate(engine, [Request(PROMPTS[1], 8)]))
    assert sum(sum(e.from_draft) for e in events) == engine.stats.accepted


# ------------------------------------------------------------------------------ batch membership
@pytest.mark.parametrize("drafter", ["prune", "lookup"])
def test_cancel_keeps_the_other_rows_exact(tiny, reference, drafter):
    engine = Engine(tiny.target, make_drafter(tiny, drafter), FixedK(3))
    ids = engine.add([Request(p, N) for p in PROMPTS])
    out = {i: [] for i in ids}
    for _ in range(2):
        for ev in engine.step():
            out[ev.request_id] += ev.tokens
    ev = engine.cancel(ids[1])
    assert ev.finished and ev.finish_reason == "cancelled"
    assert engine.cancel(ids[1]) is None and engine.active == 3
    while engine.active:
        for ev in engine.step():
            out[ev.request_id] += ev.tokens
    for i, ref in zip(ids, reference):
        if i == ids[1]:
            assert out[i] == ref[: len(out[i])] and len(out[i]) < N
        else:
            assert out[i] == ref


@pytest.mark.parametrize("drafter", ["self", "prune", "lookup", None])
def test_rows_joining_mid_run_equal_running_alone(tiny, reference, drafter):
    engine = Engine(
        tiny.target, make_drafter(tiny, drafter) if drafter else None, FixedK(3 if drafter else 0)
    )
    out: dict[int, list[int]] = {}
    first = engine.add([Request(PROMPTS[2], N)])
    for step in range(40):
        if step == 2:
            joined = engine.add([Request(PROMPTS[0], N), Request(PROMPTS[3], N)])  # between steps
        if step == 4:
            late = engine.add([Request(PROMPTS[1], N)])
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)
        if not engine.active:
            break
    assert engine.active == 0
    assert out[first[0]] == reference[2]
    assert [out[i] for i in joined] == [reference[0], reference[3]]
    assert out[late[0]] == reference[1]


def test_engine_is_reusable_after_the_caller_stops_early(tiny, reference):
    engine = Engine(tiny.target, make_drafter(tiny, "prune"), FixedK(3))
    events = generate(engine, [Request(p, N) for p in PROMPTS])
    next(events)
    events.close()  # the caller went away
    assert engine.active == 0
    assert decode(engine, PROMPTS, N) == reference


# ----------------------------------------------------------------------------------- statistics
def test_stats_plain_decoding_is_one_token_per_forward(tiny):
    engine = Engine(tiny.target)
    decode(engine, PROMPTS[:2], 10)
    s = engine.stats
    assert s.mean_accepted_length == 1.0 and s.acceptance_rate == 0.0
    assert s.drafted == s.accepted == 0 and s.generated == 20
    assert s.steps == 20 and s.target_forwards == 10 and set(s.k_history) == {0}
    assert s.per_position_acceptance() == []
    assert s.total_time >= s.target_time + s.draft_time and s.prefill_time > 0 and s.tokens_per_s > 0


def test_stats_count_the_bonus_token(tiny):
    engine = Engine(tiny.target, make_drafter(tiny, "self"), FixedK(3))
    decode(engine, PROMPTS[:2], 16)
    s = engine.stats
    assert s.mean_accepted_length == 4.0  # 3 accepted + the bonus token, every step
    assert s.acceptance_rate == 1.0 and s.per_position_acceptance() == [1.0, 1.0, 1.0]
    assert (
        s.steps == 8 and s.target_forwards == 4 and s.drafted == 24 and s.accepted == 24 and s.generated == 32
    )
    assert s.draft_time > 0 and s.target_time > 0

    engine = Engine(tiny.target, make_drafter(tiny, "prune"), FixedK(3))
    out = decode(engine, PROMPTS, N)
    s = engine.stats
    assert s.generated == sum(map(len, out))
    assert s.mean_accepted_length == pytest.approx((s.accepted + s.steps) / s.steps)
    assert s.drafted_per_position[0] == s.steps and s.drafted_per_position == sorted(
        s.drafted_per_position, reverse=True
    )
    assert s.accepted_per_position[0] >= s.accepted_per_position[1] >= s.accepted_per_position[2]
    assert sum(s.accepted_per_position) == s.accepted


@pytest.mark.parametrize("chunk", [4, 256])
def test_prompt_logprobs_are_the_targets_in_chunks_or_not(tiny, chunk):
    prompt = PROMPTS[2]  # 13 tokens: chunks of 4 leave a last chunk of 0 .. 3
    got = prompt_logprobs(tiny.target, prompt, 3, chunk=chunk)
    assert [g.token for g in got] == prompt and got[0].logprob is None and got[0].top == ()
    assert_target_logprobs(tiny.model, prompt[:1], got[1:], 3)


def test_requests_with_the_same_prompt_share_one_prefill(tiny, reference, monkeypatch):
    """A server request's n choices join together with one prompt: its prefill runs once, and each
    row decodes as it would alone (greedy rows and seeded sampling rows)."""
    rows = []
    forward = tiny.target.forward

    def counting(state, tokens, positions, **kw):
        rows.append(tuple(tokens.shape))
        return forward(state, tokens, positions, **kw)

    monkeypatch.setattr(tiny.target, "forward", counting)
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[2]]
    sampled = [SamplingParams(temperature=0.9, seed=s) for s in (5, 6)]
    params = [SamplingParams()] * 3 + sampled
    out = decode(Engine(tiny.target, make_drafter(tiny, "prune"), FixedK(3)), prompts, N, params)
    assert rows[0] == (2, len(PROMPTS[2]) - 1)  # one row per distinct prompt, its last token left
    assert out[:3] == [reference[2], reference[2], reference[0]]
    for got, p in zip(out[3:], sampled):
        assert (
            got == decode(Engine(tiny.target, make_drafter(tiny, "prune"), FixedK(3)), [PROMPTS[2]], N, p)[0]
        )
    assert out[3] != out[4]


# ------------------------------------------------------------------------------------ bad input
def test_engine_refuses_bad_requests(tiny):
    engine = Engine(tiny.target, make_drafter(tiny, "lookup"))
    with pytest.raises(SpecdraftError, match="empty prompt"):
        engine.add([Request([], 4)])
    with pytest.raises(SpecdraftError, match="max_new_tokens"):
        engine.add([Request([1, 2], 0)])
    with pytest.raises(SpecdraftError, match="context window"):
        engine.add([Request([1] * 500, 13)])  # tiny context: 512
    assert engine.active == 0


def test_engine_refuses_a_draft_with_another_vocabulary(tiny):
    small = compact(tiny_llama(vocab_size=128, seed=2))
    with pytest.raises(SpecdraftError, match="vocabulary"):
        Engine(tiny.target, ModelDrafter(small, "small"))


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    drafter = make_drafter(tiny, "prune")
    alone = decode(Engine(tiny.target, drafter, FixedK(3)), [PROMPTS[1]], N, params)[0]
    again = decode(Engine(tiny.target, drafter, FixedK(3)), [PROMPTS[1]], N, params)[0]
    assert alone == again
    other_seed = decode(
        Engine(tiny.target, drafter, FixedK(3)),
        [PROMPTS[1]],
        N,
        SamplingParams(temperature=1.0, top_p=0.95, seed=99),
    )[0]
    assert other_seed != alone
    company = [SamplingParams(temperature=1.0, seed=5), params, SamplingParams()]
    batched = decode(
        Engine(tiny.target, drafter, FixedK(3)), [PROMPTS[2], PROMPTS[1], PROMPTS[0]], N, company
    )
    assert batched[1] == alone  # each request owns its generator


# ------------------------------------------------------------------------------ real SmolLM2, fp32
@pytest.mark.parametrize("spec", ["prune:0,1,2,29", "lookup"])
def test_smollm2_fp32_speculative_equals_plain(smollm2, spec):
    from specdraft import api

    pipe = smollm2.pipe
    drafter = api.make_drafter(spec, pipe.target, pipe.runtime, torch.float32)
    for text in ("What is the capital of France?", "List three colours, separated by commas."):
        ids = pipe.encode(text)
        ref = plain_greedy(pipe.runtime, ids, 24, pipe.eos_ids)
        engine = Engine(pipe.runtime, drafter, FixedK(4))
        assert decode(engine, [ids], 24, eos_ids=pipe.eos_ids) == [ref], text


@pytest.mark.parametrize("drafter", ["prune", "lookup"])
def test_a_longer_request_joining_grows_the_caches(tiny, drafter):
    short, long = random_prompts([3, 60], seed=12)
    engine = Engine(tiny.target, make_drafter(tiny, drafter), FixedK(4))
    out: dict[int, list[int]] = {}
    first = engine.add([Request(short, 6)])
    for ev in engine.step():
        out.setdefault(ev.request_id, []).extend(ev.tokens)
    cap = engine.tokens.shape[1]
    second = engine.add([Request(long, 40)])  # needs more slots than the batch has
    assert engine.tokens.shape[1] > cap
    while engine.active:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)
    assert out[first[0]] == plain_greedy(tiny.target, short, 6)
    assert out[second[0]] == plain_greedy(tiny.target, long, 40)


@pytest.mark.parametrize("drafter", ["prune", "lookup"])
def test_a_long_prompt_joining_late_rows_stays_inside_the_caches(tiny, drafter):
    """The draft's catch-up pads each row to the longest pending run; a row near the end of its
    budget must not be padded past the cache (the CI failure: position 75 beyond capacity 72)."""
    short, long = random_prompts([3, 30], seed=13)
    engine = Engine(tiny.target, make_drafter(tiny, drafter), FixedK(4))
    out: dict[int, list[int]] = {}
    first = engine.add([Request(short, 40)])
    while engine.active and len(out.get(first[0], [])) < 34:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)
    second = engine.add([Request(long, 4)])  # fits the batch's slots; its catch-up is 30 long
    while engine.active:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)
    assert out[first[0]] == plain_greedy(tiny.target, short, 40)
    assert out[second[0]] == plain_greedy(tiny.target, long, 4)


# ------------------------------------------------------------------ beyond the kernels' size limits
needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.status()}")
JOINING = random_prompts([1, 5, 9, 13, 3, 7], seed=21)


@pytest.fixture(scope="module")
def near_tie(tiny):
    """The tiny target with each odd row of the LM head one ulp (relative) from the even row before
    it: which twin wins is decided by rounding, so a step whose logits differ from a one-token
    step's in the last bit flips tokens (greedy equality cannot hold by luck here)."""
    head = tiny.weights.lm_head.clone()
    head[1::2] = head[0::2] * (1 + 2**-23)
    return LlamaRuntime(replace(tiny.weights, lm_head=head))


def decode_joining(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each request prefilled alone and then joining the batch (how the server adds them), so every
    row's cache is what it would be at batch 1; output tokens per prompt."""
    ids = [engine.add([Request(list(p), max_new_tokens)])[0] for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.active:
        for ev in engine.step():
            out[ev.request_id].extend(ev.tokens)
    return [out[i] for i in ids]


@needs_kernels
@pytest.mark.parametrize("k", [4, 20], ids=["6x5-rows", "21-tokens-per-row"])
@pytest.mark.parametrize("drafter", ["self", "other", "lookup"])
def test_greedy_beyond_the_kernels_limits_equals_plain(tiny, near_tie, monkeypatch, drafter, k):
    """fp32 verification steps of batch x (k + 1) = 30 rows (over the kernels' 16) and of 21 new
    tokens per row (over the fused attention's 16) give plain greedy's tokens, row by row."""
    reference = [plain_greedy(near_tie, p, N) for p in JOINING]
    if drafter == "lookup":
        draft = PromptLookupDrafter()
    else:  # always k tokens: the target itself (mostly accepted) or another model (mostly rejected)
        draft = ModelDrafter(near_tie, "self") if drafter == "self" else ModelDrafter(tiny.other, "other")
    steps = []  # (B, T) of the scoring steps (no logits_index) on the target's weights

    def forward(state, tokens, positions, **kw):
        if kw.get("logits_index") is None:
            steps.append(tokens.shape)
        return LlamaRuntime.forward(near_tie, state, tokens, positions, **kw)

    monkeypatch.setattr(near_tie, "forward", forward)
    assert decode_joining(Engine(near_tie, draft, FixedK(k)), JOINING, N) == reference
    assert max(B * T for B, T in steps) > kernels.MAX_ROWS
    if k == 20 and drafter != "lookup":  # lookup proposes only where the context repeats itself
        assert max(T for _, T in steps) == k + 1 > kernels.MAX_ROWS


@needs_kernels
def test_plain_batch_beyond_the_kernels_limits_equals_batch_one(near_tie):
    """Plain decoding of 18 rows (one-token steps over 18 rows) gives each row its batch-1 tokens."""
    prompts = random_prompts([2 + i % 7 for i in range(18)], seed=22)
    assert decode_joining(Engine(near_tie), prompts, 8) == [plain_greedy(near_tie, p, 8) for p in prompts]
