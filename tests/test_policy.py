"""Draft-length policies: fixed, transformers' heuristic, and the cost-aware choice including k = 0."""

from dataclasses import replace
from itertools import pairwise, product

import pytest
import torch

from specdraft import analytic
from specdraft.errors import SpecdraftError
from specdraft.policy import CostAwareK, FixedK, HeuristicK, RowWatch, make_policy


def t(*xs):
    return torch.tensor(xs)


def model(**kw) -> CostAwareK:
    """The cost-aware policy's model alone. These tests feed it synthetic times; its safe arm
    (SafeArm, tests/test_policy_guard.py) times steps by the clock, which in a test loop reads this
    machine's scheduling, and would take over the choices (its own probes too)."""
    return CostAwareK(guard=None, **kw)


def test_fixed_k():
    p = FixedK(4)
    p.update(4, t(4), t(0), 0.1, 0.1)
    assert p.choose() == 4
    assert FixedK(0).choose() == 0
    with pytest.raises(SpecdraftError):
        FixedK(-1)


def test_heuristic_plus_two_minus_one():
    p = HeuristicK(k_start=5, k_max=8)
    p.update(5, t(5, 5), t(5, 5), 0, 0)
    assert p.choose() == 7
    p.update(7, t(7, 7), t(7, 7), 0, 0)
    assert p.choose() == 8  # capped at k_max
    p.update(8, t(8, 8), t(8, 3), 0, 0)  # one row rejected
    assert p.choose() == 7
    for _ in range(10):
        p.update(p.choose(), t(3), t(0), 0, 0)
    assert p.choose() == 1  # never below 1
    p.update(1, t(0), t(0), 0, 0)  # a row with no proposal (n-gram miss) counts as all accepted
    assert p.choose() == 3
    p.update(0, t(0), t(0), 0, 0)  # plain steps leave it alone
    assert p.choose() == 3


