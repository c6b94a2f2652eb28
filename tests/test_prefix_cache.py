"""The prompt prefix cache (:mod:`specdraft.prefix_cache`): a later prompt that begins with an earlier
row's tokens prefills only the rest, its output and its features as without the cache; entries are
kept least recently used first within the byte budget."""

from __future__ import annotations

import torch

from specdraft.drafters.model import ModelDrafter
from specdraft.engine import Engine, Request
from specdraft.models.llama import LlamaKV, LlamaRuntime
from specdraft.policy import FixedK
from specdraft.prefix_cache import PrefixCache
from tests.helpers import decode, plain_greedy, random_prompts
from tests.test_tv_all_drafters import make_case, peaked


def recorded_forwards(monkeypatch, runtime) -> list[tuple[int, int]]:
    """The (rows, tokens) shape of every forward of ``runtime`` from now on."""
    shapes, forward = [], runtime.forward

    def recording(state, tokens, positions, **kw):
        shapes.append(tuple(tokens.shape))
        return forward(state, tokens, positions, **kw)

    monkeypatch.setattr(runtime, "forward", recording)
    return shapes


def test_a_second_turn_prefills_only_its_new_tokens_and_decodes_as_plain(tiny, monkeypatch):
    cache = PrefixCache(1 << 30, min_tokens=8)
    drafter = ModelDrafter(LlamaRuntime(tiny.weights, [0]), "prune:0")
    engine = Engine(tiny.target, drafter, FixedK(3), prefix_cache=cache)
    first = random_prompts([40], seed=3)[0]
    answer = decode(engine, [first], 20)[0]
    second = first + answer + [7, 8, 9, 10, 11]  # the conversation so far and a new turn
    other = random_prompts([30], seed=4)[0]
    shapes = recorded_forwards(monkeypatch, tiny.target)
    out = decode(engine, [second, other, second], 20)
    assert out == [plain_greedy(tiny.target, p, 20) for p in (second, other, second)]
    # one prefill for the two distinct prompts: the cached one from its first uncached position
    # (len(first) + 19: the last answer token was never fed), the other whole but its last token
    assert shapes[0] == (2, len(other) - 1)
    assert cache.hits == 1 and cache.reused_tokens == len(first) + len(answer) - 1


def test_features_of_a_cached_prompt_are_those_a_whole_prefill_gives():
    target = peaked(seed=10, scale=12.0)
    drafter = make_case("feature", target).drafter
    drafter.prompt_pairs = 3  # the draft reads the prompt's features
    cache = PrefixCache(1 << 30, min_tokens=4)
    engine = Engine(target, drafter, FixedK(2), prefix_cache=cache)
    first = random_prompts([12], seed=5, vocab=target.vocab_size)[0]
    answer = decode(engine, [first], 10)[0]
    second = first + answer + [3, 1, 4]
    fresh = Engine(target, drafter, FixedK(2))
    for e in (engine, fresh):
        e.add([Request(second, 10)])
    assert cache.hits == 1
    P = len(second) - 1  # prefilled positions
    for i, h in fresh.features.hidden.items():
        assert torch.allclose(engine.features.hidden[i][0, :P], h[0, :P], atol=1e-5)
    out = [[t for ev in _drain(e) for t in ev.tokens] for e in (engine, fresh)]
    assert out[0] == out[1] == plain_greedy(target, second, 10)


def _drain(engine: Engine):
    while engine.active:
        yield from engine.step()


def _kv(n: int, fill: float) -> LlamaKV:
    kv = LlamaKV(2, 1, 1, n, 4, torch.float32)
    for t in (*kv.k, *kv.v):
        t.fill_(fill)
    return kv


def test_entries_are_kept_least_recently_used_first_within_the_budget():
    per_token = 2 * 2 * 4 * 4  # layers x (k, v) x head_dim x bytes
    cache = PrefixCache(max_bytes=25 * per_token, min_tokens=4)
    cache.store([1] * 10, _kv(10, 1.0), 0, {})
    cache.store([2] * 10, _kv(10, 2.0), 0, {})
    assert cache.match([1] * 12)[1] == 10  # [1] * 10 is now the most recently used
    cache.store([3] * 10, _kv(10, 3.0), 0, {})  # over the budget: [2] * 10 goes
    assert cache.nbytes <= cache.max_bytes and cache.match([2] * 10) == (None, 0)
    cache.store([3] * 10 + [4] * 2, _kv(12, 3.0), 0, {})  # extends [3] * 10, which is dropped
    assert sorted(e.tokens[0] for e in cache.entries.values()) == [1, 3]
    cache.store([5] * 3, _kv(3, 5.0), 0, {})  # below min_tokens: not kept
    assert cache.match([5] * 3) == (None, 0) and cache.match([1, 1, 1]) == (None, 0)
    entry, n = cache.match([3] * 10 + [4, 9])
    kv = _kv(16, 0.0)
    cache.fill(entry, n, kv, 0)
    assert n == 11 and kv.k[0][0, :, :n].eq(3.0).all() and kv.k[0][0, :, n:].eq(0.0).all()
