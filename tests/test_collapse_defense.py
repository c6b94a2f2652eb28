"""The defense against acceleration-collapse inputs (issue 17): with ``--k auto`` a row whose drafts
are always rejected drops to 0 draft tokens within a few steps, costs about what plain decoding
costs, leaves the other rows of its batch drafting, recovers when its drafts are right again, and
is flagged as collapsed (the others are not). Target work is counted (rows verified with drafts,
tokens fed), never timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.drafters.adversarial import WrongRows
from specdraft.drafters.base import DraftState, Proposal
from specdraft.engine import Engine, Request
from specdraft.errors import SpecdraftError
from specdraft.policy import CappedPolicy, CostAwareK, FixedK, RowWatch, binomial_cdf
from specdraft.server.metrics import Metrics
from specdraft.stats import SpecStats
from tests.helpers import plain_greedy

V = 256
N = 96  # new tokens per prompt
PROMPTS = [[10 + i, 40, 41, 42, 43 + i] for i in range(4)]


class Oracle:
    """Proposes plain greedy decoding's own continuation (free and always right), from a table of
    reference outputs keyed by prompt."""

    name = "oracle"
    vocab_size = None

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]):
        self.table = {tuple(p): p + o for p, o in zip(prompts, outputs)}
        self.plen = len(prompts[0])

    def new_state(self, batch_size, capacity):
        return DraftState(batch_size)

    def propose(self, state, ctx, k):
        B = ctx.tokens.shape[0]
        tokens = torch.zeros(B, k, dtype=torch.int64)
        for b in range(B):
            full = self.table[tuple(ctx.tokens[b, : self.plen].tolist())]
            L = int(ctx.lengths[b])
            nxt = full[L : L + k]
            tokens[b, : len(nxt)] = torch.tensor(nxt, dtype=torch.int64)
        return Proposal(tokens)

    def observe(self, state, num_accepted, verified=None):
        pass


class Recording(CostAwareK):
    """The default ``--k auto`` policy, recording per request id how many draft tokens each step
    verified (0 at the steps that drafted nothing). It is fed a steady clock (a free draft, a
    verification that costs 1% more per token fed) so that its choices depend on acceptance only:
    at such costs even a poor acceptance pays for the batch, and only the rows' watch stops."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.verified: dict[int, list[int]] = {}

    def choose(self, rows=None, lag=None):
        for r in rows:
            self.verified.setdefault(r, []).append(0)
        return super().choose(rows)

    def trim(self, num_valid, bucket, rows=None):
        out = super().trim(num_valid, bucket, rows)
        for r, n in zip(rows, out.tolist()):
            self.verified[r][-1] = n
        return out

    def update(self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None):
        n = int(num_drafted.max()) if num_drafted.numel() else 0
        super().update(k, num_drafted, num_accepted, 0.0, 1.0 + 0.01 * n, bucket, rows)


@pytest.fixture(scope="module")
def reference(tiny):
    return [plain_greedy(tiny.target, p, N + 16) for p in PROMPTS]


def run(engine: Engine, prompts: list[list[int]], steps: int | None = None) -> tuple[list[int], dict]:
    """Add the prompts (N new tokens each) and step (to the end, or ``steps`` times); their ids and
    the output tokens by id."""
    ids = engine.add([Request(list(p), N) for p in prompts])
    out: dict[int, list[int]] = {}
    while engine.active and steps != 0:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)
        steps = None if steps is None else steps - 1
    return ids, out


def finish(engine: Engine, out: dict) -> None:
    """Step to the end, adding the tokens to ``out`` (by request id)."""
    while engine.active:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)


def probe_bound(steps: int, policy: CostAwareK) -> int:
    """Probes a row that is off can make in ``steps`` steps: intervals probe_every, doubling."""
    n, t, interval = 0, 0, policy.probe_every
    while t + interval <= steps:
        t, n, interval = t + interval, n + 1, min(2 * interval, policy.probe_max)
    return n