def feed(policy: CostAwareK, alpha: float, t_draft: float, t_target, steps: int = 300, seed: int = 0):
    """Run the policy against a synthetic model: each draft token survives with probability alpha
    (independently, as the analytic model assumes), times from the cost model."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        k = policy.choose()
        if k == 0:
            policy.update(0, t(0), t(0), 0.0, t_target(1))
            continue
        survive = (torch.rand(k, generator=g) < alpha).to(torch.int64).cumprod(0)
        policy.update(k, t(k), t(int(survive.sum())), k * t_draft, t_target(k + 1))
    return policy.choose()


def test_cost_aware_speculates_when_it_pays_and_not_when_it_does_not():
    def flat(n):  # a forward over n tokens costs barely more than over one
        return 0.030 + 0.001 * n

    p = model(k_max=8)
    good = feed(p, alpha=0.8, t_draft=0.002, t_target=flat)
    assert good >= 3
    best = analytic.best_k(0.8, 0.002, flat, 8)
    # the learned curve is a noisy estimate: its choice is within a few percent of the best k
    assert analytic.throughput(0.8, good, 0.002, flat) >= 0.95 * analytic.throughput(0.8, best, 0.002, flat)
    assert p.rates()[:4] == pytest.approx([0.8] * 4, abs=0.25)
    # a draft as slow as the target with a poor acceptance: plain decoding wins
    assert feed(model(k_max=8), alpha=0.2, t_draft=0.03, t_target=flat) == 0


def test_per_position_curve_beats_one_alpha_on_bursty_acceptance():
    """Acceptance that is all or nothing (a draft either continues a repeated passage or is
    wrong from its first token) has per-position rates 0.5, 1, 1, ...: one geometric alpha would
    say ~0.6 and stop early; the curve drafts long."""

    def flat(n):
        return 0.030 + 0.0005 * n

    p = model(k_max=8)
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        k = p.choose()
        hit = bool(torch.rand((), generator=g) < 0.5)
        p.update(k, t(k), t(k if hit else 0), 1e-5 * k, flat(k + 1))
    assert p.choose() == 8
    assert p.rates()[0] == pytest.approx(0.5, abs=0.3) and min(p.rates()[1:]) > 0.9


def two_class_policy(step_t) -> CostAwareK:
    """A policy fed 400 steps of prompt lookup's two kinds of proposal, alternating: class 3
    (long matches, accepted 0.9 per token) and class 1 (short, 0.05), verified in ``step_t(n)``."""
    p = model(k_max=8)
    g = torch.Generator().manual_seed(2)
    alphas = {3: 0.9, 1: 0.05}
    for i in range(400):
        k = p.choose()
        buckets = t(3 if i % 2 else 1)
        nv = p.trim(t(k), buckets)
        d = int(nv[0])
        survive = (torch.rand(d, generator=g) < alphas[int(buckets[0])]).to(torch.int64).cumprod(0)
        p.update(k, nv, t(int(survive.sum())), 1e-5, step_t(d + 1), buckets)
    return p


def test_classes_get_their_own_curves_and_rows_are_trimmed_to_them():
    """Two kinds of proposal in one stream (prompt lookup's long and short matches): the good
    class is verified in full, the bad one cut to what pays."""

    def step_t(n):
        return 0.030 + 0.004 * n

    p = two_class_policy(step_t)
    assert p.classes and set(p.curves) >= {1, 3}
    assert p.rates(3)[0] > 0.6 and p.rates(1)[0] < 0.3  # 0.9 and 0.05, seen through ~10 decayed counts
    caps = p.trim(t(8, 8, 0), t(3, 1, 0)).tolist()
    assert caps[0] >= 5 and caps[1] == 0 and caps[2] == 0
    # proposals without a class: their curve is not learned yet, so its probe's length
    assert p.trim(t(8, 8), None).tolist() == [p.probe_k] * 2


def test_nothing_is_proposed_when_no_class_pays_but_each_class_is_probed():
    """A step so dear that neither class pays (each token costs a plain step's time): most steps
    propose nothing (trim() would cut every row, and proposing costs time of its own), and each
    class is probed on its own schedule, its probe let through by trim()."""
    p = two_class_policy(lambda n: 0.010 * n)
    assert max(p._best(b, 0.0) for b in (1, 3)) == 0
    ks, verified = [], []
    for i in range(200):
        k = p.choose()
        ks.append(k)
        if k:
            bucket = t(3 if i % 2 else 1)
            nv = p.trim(t(k), bucket)
            verified.append(int(nv[0]))
            p.update(k, nv, t(0), 1e-5, 0.010 * (int(nv[0]) + 1), bucket)
        else:
            p.update(0, t(0), t(0), 0.0, 0.010)
    assert ks.count(0) > 0.8 * len(ks) and set(ks) == {0, p.probe_k}
    assert p.probe_k in verified  # a probe got through for a class due


def test_cost_aware_probes_while_at_zero():
    def flat(n):
        return 0.03

    p = model(k_max=8, probe_every=4, probe_k=2, probe_max=4)  # no back-off
    feed(p, alpha=0.1, t_draft=0.03, t_target=flat)
    ks = []
    for _ in range(8):
        k = p.choose()
        ks.append(k)
        p.update(k, t(k), t(0), k * 0.03, 0.03)
    assert 0 in ks and 2 in ks  # plain decoding, with a probe every few steps


def test_failed_probes_back_off_and_a_paying_probe_resets():
    def flat(n):
        return 0.03

    p = model(k_max=8, probe_every=4, probe_k=2, probe_max=16)
    feed(p, alpha=0.1, t_draft=0.01, t_target=flat)  # a probe costs less than a plain step
    probes = []
    for step in range(120):  # every probe accepts nothing: the gaps between probes grow, then cap
        k = p.choose()
        if k:
            probes.append(step)
        p.update(k, t(k), t(0), k * 0.01, 0.03)
    gaps = [b - a for a, b in pairwise(probes)]
    assert gaps == sorted(gaps) and gaps[-2:] == [16, 16] and p.probe_interval == 16, gaps
    # a probe after which speculation pays (a fast, well-accepted draft) resets the interval
    while p.choose() == 0:
        p.update(0, t(0), t(0), 0.0, 0.03)
    p.curves.clear()  # forget the failures (a fresh curve: prior 0.5) and make the draft fast
    p.draft_fit.sums = [0.0] * 5
    p.curves[None] = p._curve(None)
    p.curves[None].probing = True
    p.update(2, t(2), t(2), 2 * 0.0001, 0.03)
    assert p.probe_interval == 4


def probe_gaps(p: CostAwareK, lag: int, steps: int, t_draft: float) -> list[int]:
    """Gaps between the probes of a policy at k = 0 whose draft lags ``lag`` tokens before each
    step (it catches up at t_lag = t_draft / 10 per token) and accepts nothing."""
    probes = []
    for step in range(steps):
        k = p.choose([0], t(lag))
        if k:
            probes.append(step)
        p.update(k, t(k), t(0), k * t_draft + (lag - 1) * t_draft / 10 * (k > 0), 0.03, rows=[0])
    return [b - a for a, b in pairwise(probes)]


def test_a_probe_waits_its_cost_in_plain_steps_times_the_interval():
    """A draft that must first catch up on many committed tokens (a model draft after plain steps)
    probes less often, in proportion to what the probe costs in plain steps, and what it costs
    beyond two takes at most 1 / probe_max of the time; its draft time per token is fitted apart
    from the catch-up, not inflated by it."""
    p = model(k_max=8, probe_every=4, probe_k=2, probe_max=4, watch=None)  # no back-off
    assert p.choose([0], t(10)) == 3  # the first step measures, catching up on 10 tokens
    p.update(3, t(3), t(0), 3 * 0.003 + 9 * 0.0003, 0.03, rows=[0])
    # one step cannot separate the two: each is read as if it took the whole time
    assert p.t_draft == pytest.approx(0.0117 / 3) and p.t_lag == pytest.approx(0.0117 / 9)
    p.update(p.choose([0], t(1)), t(0), t(0), 0.0, 0.03, rows=[0])
    assert probe_gaps(p, 2, 40, 0.003)[-2:] == [4, 4]  # a probe costs less than a plain step
    assert p.t_draft == pytest.approx(0.003) and p.t_lag == pytest.approx(0.0003)
    # 301 tokens behind: 2 draft tokens, 300 catch-up tokens, 0.096 s = 3.2 plain steps
    assert probe_gaps(p, 301, 80, 0.003)[-2:] == [13, 13]
    assert p.t_draft == pytest.approx(0.003) and p.t_lag == pytest.approx(0.0003)
    # what such a probe costs beyond two plain steps takes at most 1 / probe_max of the steps
    p.probe_max = 64
    assert probe_gaps(p, 301, 500, 0.003)[:2] == [141, 141]  # 64 (3.2 - 1) plain steps


def at_zero_after_rejections() -> CostAwareK:
    """A policy (no classes) whose one row, 7, had a draft accepted (so it teaches its class) and then
    only rejections: the class is at k = 0, the row stays on."""
    p = model(k_max=4, probe_every=4, probe_max=4, watch=RowWatch(floor=0.0))
    hit = True
    for _ in range(30):
        k = p.choose([7])
        p.update(k, t(k), t(int(hit and k > 0)), k * 0.005, 0.03 + 0.005 * k, rows=[7])
        hit = hit and k == 0
    return p


def next_probe(p: CostAwareK) -> int:
    """Plain steps until the policy probes; the probe's k."""
    while (k := p.choose([7])) == 0:
        p.update(0, t(0), t(0), 0.0, 0.03, rows=[7])
    return k


def test_a_probe_after_a_stretch_at_zero_learns_the_stretch_in_hindsight():
    """A class at k = 0 after a run of rejections learns, at its next probe, the outcomes a feature
    drafter reads back over the stretch (:meth:`CostAwareK.hindsight`: what proposals there would
    have got): a stretch where they would have been accepted brings speculation back at the next
    step, where the probe's own outcome alone leaves the class at 0. Only rows whose last step
    verified nothing are asked for them, and only those rows' outcomes are taken."""

    def at_probe(read: bool) -> int:
        p = at_zero_after_rejections()
        assert p.rates()[0] < 0.2
        k = next_probe(p)
        assert p.hindsight_rows([7, 8]) == [True, False]  # 8: a row the policy has not seen
        if read:
            p.hindsight([7], [[True] * 12])
        p.update(k, t(k), t(0), k * 0.005, 0.03 + 0.005 * k, rows=[7])  # the probe is rejected
        assert p.hindsight_rows([7]) == [False]  # its last step verified drafts
        return p.choose([7])

    assert at_probe(read=False) == 0
    assert at_probe(read=True) > 0


@pytest.mark.parametrize("read", [False, True])
def test_a_probe_its_read_backs_ended_verifies_what_its_curve_now_says_pays(read):
    """A drafter without classes probing at k = 0: the read-backs told before trim() end the probe,
    and trim() then cuts the proposal to what the class's curve says pays now the drafting is spent:
    nothing when they were rejections (the probe's verification, a wider target forward, is saved),
    the probe's tokens when they were accepted. Without read-backs the probe is verified as it was."""
    p = at_zero_after_rejections()
    k = next_probe(p)
    if not read:
        assert p.trim(t(k), None, rows=[7]).tolist() == [k]  # a probe: verified
        return
    p.hindsight([7], [[False] * 12])
    assert p.trim(t(k), None, rows=[7]).tolist() == [0]
    k = next_probe(p)
    p.hindsight([7], [[True] * 12])
    assert p.trim(t(k), None, rows=[7]).tolist() == [k]


def test_make_policy():
    assert isinstance(make_policy("auto"), CostAwareK)
    assert isinstance(make_policy("heuristic"), HeuristicK)
    assert (
        make_policy("5").choose() == 5 and make_policy(3).choose() == 3 and make_policy(" 0 ").choose() == 0
    )
    for bad in ("-1", "five", ""):
        with pytest.raises(SpecdraftError):
            make_policy(bad)


def test_cost_aware_files_target_time_under_the_tokens_actually_scored():
    """A drafter that proposes fewer than k tokens (prompt lookup) makes a shorter target
    forward; its time must not pass for T_target(k + 1)."""
    p = model()
    p.update(4, torch.tensor([1]), torch.tensor([0]), 1e-4, 0.021)
    assert set(p.t_target) == {2} and p.t_target[2] == pytest.approx(0.021)
    p.update(4, torch.tensor([0]), torch.tensor([0]), 1e-4, 0.020)
    assert p.t_target[1] == pytest.approx(0.020)
    assert p.latency().time(2) == pytest.approx(0.021) and p.latency().time(1) == pytest.approx(0.020)


def test_one_slow_step_does_not_stick_to_a_size():
    """T_target(n) is the median of the last ``latency_window`` steps at n: a step slowed five times
    by a busy machine moves it nothing, where an exponential average kept a fifth of the
    slowdown until the size was measured again (a size the policy may then never choose)."""
    p = model()
    for seconds in (0.010, 0.011, 0.050, 0.010, 0.011):
        p.update(1, t(1), t(1), 1e-4, seconds)
    assert p.t_target[2] == pytest.approx(0.011)
    for _ in range(3):  # the slow one has left the window of 5; the sizes follow the new times
        p.update(1, t(1), t(1), 1e-4, 0.020)
    assert p.t_target[2] == pytest.approx(0.020)
    with pytest.raises(SpecdraftError, match="latency_window"):
        CostAwareK(latency_window=0)


def test_cost_aware_reads_unmeasured_sizes_off_the_latency_curve():
    """Sizes not yet scored are read off the measured ones: flat while one is known, then linear
    between and beyond them; the choice of k uses those times."""
    p = model(k_max=4)
    p.update(0, t(0), t(0), 0.0, 0.010)
    assert [p.latency().time(n) for n in (1, 3, 5)] == [0.010] * 3
    p.update(2, t(2), t(2), 0.002, 0.014)  # n = 3
    assert p.latency().time(2) == pytest.approx(0.012) and p.latency().time(5) == pytest.approx(0.018)
    assert p.latency() == analytic.LatencyCurve({1: p.t_target})
    p.choose()
    assert p._times == [p.latency().time(n) for n in range(1, 6)]  # what the choice of k was scored with


def test_cost_aware_drafts_less_on_a_steeper_verification_curve():
    """The policy reads the runtime's own T(k + 1) / T(1), measured as it decodes: on a runtime
    whose verification costs more per token (the quantized runtime's ~3.9x T1 at 8 tokens against
    the bf16 runtime's ~2x, README) it mostly drafts less, at the analytic best for each curve."""

    def flat(n):
        return 0.010 * (1 + 0.15 * (n - 1))

    def steep(n):
        return 0.0067 * (1 + 0.42 * (n - 1))

    def usual_k(curve) -> int:  # the k chosen most often once the curves are learned
        p, g, ks = model(k_max=8), torch.Generator().manual_seed(0), []
        for _ in range(500):
            k = p.choose()
            ks.append(k)
            survive = (torch.rand(k, generator=g) < 0.7).to(torch.int64).cumprod(0)
            p.update(k, t(k), t(int(survive.sum())), k * 0.0002, curve(k + 1))
        return max(set(ks[250:]), key=ks[250:].count)

    k_flat, k_steep = usual_k(flat), usual_k(steep)
    assert k_steep < k_flat
    for k, curve in ((k_flat, flat), (k_steep, steep)):  # learned from noisy counts: near the best
        best = analytic.best_k(0.7, 0.0002, curve, 8)
        assert analytic.throughput(0.7, k, 0.0002, curve) >= 0.95 * analytic.throughput(
            0.7, best, 0.0002, curve
        )


def test_a_batch_is_cut_to_the_length_that_pays_for_all_its_rows():
    """Rows are padded to the longest: one row with a good class does not make the other seven pay
    a long verification, while eight good rows keep theirs; a lone row keeps its per-row cut."""

    def step_t(n):  # a batch step where each extra token per row costs a quarter of a step
        return 0.030 + 0.010 * n

    p = two_class_policy(step_t)
    alone = int(p.trim(t(8), t(3), rows=[0])[0])
    assert alone >= 3
    one_good = p.trim(t(*[8] * 8), t(3, *[1] * 7), rows=list(range(8)))
    assert one_good.tolist() == [0] * 8
    all_good = p.trim(t(*[8] * 8), t(*[3] * 8), rows=list(range(8)))
    assert all_good.min() >= 3 and len(set(all_good.tolist())) == 1


def ragged_lines(p: CostAwareK, step_t, sizes) -> None:
    """Ragged steps seen at each batch size: a plain one and one with a draft token per row, timed
    as ``step_t(n)`` reads n tokens per row."""
    p.ragged = True
    for B in sizes:
        p.update(0, t(*[0] * B), t(*[0] * B), 0.0, step_t(1))
        p.update(1, t(*[1] * B), t(*[0] * B), 1e-5, step_t(2))


def test_ragged_steps_keep_each_rows_paying_positions():
    """Ragged steps (each row feeds only its own tokens): the good row keeps its long draft beside
    seven rows at 0 (padded, the test above cuts it to 0); rows whose positions do not pay are still
    cut, a probing row keeps its probe, and the batch cut is the best n of the sorted gains."""

    def step_t(n):
        return 0.030 + 0.010 * n

    p = two_class_policy(step_t)
    ragged_lines(p, step_t, (8, 2, 3))
    one_good = p.trim(t(*[8] * 8), t(3, *[1] * 7), rows=list(range(8)))
    assert one_good[0] >= 3 and one_good[1:].tolist() == [0] * 7
    assert p._batch_cap([8, 8, 8], [3, 1, 1], [False] * 3)[1:] == [0, 0]
    assert p._batch_cap([8, 2], [3, 1], [False, True])[1] == 2
    # against every n kept (a prefix of the sorted gains), the one chosen has the best rate
    caps, classes = [6, 4, 5], [3, 1, 3]
    kept = p._batch_cap(caps, classes, [False] * 3)
    curve = p.latency()

    def rate(ks):
        return sum(p.expected_tokens(k, b) for k, b in zip(ks, classes)) / curve.time(1 + sum(ks) / 3)

    best = max((list(ks) for ks in product(*[range(c + 1) for c in caps])), key=rate)
    assert rate(kept) == pytest.approx(rate(best))


def test_ragged_step_time_is_a_line_in_the_draft_tokens_the_batch_fed():
    """A ragged step's time is a line per batch size in the draft tokens the batch fed, through
    the plain steps' time; until a speculative step is seen, a draft token costs what a token of a
    plain step does (the reading that never favours speculation); a batch size without one of its
    own reads the slope of the nearest size that has one."""
    p = model(k_max=4)
    p.ragged = True
    p.update(0, t(0, 0, 0, 0), t(0, 0, 0, 0), 0.0, 0.010)
    assert p.latency().time(2) == pytest.approx(0.020)
    p.update(2, t(2, 0, 0, 0), t(1, 0, 0, 0), 0.001, 0.012)  # 2 draft tokens: 0.001 s each
    assert set(p.t_target) == {1}
    assert p.latency().time(3) == pytest.approx(0.006 + 0.001 * 12)
    p.update(2, t(2, 2, 2, 2), t(1, 1, 1, 1), 0.001, 0.018)  # 8: on the same line
    assert p.latency().time(5) == pytest.approx(0.026)
    assert p.latency(8).time(1) == pytest.approx(0.010)  # no step at 8 rows yet: T(1) as measured
    p.update(0, t(*[0] * 8), t(*[0] * 8), 0.0, 0.016)  # 8 rows have a line of their own, 4 rows' slope
    assert p.latency(8).time(2) == pytest.approx(0.016 + 0.001 * 8) and p.latency(4).time(5) == pytest.approx(
        0.026
    )
    p.update(1, t(*[1] * 8), t(*[0] * 8), 0.001, 0.020)  # and then a slope of its own: 0.0005 s a token
    assert p.latency(8).time(2) == pytest.approx(0.020) and p.latency(4).time(5) == pytest.approx(0.026)
    assert p.slope(6) == pytest.approx(0.001) and p.slope(7) == pytest.approx(0.0005)  # the nearest
    for _ in range(100):  # plain steps move the line's anchor, not its slope
        p.update(0, t(0, 0, 0, 0), t(0, 0, 0, 0), 0.0, 0.012)  # the anchor: an average, 0.9 per step
    assert p.latency(4).time(5) == pytest.approx(0.028, rel=1e-4)  # 0.012 + 0.001 * 4 * 4
    p.update(2, t(2, 0, 0, 0), t(1, 0, 0, 0), 0.001, 0.5)  # a step a busy machine made 40 times slower
    assert p.slope(4) == pytest.approx(0.001)  # the median of the last steps' cost per token


def test_plain_steps_move_the_cached_step_times_as_a_fresh_reading_does():
    """After a plain ragged step the cached ``T(1 .. k_max + 1)`` are moved by what the step moved
    ``t_plain`` instead of read again (~0.1 ms a step): the same times as a fresh reading, at each
    batch size, whether the costs are a line or each x's own; read again after a speculative step
    and at another batch size."""
    p = model(k_max=4)
    p.ragged = True
    p.update(0, t(0, 0), t(0, 0), 0.0, 0.010)
    p.update(1, t(1, 0), t(0, 0), 1e-5, 0.011)  # the line: 1 ms a draft token
    plain = [0.0104, 0.0097, 0.0121, 0.0090]
    for step in range(12):
        if step == 6:  # 2-token steps with a majority of their own: points, not the line
            for _ in range(3):
                p.update(2, t(2, 2), t(0, 0), 1e-5, 0.016)
            assert p._times is None  # read again after a speculative step
        p._step_times()  # as choose() reads them at every step
        p.update(0, t(0, 0), t(0, 0), 0.0, plain[step % 4])
        moved = p._times
        assert moved is not None and p._times_at == 2  # moved, not dropped
        assert moved == pytest.approx(p.latency().times(5), rel=1e-12, abs=1e-15)
    p.update(0, t(0, 0, 0), t(0, 0, 0), 0.0, 0.012)  # 3 rows: its first plain step
    assert p._times is None
    p.choose(rows=[1, 2, 3])
    assert p._step_times() == pytest.approx(p.latency(3).times(5))


def test_steps_of_x_draft_tokens_are_read_from_their_own_times_once_they_have_a_majority():
    """A draft token's cost grows with the draft tokens a step feeds (the quantized target at batch 1:
    ``results/feature-q8-2026-12-05/latency-0b2ca67.txt``): the line through every step's cost per
    token read a 1-token step as dear as half a 2-token one, and cut 1-token drafts that pay. Steps of x draft
    tokens are read from their own times once they have a majority of the last ``latency_window``
    (one slow step cannot move that), the line before."""
    p = model(k_max=4)
    p.ragged = True
    p.update(0, t(0), t(0), 0.0, 0.006)
    for _ in range(2):
        p.update(1, t(1), t(0), 1e-5, 0.0065)  # a 1-token step: 0.5 ms beyond a plain one
        p.update(2, t(2), t(0), 1e-5, 0.008)  # a 2-token step: 2 ms
    assert p.latency().time(2) == pytest.approx(0.006 + p.slope(1))  # two of five: the line
    p.update(1, t(1), t(0), 1e-5, 0.0065)
    p.update(2, t(2), t(0), 1e-5, 0.5)  # a slow step among the 2-token ones
    p.update(2, t(2), t(0), 1e-5, 0.008)
    curve = p.latency()
    assert curve.time(2) == pytest.approx(0.0065) and curve.time(3) == pytest.approx(0.008)
    assert curve.time(4) == pytest.approx(0.0095)  # beyond: the last segment extended
    p.curves[None] = replace(p._curve(None), reached=[10.0] * 4, accepted=[1.0, 0.2, 0.0, 0.0])
    p._times = None
    assert p._best(None, 1e-5) == 1  # 0.14 of a token for 8% of a step pays
    line = [0.006 + 0.001 * n for n in range(5)]  # the line at 1 ms a token: 17% of a step
    assert analytic.best_k_from_rates(p.rates()[:4], 1e-5, line) == 0


def test_a_batch_times_its_first_draft_tokens_before_it_cuts_any():
    """Ragged steps at B >= 2 before any draft token was timed: a token reads as costing a plain
    step's share, which no proposal beats, so the batch cut kept none, no speculative step was ever
    timed and the policy never drafted again (prompt lookup at batch 8 drafted 3 tokens in 384
    steps). The first proposal goes through uncut, its time gives the slope, and the classes it
    showed are learned from then on."""
    p = model(k_max=4)
    p.ragged = True
    rows = list(range(8))
    assert p.choose(rows) == p.k_start  # the draft's time first
    # nothing matched: each row fed one token, which times a plain step at 8 rows
    p.update(p.k_start, t(*[0] * 8), t(*[0] * 8), 1e-4, 0.016, t(*[0] * 8), rows)
    k = p.choose(rows)
    assert k > 0 and p.classes  # classes known from the first proposal, though it had no drafts
    caps = p.trim(t(*[k] * 8), t(*[3] * 8), rows)
    assert caps.tolist() == [k] * 8  # not cut: nothing timed yet
    p.update(k, caps, caps, 1e-4, 0.016 + 0.0002 * 8 * k, t(*[3] * 8), rows)  # all accepted, cheap
    assert p.slope(8) == pytest.approx(0.0002)
    assert p.choose(rows) > 0 and p.trim(t(*[4] * 8), t(*[3] * 8), rows).min() > 0


def test_a_new_batch_size_is_timed_with_a_plain_step_first():
    """Ragged steps cost differently at each batch size: before a plain step at B rows is timed the
    policy reads no other size's times (after steps of one row, 8 rows of 5 tokens would look as
    cheap as one row's step) and decodes one plain step there."""
    p = model(k_max=4)
    p.ragged = True
    assert feed(p, alpha=0.9, t_draft=1e-5, t_target=lambda n: 0.004 + 0.0005 * (n - 1)) > 0
    rows = list(range(8))
    assert p.choose(rows) == 0
    p.update(0, t(*[0] * 8), t(*[0] * 8), 0.0, 0.012)
    assert p.latency(8).time(2) == pytest.approx(0.012 + 0.0005 * 8)  # a draft token as at 1 row
