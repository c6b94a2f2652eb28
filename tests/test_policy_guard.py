"""The safe arm (:class:`specdraft.policy.SafeArm`, issue 17): whatever the cost-aware policy's model
of T(n) and acceptance predicts, speculation whose realised speed falls below plain decoding's is
switched off for a back-off that doubles, and tried again; it never costs more than its trials.

Steps run against a synthetic world on a fake clock (no model): each draft token survives with
probability alpha, a step truly costs ``k t_draft + T1 (1 + slope n)`` for n tokens fed per row
beyond the first, and the policy may be told a different slope (its model fooled). The last test
runs every drafter kind through an engine whose speculative steps are made slow on the clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdraft.engine import Engine, Request, decode_requests
from specdraft.errors import SpecdraftError
from specdraft.policy import CappedPolicy, CostAwareK, FixedK, SafeArm
from specdraft.verify import SamplingParams
from tests.test_tv_all_drafters import CASES, PROMPT, make_case, peaked

T1 = 0.010  # a plain step's seconds
T_DRAFT = 0.0005  # one draft token's


class Clock:
    """A fake clock the tests move."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class World:
    """B rows drafting with acceptance ``alpha`` per token; verification costs ``slope`` T1 per extra
    token fed per row, and the policy is told ``told`` (None: the truth) and ``told_draft`` seconds
    per draft token; a speculative step also takes ``extra`` seconds the policy is not told of (as a
    model draft's catch-up on the tokens plain steps committed)."""

    B: int
    alpha: float
    slope: float
    told: float | None = None
    told_draft: float = T_DRAFT
    extra: float = 0.0


@dataclass
class Run:
    B: int
    seconds: float = 0.0
    tokens: int = 0
    spec_steps: int = 0  # steps that drafted (the policy asked for k > 0)

    @property
    def vs_plain(self) -> float:
        """Speed against plain decoding (B rows, one token each per T1)."""
        return self.tokens * T1 / self.B / self.seconds


def simulate(policy, clock: Clock, world: World, steps: int, seed: int = 0, run: Run | None = None) -> Run:
    g = torch.Generator().manual_seed(seed)
    run = run or Run(world.B)
    rows = list(range(world.B))
    for _ in range(steps):
        k = policy.choose(rows)
        nv = torch.zeros(world.B, dtype=torch.int64)
        if k:
            nv = policy.trim(torch.full((world.B,), k), None, rows)
        n = int(nv.max())
        survive = (torch.rand(world.B, max(n, 1), generator=g) < world.alpha).to(torch.int64).cumprod(1)
        accepted = (survive[:, :n] * (torch.arange(n) < nv.unsqueeze(1))).sum(1)  # (B,)
        told = world.slope if world.told is None else world.told
        seconds = k * T_DRAFT + T1 * (1 + world.slope * n) + (world.extra if k else 0.0)
        clock.t += seconds
        policy.update(k, nv, accepted, k * world.told_draft, T1 * (1 + told * n), None, rows)
        run.seconds += seconds
        run.tokens += int(accepted.sum()) + world.B
        run.spec_steps += k > 0
    return run


def trials(steps: int, arm: SafeArm) -> int:
    """Speculative windows an always-losing speculation can get in ``steps``: the first, and one
    after each back-off (doubling) that fits."""
    n, t, backoff = 1, 0, arm.backoff
    while t + backoff < steps:
        t, n, backoff = t + backoff, n + 1, min(2 * backoff, arm.backoff_max)
    return n


def guarded(clock: Clock, **kw) -> CostAwareK:
    return CostAwareK(k_max=8, guard=SafeArm(clock=clock), **kw)