def test_an_always_wrong_drafter_costs_about_plain_decoding(tiny, reference):
    """Every row spoiled: after at most three rejected proposals a row is off; the rest are probes.
    Each step still emits one token (the target's own), so target forwards equal plain decoding's
    and the tokens fed beyond plain decoding's are bounded by those few proposals and probes."""
    policy = Recording()
    drafter = WrongRows(Oracle(PROMPTS, reference), PROMPTS, V)
    engine = Engine(tiny.target, drafter, policy)
    ids, out = run(engine, PROMPTS)
    assert [out[i] for i in ids] == [r[:N] for r in reference]
    assert engine.stats.target_forwards == N and engine.stats.accepted == 0
    # detection is relative to the drafter's running average: with no clean traffic yet, none
    assert engine.collapsed == set()
    switch_off = 3  # proposals before a row with no acceptance is off (RowWatch: decay 0.8, evidence 2)
    for i in ids:
        drafted_steps = sum(n > 0 for n in policy.verified[i])
        assert drafted_steps <= switch_off + probe_bound(N, policy), policy.verified[i]
    extra = sum(engine.stats.k_history)  # tokens fed per row beyond plain decoding's one per step
    assert extra <= switch_off * policy.k_max + probe_bound(N, policy) * policy.probe_k
    # no draft work either once every row is off: the drafter is asked only for the probes
    asked = sum(1 for k in engine.stats.k_history if k > 0)
    assert asked <= switch_off + probe_bound(N, policy) + 1

    # after clean traffic has set the average, the same spoiled batch is flagged, row by row (a
    # binomial test: a drafter that is not free proposes only at its probes, and 96 steps hold too
    # few for the default's spread of acceptance between requests: tests/attack/test_detection.py)
    policy.watch = RowWatch(detect_concentration=None, detect_alpha=0.01)
    engine = Engine(tiny.target, Oracle(PROMPTS, reference), policy)
    run(engine, PROMPTS)
    assert engine.collapsed == set()
    engine = Engine(tiny.target, drafter, policy)
    ids, out = run(engine, PROMPTS)
    assert [out[i] for i in ids] == [r[:N] for r in reference]
    assert engine.collapsed == set(ids) and engine.stats.collapsed == 4


def test_the_batch_wide_policy_keeps_paying_for_an_always_wrong_drafter(tiny, reference):
    """Without per-row watching, with a free drafter and a cheap verification the class curve alone
    does not reach k = 0: the check above measures the defense, not a property of the drafter (nor
    the safe arm's realised-rate check, off here too: tests/test_policy_guard.py)."""
    policy = Recording(watch=None, guard=None)
    drafter = WrongRows(Oracle(PROMPTS, reference), PROMPTS, V)
    engine = Engine(tiny.target, drafter, policy)
    ids, out = run(engine, PROMPTS)
    assert [out[i] for i in ids] == [r[:N] for r in reference]
    for i in ids:
        assert sum(n > 0 for n in policy.verified[i]) > 0.5 * N
    assert engine.collapsed == set()  # nothing watched, nothing flagged


def test_clean_rows_keep_drafting_next_to_spoiled_rows(tiny, reference):
    """A batch of 4 with rows 1 and 3 spoiled: the clean rows verify drafts at (almost) every step
    and accept them all, as in an all-clean batch; the spoiled rows stop; only they are flagged."""
    engine = Engine(tiny.target, Oracle(PROMPTS, reference), Recording())
    run(engine, PROMPTS)
    clean_forwards = engine.stats.target_forwards

    policy = Recording()
    engine = Engine(tiny.target, WrongRows(Oracle(PROMPTS, reference), [PROMPTS[1], PROMPTS[3]], V), policy)
    ids, out = run(engine, PROMPTS)
    assert [out[i] for i in ids] == [r[:N] for r in reference]
    good, bad = [ids[0], ids[2]], [ids[1], ids[3]]
    for i in good:
        steps = policy.verified[i]
        assert sum(n > 0 for n in steps) >= 0.8 * len(steps), steps
    for i in bad:
        assert sum(n > 0 for n in policy.verified[i]) <= 3 + probe_bound(N, policy), policy.verified[i]
    # the clean rows finish in about as many forwards as an all-clean batch (their tokens per step)
    good_steps = [len(policy.verified[i]) for i in good]
    assert max(good_steps) <= 1.1 * clean_forwards + 2, (good_steps, clean_forwards)
    assert engine.collapsed == set(bad)
    assert engine.stats.collapsed == 2


def test_a_row_recovers_when_its_drafts_are_right_again(tiny, reference):
    policy = Recording()
    drafter = WrongRows(Oracle(PROMPTS, reference), PROMPTS[:1], V)
    engine = Engine(tiny.target, drafter, policy)
    ids, out = run(engine, PROMPTS[:1], steps=20)
    row = policy.row_state[ids[0]]
    assert row.off  # switched off by its rejected drafts
    drafter.enabled = False  # the drafts are right again
    finish(engine, out)
    assert out[ids[0]] == reference[0][:N]
    after = policy.verified[ids[0]][20:]
    # the next probe (within the current probe interval) is accepted and the row drafts again
    first = next(j for j, n in enumerate(after) if n > 0)
    assert first <= row.probe_interval + 1
    assert sum(n > 0 for n in after[first:]) >= 0.8 * len(after[first:]), after
    assert engine.stats.accepted > 0


