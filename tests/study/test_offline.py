"""Offline acceptance: exact against real engine runs, replay arithmetic, quality, the cache."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft import api
from specdraft.stats import SpecStats
from specdraft.study import offline
from specdraft.study.offline import (
    OfflineProposals,
    Sequence,
    cached_continuations,
    draft_quality,
    offline_proposals,
    simulate,
)

PROMPTS = [
    "hello there, how are you",
    "the cat sat on the mat and the",
    "one two three one two three one",
    "abcabc",
]
N = 40


@pytest.fixture(scope="module")
def setup(tiny_pipe):
    prompts = [list(p.encode()) for p in PROMPTS]  # the tiny tokenizer is byte-level
    conts = offline.generate_continuations(tiny_pipe.runtime, prompts, N, tiny_pipe.eos_ids, batch_size=1)
    return tiny_pipe, [Sequence(p, c) for p, c in zip(prompts, conts)]


def _online(pipe, drafter, seqs, k, batch):
    pipe = api.Pipeline(pipe.target, pipe.runtime, drafter, drafter.name)
    stats = SpecStats()
    outs = []
    for s in range(0, len(seqs), batch):
        o, st = api.run_batch(pipe, [q.prompt for q in seqs[s : s + batch]], max_new_tokens=N, k=k)
        outs += o
        stats.merge(st)
    return outs, stats


@pytest.mark.parametrize("spec", ["prune:1", "lookup"])
@pytest.mark.parametrize("k,batch", [(1, 1), (3, 1), (8, 1), (3, 2), (5, 4)])
def test_offline_acceptance_equals_engine_runs(setup, spec, k, batch):
    pipe, seqs = setup
    drafter = api.make_drafter(spec, pipe.target, pipe.runtime, torch.float32)
    props = [offline_proposals(drafter, s, 8) for s in seqs]  # one pass at k_max = 8, reused for every k
    sim = simulate(props, k, batch)
    outs, stats = _online(pipe, drafter, seqs, k, batch)
    assert outs == [s.continuation for s in seqs]  # greedy: the engine reproduces the cached text
    assert (sim.row_steps, sim.generated) == (stats.steps, stats.generated)
    # only a row's last step can differ: the engine verifies drafts past the last kept token, the
    # cache ends there
    assert 0 <= stats.accepted - sim.accepted <= len(seqs)
    assert sim.mean_accepted_length == pytest.approx(stats.mean_accepted_length, abs=len(seqs) / stats.steps)
    assert len(sim.steps) == stats.target_forwards
    # the batched step widths are what the target scored: k for a model draft, the widest lookup
    assert [s.width for s in sim.steps] == stats.k_history


def test_self_draft_accepts_everything(setup):
    pipe, seqs = setup
    drafter = api.make_drafter("self", pipe.target, pipe.runtime, torch.float32)
    p = offline_proposals(drafter, seqs[0], 4)
    n = len(seqs[0].continuation)
    assert p.matched == [min(4, n - i) for i in range(n)]
    q = draft_quality([p])
    assert q.top1_agreement == 1.0 and q.perplexity >= 1.0
    assert simulate([p], 4, 1).mean_accepted_length == pytest.approx(5.0, abs=0.5)


def test_quality_is_the_perplexity_of_the_continuation(setup):
    pipe, seqs = setup
    drafter = api.make_drafter("prune:0", pipe.target, pipe.runtime, torch.float32)
    s = seqs[1]
    p = offline_proposals(drafter, s, 2)
    full = torch.tensor([s.prompt + s.continuation])
    logits = drafter.runtime.forward(
        drafter.runtime.new_state(1, full.shape[1] + 1), full, torch.arange(full.shape[1]).unsqueeze(0)
    ).logits[0]
    P = len(s.prompt)
    logp = torch.log_softmax(logits[P - 1 : -1], -1)
    nll = -logp.gather(1, torch.tensor(s.continuation).unsqueeze(1)).mean()
    assert draft_quality([p]).perplexity == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert draft_quality([OfflineProposals(3, [0], [0])]) is None  # lookup: no distribution


def test_simulate_replays_steps_by_hand():
    # two rows; row 0 has 5 tokens, row 1 has 3
    a = OfflineProposals(prompt_len=10, matched=[2, 0, 1, 0, 0], valid=[4, 4, 4, 4, 4])
    b = OfflineProposals(prompt_len=20, matched=[3, 2, 1], valid=[4, 4, 4])
    sim = simulate([a, b], k=2, batch=2)
    # step 1: a accepts 2 -> emits 3 (pos 3); b accepts 2 (capped at k) -> emits 3 = all its tokens
    # step 2: a at pos 3 accepts 0 -> emits 1 (pos 4); b finished
    # step 3: a at pos 4: last token, emits 1
    assert [(s.rows, s.width, s.context, s.emitted, s.first) for s in sim.steps] == [
        (2, 2, 20, 6, True),
        (1, 2, 13, 1, False),
        (1, 2, 14, 1, False),
    ]
    assert (sim.generated, sim.accepted, sim.row_steps, sim.drafted) == (8, 4, 4, 8)
    # batch 1: separate groups, each starts with a 'first' step
    assert sum(s.first for s in simulate([a, b], 2, 1).steps) == 2


def test_simulate_lookup_width_is_the_widest_proposal():
    a = OfflineProposals(5, matched=[0, 0, 0], valid=[0, 3, 1])
    b = OfflineProposals(5, matched=[1, 0, 0], valid=[1, 0, 0])
    sim = simulate([a, b], k=2, batch=2)
    assert [s.width for s in sim.steps] == [1, 2, 1]
    assert sim.drafted == (0 + 1) + (2 + 0) + 1  # per step: row a + row b


def test_simulate_rejects_bad_arguments():
    from specdraft.errors import SpecdraftError

    with pytest.raises(SpecdraftError):
        simulate([], -1, 1)
    with pytest.raises(SpecdraftError):
        simulate([], 1, 0)


def test_continuations_are_cached(tmp_path, tiny_pipe, monkeypatch):
    prompts = [list(b"cache me"), list(b"and me too")]
    first = cached_continuations(
        tiny_pipe.runtime, prompts, 12, tiny_pipe.eos_ids, target="tiny", dtype="fp32", cache_dir=tmp_path
    )
    assert len(list(tmp_path.glob("*.json"))) == 1

    def boom(*a, **k):
        raise AssertionError("the target ran again")

    monkeypatch.setattr(offline, "generate_continuations", boom)
    again = cached_continuations(
        tiny_pipe.runtime, prompts, 12, tiny_pipe.eos_ids, target="tiny", dtype="fp32", cache_dir=tmp_path
    )
    assert [s.continuation for s in again] == [s.continuation for s in first]
    with pytest.raises(AssertionError, match="ran again"):  # another length is another key
        cached_continuations(
            tiny_pipe.runtime, prompts, 13, tiny_pipe.eos_ids, target="tiny", dtype="fp32", cache_dir=tmp_path
        )
    # a damaged cache file is regenerated, not trusted
    monkeypatch.undo()
    next(tmp_path.glob("*.json")).write_text("{not json")
    redone = cached_continuations(
        tiny_pipe.runtime, prompts, 12, tiny_pipe.eos_ids, target="tiny", dtype="fp32", cache_dir=tmp_path
    )
    assert [s.continuation for s in redone] == [s.continuation for s in first]