@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("watch", [True, False])
def test_an_always_wrong_drafter_costs_at_most_the_trials(B, watch):
    """No draft is ever accepted, and the model is told drafting is free and verification nearly
    so (without the row watch, it keeps drafting): every speculative step is lost, and the safe
    arm bounds the loss by its trials: per trial at most ``max_loss`` plain steps, plus the step
    that crosses it."""
    steps = 400
    clock = Clock()
    policy = guarded(clock) if watch else guarded(clock, watch=None)
    world = World(B, alpha=0.0, slope=0.25, told=0.01, told_draft=0.0)
    run = simulate(policy, clock, world, steps)
    arm = policy.rate.arm
    worst_extra = 8 * T_DRAFT + T1 * 0.25 * 8  # a lost step at k_max
    assert run.seconds <= steps * T1 + trials(steps, arm) * (arm.max_loss * T1 + worst_extra) + 1e-9
    assert run.tokens == steps * B and run.vs_plain > 0.9
    if not watch:  # the check above is the safe arm's: the model alone keeps paying
        clock = Clock()
        alone = simulate(CostAwareK(k_max=8, watch=None, guard=None), clock, world, steps)
        assert alone.spec_steps > steps / 2 and alone.vs_plain < 0.8


def test_probes_are_left_out_of_the_verdict():
    """Once the model says k = 0 (acceptance 0.05), it still probes on its schedule, and here each
    probe also pays three plain steps' time it is not told of (a feature draft catching up after a
    stretch without drafts). Probes are exploration, spaced by their price
    (:meth:`CostAwareK._probe_wait`): they do not count as lost speculation, so they start no
    back-off (which would also hold back the next probe that finds a paying stretch); before, two
    of them did. What they cost stays within the probe schedule's bound."""
    clock = Clock()
    policy = guarded(clock, watch=None)
    simulate(policy, clock, World(1, alpha=0.05, slope=0.25), 100)
    before = policy.rate.fallbacks
    run = simulate(policy, clock, World(1, alpha=0.05, slope=0.25, extra=3 * T1), 500)
    assert run.spec_steps >= 5 and policy.rate.fallbacks == before, (run, policy.rate.fallbacks)
    assert run.vs_plain > 0.9


@pytest.mark.parametrize("B", [1, 8])
def test_speculation_the_profile_says_pays_but_the_clock_says_loses_is_switched_off(B):
    """Acceptance 0.6 is real, but verification costs half a step per extra token while the model
    is told 2%: the model drafts long, the clock shows it slower than plain, the safe arm falls back."""
    steps = 600
    world = World(B, alpha=0.6, slope=0.5, told=0.02)
    clock = Clock()
    fooled = simulate(CostAwareK(k_max=8, guard=None), clock, world, steps)
    assert fooled.vs_plain < 0.8  # the model alone loses
    clock = Clock()
    policy = guarded(clock)
    run = simulate(policy, clock, world, steps)
    assert policy.rate.fallbacks >= 1
    assert run.vs_plain > 0.9


@pytest.mark.parametrize("B", [1, 8])
def test_a_few_very_slow_steps_are_a_verdict_without_more_evidence(B):
    """Each speculative step also takes 10 plain steps' time the model does not see (a draft
    catching up): the first such step loses more than max_loss plain steps, so each window ends after
    one step. In 400 steps: windows at 0, then after back-offs of 16, 32, 64 and 128 plain steps,
    one step each."""
    steps = 400
    world = World(B, alpha=0.6, slope=0.05, extra=10 * T1)
    clock = Clock()
    policy = guarded(clock, watch=None)
    run = simulate(policy, clock, world, steps)
    assert policy.rate.fallbacks == run.spec_steps == 5
    assert run.vs_plain > 0.85
    clock = Clock()  # without the loss bound: no verdict at all
    patient = CostAwareK(k_max=8, watch=None, guard=SafeArm(clock=clock, max_loss=1e9))
    assert simulate(patient, clock, world, steps).vs_plain < 0.7