class FreeOracle(Oracle):
    """The oracle as a free drafter (a table lookup: no model, no state, no randomness), as prompt
    lookup is: the engine proposes for rows that are off too (``proposes_free``)."""

    proposes_free = True


@pytest.mark.parametrize("free", [False, True])
def test_a_free_drafters_off_rows_are_watched_at_every_step(tiny, reference, free):
    """A spoiled row goes off after three rejections either way and verifies no more than its
    probes. With a free drafter the engine still proposes for it at every step, verifies none of
    it, and tells the policy how each first token fared: the row's record grows by a proposal per
    step (the evidence detection needs), and the first step its drafts are right again puts it
    back on, where a drafter that is not free waits for its next probe."""
    policy = Recording()
    drafter = WrongRows((FreeOracle if free else Oracle)(PROMPTS, reference), PROMPTS[:1], V)
    engine = Engine(tiny.target, drafter, policy)
    ids, out = run(engine, PROMPTS[:1], steps=30)
    row = policy.row_state[ids[0]]
    assert row.off and row.hits == 0
    verified = sum(n > 0 for n in policy.verified[ids[0]])
    assert verified <= 3 + probe_bound(30, policy), policy.verified[ids[0]]
    assert row.proposals >= 29 if free else row.proposals == verified
    drafter.enabled = False  # right again
    finish(engine, out)
    assert out[ids[0]] == reference[0][:N]
    after = policy.verified[ids[0]][30:]
    first = next(j for j, n in enumerate(after) if n > 0)
    assert first == 1 if free else first > 1, after  # the shadow hit at step 0 switches it on
    assert sum(n > 0 for n in after[first:]) >= 0.8 * len(after[first:]), after


def test_a_row_goes_off_after_a_run_of_rejections_rare_for_its_drafter():
    """Average acceptance 0.5: three rejections in a row (one row in eight) keep a row on, six
    ((1 - 0.5)^6 < off_alpha = 0.02) switch it off; cold, three do, as does a run of off_max."""

    def rejections(p: CostAwareK, run: int, warm: bool) -> bool:
        rows = [1, 2]
        for i in range(40 if warm else 0):  # row 2 alone sets the average: accepted every other time
            p.choose([2])
            p.update(1, torch.tensor([1]), torch.tensor([i % 2]), 1e-4, 0.01, None, [2])
        for _ in range(run):
            p.choose(rows)
            p.update(1, torch.tensor([1, 1]), torch.tensor([0, 1]), 1e-4, 0.01, None, rows)
        return p.row_state[1].off

    assert not rejections(CostAwareK(), 3, warm=True)
    assert rejections(CostAwareK(), 6, warm=True)
    assert rejections(CostAwareK(), 3, warm=False)
    assert rejections(CostAwareK(watch=RowWatch(off_max=3)), 3, warm=True)
    with pytest.raises(SpecdraftError, match="off_alpha"):
        RowWatch(off_alpha=0.0)


def test_detection_flags_implausibly_low_acceptance_only():
    """The rule of :class:`RowWatch`: far below the drafter's average and unlikely under it (as a
    binomial here: 60 steps of probes hold too few proposals for the default's spread between
    requests, replayed in tests/attack/test_detection.py)."""
    p = CostAwareK(watch=RowWatch(detect_concentration=None, detect_alpha=0.01))
    g = torch.Generator().manual_seed(0)
    rows = [1, 2, 3]
    for _ in range(60):
        p.choose(rows)
        nv = p.trim(torch.tensor([2, 2, 2]), None, rows)
        hit = (torch.rand(2, generator=g) < 0.6).long()  # rows 1, 2: accepted 60% of the time
        acc = torch.stack([hit[0], hit[1], torch.tensor(0)]) * 2 * (nv > 0)  # row 3: never
        p.update(2, nv, torch.minimum(acc, nv), 1e-4, 0.01, None, rows)
    assert p.collapsed == {3}
    assert p.row_state[3].off and not p.row_state[1].off
    # unlucky is not collapsed: 1 hit in 5 at p = 0.6 has probability 0.087
    assert binomial_cdf(1, 5, 0.6) == pytest.approx(0.087, abs=1e-3)
    # rows that leave are forgotten, flag included
    p.choose([1])
    assert set(p.row_state) == {1} and p.collapsed == set()


def test_fixed_policies_watch_nothing_and_caps_pass_the_rows_on():
    assert FixedK(3).collapsed == frozenset() and FixedK(3).trim(torch.tensor([3]), None, [7]).tolist() == [3]
    capped = CappedPolicy(CostAwareK())
    capped.choose([5])
    assert 5 in capped.inner.row_state and capped.collapsed is capped.inner.collapsed
    with pytest.raises(SpecdraftError):
        RowWatch(decay=1.0)


def test_metrics_count_collapsed_requests():
    m = Metrics()
    m.observe_step(SpecStats(collapsed=2))
    m.observe_step(SpecStats())
    text = m.render().decode()
    assert "specdraft:spec_decode_collapsed_requests_total 2.0" in text


def test_wrong_rows_shifts_the_chosen_rows_tokens_with_their_distribution_and_read_backs():
    class Fixed:
        name, vocab_size = "fixed", 4

        def new_state(self, batch_size, capacity):
            return DraftState(batch_size)

        def propose(self, state, ctx, k):
            probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).expand(2, k, 4)
            seen = [[True, False], [True, True]]  # read-backs: row 1's draft was right at both
            return Proposal(torch.tensor([[3, 1], [3, 1]])[:, :k], probs, hindsight=seen)

    ctx = SimpleNamespace(tokens=torch.tensor([[5, 6, 0], [7, 8, 0]]), lengths=torch.tensor([2, 2]))
    wrong = WrongRows(Fixed(), [[7, 8]], 4)
    state = wrong.new_state(2, 3)
    prop = wrong.propose(state, ctx, 2)
    assert prop.tokens.tolist() == [[3, 1], [0, 2]]  # row 1 shifted, wrapping at the vocabulary
    q = prop.probs.gather(-1, prop.tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(q, torch.tensor([[0.4, 0.2], [0.4, 0.2]]))  # each token keeps its own q
    assert prop.hindsight == [[True, False], [False, False]]  # read-backs of the shifted draft: misses
    # the verdict is each row's, kept as rows leave and join (decided at a row's first proposal)
    state.select_rows(torch.tensor([1]))
    state.append(wrong.new_state(1, 3))
    ctx = SimpleNamespace(tokens=torch.tensor([[7, 8, 0], [5, 6, 0]]), lengths=torch.tensor([2, 2]))
    assert wrong.propose(state, ctx, 2).tokens.tolist() == [[0, 2], [3, 1]]


def test_rows_that_never_hit_do_not_teach_the_class_curve():
    """A row's misses wait until one of its drafts is accepted; a row that goes off first drops
    them, so a spoiled row does not pull down the curve the clean rows are cut with."""
    p = CostAwareK()
    rows = [1, 2]
    for _ in range(4):
        p.choose(rows)
        nv = p.trim(torch.tensor([2, 2]), None, rows)
        p.update(2, nv, torch.tensor([2, 0]) * (nv > 0), 1e-4, 0.01, None, rows)
    assert p.row_state[2].off and p.row_state[2].pending == []
    assert p.rates()[0] > 0.8  # row 1's hits only (row 2's three misses would bring it near 0.5)
    p.choose([3])
    p.update(2, torch.tensor([2]), torch.tensor([0]), 1e-4, 0.01, None, [3])
    assert p.row_state[3].pending == [(None, 2, 0)]
    p.update(2, torch.tensor([2]), torch.tensor([1]), 1e-4, 0.01, None, [3])
    assert p.row_state[3].pending == [] and p.rates()[0] < 0.8  # taught, miss included, after its hit


def test_off_rows_of_a_batch_that_drafts_are_watched_at_every_step(tiny, reference):
    """A drafter that is not free proposes for every row of a batch whenever the batch drafts (here
    for its clean row): a spoiled row that is off is told how its unverified first token fared at
    each such step, so its record grows by a proposal per step (the evidence detection needs) while
    it verifies no more than its probes. Its greedy output is plain decoding's."""
    policy = Recording(k_max=1, k_start=1, probe_k=1)  # the clean row decodes 2 tokens a step: 48 steps
    drafter = WrongRows(Oracle(PROMPTS[:2], reference[:2]), PROMPTS[:1], V)
    engine = Engine(tiny.target, drafter, policy)
    ids, out = run(engine, PROMPTS[:2], steps=40)
    row = policy.row_state[ids[0]]
    verified = sum(n > 0 for n in policy.verified[ids[0]])
    assert row.off and row.hits == 0 and not policy.row_state[ids[1]].off
    assert verified <= 3 + probe_bound(40, policy), policy.verified[ids[0]]
    assert row.proposals >= 39, row.proposals
    finish(engine, out)
    assert [out[i] for i in ids] == [r[:N] for r in reference[:2]]