def test_speculation_that_pays_stays_on_and_recovers_after_a_collapse():
    """Clean traffic (acceptance 0.8, cheap verification) speculates nearly every step, the safe
    arm's refresh steps aside; a collapse (nothing accepted) switches it off; when acceptance
    returns, a trial after the back-off pays and speculation resumes."""
    clock = Clock()
    policy = guarded(clock, watch=None)
    clean = World(1, alpha=0.8, slope=0.05)
    first = simulate(policy, clock, clean, 300)
    assert first.spec_steps > 0.9 * 300 and first.vs_plain > 2.0 and policy.rate.fallbacks == 0
    simulate(policy, clock, World(1, alpha=0.0, slope=0.05, told=0.0), 300, seed=1)
    assert policy.rate.fallbacks >= 1
    simulate(policy, clock, clean, 300, seed=2)  # recovering
    late = simulate(policy, clock, clean, 300, seed=3)
    assert late.spec_steps > 0.9 * 300 and late.vs_plain > 2.0


def test_speculation_a_little_ahead_is_not_ended_by_its_stretches_of_rejections():
    """Acceptance 0.35 at k = 1 costs a quarter more than a plain step: about 8% ahead on average,
    with stretches of rejected drafts that lose for a while (the model is told drafting is free, so
    it always drafts: this is the safe arm's verdict alone). The CUSUM falls back only after a
    stretch that loses ``max_loss`` plain steps net (16 rejections in a row, or a longer stretch
    with few hits): over 6 runs of 600 steps, at most one fall-back per run on average, and every
    run speculates on 90% of its steps. The verdict before it (a decayed ratio judged at every
    step) fell back 4 to 13 times per run on these seeds (``results/policy-cusum-2026-12-05/sim.txt``)."""
    world = World(1, alpha=0.35, slope=0.2, told=0.0, told_draft=0.0)
    fallbacks = 0
    for seed in range(6):
        clock = Clock()
        policy = CostAwareK(k_max=1, k_start=1, probe_k=1, watch=None, guard=SafeArm(clock=clock))
        run = simulate(policy, clock, world, 600, seed=seed)
        fallbacks += policy.rate.fallbacks
        assert run.spec_steps > 0.9 * 600 and run.vs_plain > 1.03, (seed, run)
    assert fallbacks <= 6, fallbacks


def test_batch_size_bands_are_judged_apart():
    """Speculation that loses at batch 8 (verification dear there) is switched off at batch 8 only;
    batch 1, where it pays, keeps drafting."""
    clock = Clock()
    policy = guarded(clock, watch=None)
    simulate(policy, clock, World(8, alpha=0.6, slope=0.5, told=0.02), 200)
    assert policy.rate.fallbacks >= 1
    one = simulate(policy, clock, World(1, alpha=0.8, slope=0.05), 100)
    assert one.spec_steps > 80 and policy.rate.speedup(1) > 1.5
    assert policy.rate.speedup(8) < 1.0


def test_plain_step_times_of_sizes_not_measured_are_read_on_the_safe_side():
    """Rows leaving or joining a batch need no new plain step: a size not measured is read on the
    line between the measured ones, flat above them, proportional below them (never more than a
    plain step costs when its time grows with B and its time per row falls: speculation is judged
    harder, never easier)."""
    clock = Clock()
    policy = guarded(clock, watch=None)
    assert policy.rate.plain_time(4) is None
    assert policy.choose(list(range(4))) == 0  # no plain time at all: a plain step first
    for B, seconds in ((4, 0.016), (8, 0.024)):
        clock.t += seconds
        policy.update(0, torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64), 0.0, seconds)
        policy.rate.allows(8)  # the next step's start
    assert policy.rate.plain_time(6) == pytest.approx(0.020)
    assert policy.rate.plain_time(12) == pytest.approx(0.024)
    assert policy.rate.plain_time(2) == pytest.approx(0.008)
    forced = policy.rate.forced
    for B in (2, 6, 12):
        policy.choose(list(range(B)))
    assert policy.rate.forced == forced  # no plain step imposed for them


def test_safe_arm_settings_are_checked():
    for bad in (
        {"evidence": 0},
        {"backoff": 0},
        {"backoff": 8, "backoff_max": 4},
        {"decay": 1.0},
        {"margin": 1.0},
        {"max_loss": 0.0},
    ):
        with pytest.raises(SpecdraftError):
            SafeArm(**bad)


class SlowSpeculation(CostAwareK):
    """The cost-aware policy (no row watch) told that drafting is free and verification flat, so
    that it keeps drafting, on a fake clock where a plain step takes a second and a step that
    drafted k_max + 2: slower than plain even when every draft is accepted."""

    def __init__(self, clock: Clock, k_max: int):
        super().__init__(k_max=k_max, k_start=min(2, k_max), watch=None, guard=SafeArm(clock=clock))
        self.clock, self.asked = clock, []

    def choose(self, rows=None, lag=None):
        k = super().choose(rows)
        self.asked.append(k)
        return k

    def update(
        self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None, width=None
    ):
        self.clock.t += 1.0 + (self.k_max + 1 if self.asked[-1] > 0 else 0)
        super().update(k, num_drafted, num_accepted, 0.0, 1.0, bucket, rows, width)


# FixedTrees proposes 2 nodes or more whatever k (its case runs at k = 7): not a drafter to ask for k = 1
@pytest.mark.parametrize("name", [c for c in CASES if c != "tree-branches"])
def test_every_drafter_kind_goes_through_the_safe_arm(name):
    """Chains (with and without q, classed, gated), token trees, block and in-forward drafters, and
    the server's capped wrapper: in each, speculative steps that the clock makes slower than plain
    ones are cut to the safe arm's trials (per band of batch sizes), and greedy output stays plain
    decoding's, with rows leaving the batch at different steps."""
    target = peaked(seed=10, scale=12.0)
    case = make_case(name, target)
    outputs = []
    for guarded_run in (False, True):
        policy = SlowSpeculation(Clock(), case.policy.k_max) if guarded_run else None
        if guarded_run and isinstance(case.policy, CappedPolicy):
            policy = CappedPolicy(policy)
        drafter = case.drafter if guarded_run else None
        engine = Engine(target, drafter, policy, hidden_layers=getattr(drafter, "hidden_layers", ()))
        # rows of different lengths: rows leave the batch between plain and speculative steps
        outputs.append(
            decode_requests(engine, [Request(PROMPT + [i], 48 - 6 * i, SamplingParams()) for i in range(4)])
        )
    p = policy.inner if isinstance(policy, CappedPolicy) else policy
    assert p.rate.fallbacks >= 1, p.asked
    # the trials of each band of batch sizes the batch went through (rows finish at different steps);
    # every speculative step loses at least a plain step's time, so a trial ends within max_loss + 1
    per_trial = int(p.rate.arm.max_loss) + 1
    bound = len(p.rate.bands) * trials(len(p.asked), p.rate.arm) * per_trial
    assert sum(k > 0 for k in p.asked) <= bound, p.asked
    assert outputs[0] == outputs[1]


class PlainAfterLeaving(FixedK):
    """k, but a plain step right after rows left the batch (as any adaptive policy may choose 0)."""

    def __init__(self, k: int):
        super().__init__(k)
        self.rows: int | None = None

    def choose(self, rows=None, lag=None):
        shrank = self.rows is not None and len(rows) < self.rows
        self.rows = len(rows)
        return 0 if shrank else self.k


@pytest.mark.parametrize("name", CASES)
def test_every_drafter_kind_survives_plain_steps_after_rows_leave(name):
    """The first row leaves, the next step is plain, then drafting resumes: a drafter that reads the
    target's features must not index them by rows of an earlier forward (an IndexError before);
    greedy output stays plain decoding's."""
    target = peaked(seed=10, scale=12.0)
    case = make_case(name, target)
    drafter, policy = case.drafter, PlainAfterLeaving(case.policy.k_max)
    outputs = []
    hidden = getattr(drafter, "hidden_layers", ())
    for engine in (Engine(target), Engine(target, drafter, policy, hidden_layers=hidden)):
        outputs.append(
            decode_requests(engine, [Request(PROMPT + [i], 12 + 9 * i, SamplingParams()) for i in range(4)])
        )
    assert outputs[0] == outputs[1]
