"""The collapse detection rule (RowWatch) replayed on recorded and synthetic acceptance (issue 17)."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from specdraft.attack.detection import HitRecorder, rates, replay
from specdraft.errors import SpecdraftError
from specdraft.policy import RowWatch, beta_binomial_cdf, binomial_cdf

RECORDED = Path(__file__).parent / "data" / "lookup_hits.json"
# the feature draft F, one outcome per position (recorded at k = 1 with its catch-ups' read-backs):
# results/hindsight-2026-12-05/detection-hits.json
FEATURE = Path(__file__).parent / "data" / "feature_hits.json"


def clean_requests(p: float, n: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[int(rng.random() < p) for _ in range(length)] for _ in range(n)]


def steady_requests(p: float, n: int, length: int = 64) -> list[list[int]]:
    """Requests accepted at rate p evenly (hits spread as in Bresenham's line), none unlucky."""
    return [[int(math.floor((i + 1) * p) > math.floor(i * p)) for i in range(length)] for _ in range(n)]


@pytest.mark.parametrize("p", [0.9, 0.6])
def test_an_always_wrong_request_is_flagged_after_the_documented_proposals(p):
    """After warm-up, at about the n-th proposal, n the first with ``P(X = 0) < detect_alpha`` for
    a request drawn around the average p (RowWatch: 4 at 0.9, 9 at 0.6). Watched at every step (a
    free drafter's unverified proposals) that is about its n-th step; with its probes alone, later."""
    w = RowWatch()
    k = w.detect_concentration
    n = next(n for n in range(1, 200) if beta_binomial_cdf(0, n, p, k) < w.detect_alpha)
    assert n == {0.9: 4, 0.6: 9}[p]
    requests = steady_requests(p, 10) + [[0] * 128]
    shadowed = replay(requests, tokens=128, shadow=True)
    assert all(f.step is None for f in shadowed[:-1])
    # a little after n: the row's own misses, counted while it is on, lower the average it is read at
    assert n <= shadowed[-1].proposal <= n + 3 and shadowed[-1].step <= shadowed[-1].proposal
    probed = replay(requests, tokens=128)[-1]  # probes 8, 16, 32, 64 steps apart: at 0.6, after step 128
    assert probed.step > shadowed[-1].step if p == 0.9 else probed.step is None


def test_a_feature_drafters_catch_ups_flag_an_always_wrong_request_its_probes_alone_do_not():
    """A feature drafter (F accepts about a third of its first tokens) is not free: a request that is
    off proposes only at its probes, too few in 128 steps at the default thresholds. Each probe's
    catch-up reads back the outcomes of the positions since the last one (up to ``max_lag - 1`` =
    15, :meth:`CostAwareK.hindsight`): enough to flag it, and steady clean requests still are not."""
    w = RowWatch()
    spread, alpha = w.detect_concentration, w.detect_alpha
    n = next(n for n in range(1, 200) if beta_binomial_cdf(0, n, 0.35, spread) < alpha)
    requests = steady_requests(0.35, 10, 128) + [[0] * 128]
    assert replay(requests, tokens=128)[-1].step is None
    read = replay(requests, tokens=128, catch_up=16)
    assert all(f.step is None for f in read[:-1])
    assert read[-1].step is not None and read[-1].step < 64 and read[-1].proposal >= n, (n, read[-1])


def test_the_beta_binomial_is_the_binomial_for_a_large_concentration_and_wider_for_a_small_one():
    assert beta_binomial_cdf(3, 10, 0.4, 1e7) == pytest.approx(binomial_cdf(3, 10, 0.4), rel=1e-4)
    assert beta_binomial_cdf(0, 20, 0.4, 20.0) > 10 * binomial_cdf(0, 20, 0.4)  # a low request is likelier
    assert beta_binomial_cdf(20, 20, 0.4, 20.0) == pytest.approx(1.0)
    with pytest.raises(SpecdraftError, match="detect_concentration"):
        RowWatch(detect_concentration=0.0)


def test_cold_policy_flags_nothing():
    """Before the average rests on detect_warmup decayed proposals nothing is flagged; a request
    alone on a cold policy is compared with itself and never is."""
    assert replay([[0] * 200])[0].step is None
    watch = RowWatch(detect_warmup=1000.0)  # never warm: the average saturates near 50
    assert replay(clean_requests(0.9, 5) + [[0] * 64], watch)[-1].step is None
    assert replay(clean_requests(0.9, 5) + [[0] * 64])[-1].step is not None
    with pytest.raises(SpecdraftError, match="detect_warmup"):
        RowWatch(detect_warmup=-1.0)


def test_unlucky_clean_requests_are_rarely_flagged():
    flags = replay(clean_requests(0.5, 60, seed=1), tokens=64)
    assert rates(flags, [False] * 60)["false_positive_rate"] <= 0.05


def test_recorded_clean_distribution_flags_at_most_five_percent():
    """Prompt lookup on SmolLM2-135M, Spec-Bench + GSM8K (benchmarks/bench_detection.py)."""
    doc = json.loads(RECORDED.read_text())
    clean = [h for h in doc["hits"]["lookup"] if h]
    assert len(clean) >= 40 and 0.05 < sum(map(sum, clean)) / sum(map(len, clean)) < 0.95
    requests, adversarial = [], []
    for i, hits in enumerate(clean, 1):
        requests.append(hits)
        adversarial.append(False)
        if i % 4 == 0:
            requests.append([0] * doc["max_new_tokens"])
            adversarial.append(True)
    r = rates(replay(requests, tokens=doc["max_new_tokens"]), adversarial)
    assert r["false_positive_rate"] <= 0.05, r
    # requests differ: reading each as accepting the average (a binomial test, the rule before
    # results/detection-calibration-2026-12-05) flags more than 5% of these
    binomial = RowWatch(detect_concentration=None, detect_alpha=0.01)
    flagged = rates(replay(requests, binomial, tokens=doc["max_new_tokens"], shadow=True), adversarial)
    assert flagged["false_positive_rate"] > 0.05, flagged
    # the test can fail: looser thresholds flag many of these clean requests
    loose = RowWatch(detect_alpha=0.2, detect_fraction=0.5)
    assert (
        rates(replay(requests, loose, tokens=doc["max_new_tokens"]), adversarial)["false_positive_rate"] > 0.1
    )
    # prompt lookup proposes for free, so a request that is off is watched at every step (the
    # engine's unverified proposals): issue 17's >= 90% flagged, <= 5% false positives. With its
    # probes alone, an always-wrong request makes too few proposals in 128 steps to be flagged.
    shadowed = rates(replay(requests, tokens=doc["max_new_tokens"], shadow=True), adversarial)
    assert shadowed["detected_rate"] >= 0.9 and shadowed["false_positive_rate"] <= 0.05, shadowed
    assert r["detected_rate"] < 0.5, r


def test_recorded_feature_requests_are_flagged_with_their_catch_ups_and_not_without():
    """F on SmolLM2-135M, Spec-Bench + GSM8K (``bench_detection.py --k 1 --hindsight``): replayed with
    its catch-ups read back, issue 17's bounds hold (>= 90% of always-wrong requests flagged, <= 5% of
    clean ones); on its probes alone most always-wrong requests go unflagged in 128 steps."""
    doc = json.loads(FEATURE.read_text())
    ((spec, clean),) = doc["hits"].items()
    lag, n = doc["catch_up"][spec], doc["max_new_tokens"]
    assert lag == 16 and len(clean) >= 70
    requests, adversarial = [], []
    for i, hits in enumerate(clean, 1):
        requests += [hits] + ([[0] * n] if i % 4 == 0 else [])
        adversarial += [False] + ([True] if i % 4 == 0 else [])
    read = rates(replay(requests, tokens=n, catch_up=lag), adversarial)
    assert read["detected_rate"] >= 0.9 and read["false_positive_rate"] <= 0.05, read
    assert rates(replay(requests, tokens=n), adversarial)["detected_rate"] < 0.5


def test_hit_recorder_keeps_first_token_outcomes_per_request():
    rec = HitRecorder(3)
    rec.update(3, torch.tensor([3, 0, 2]), torch.tensor([0, 0, 2]), 0.0, 0.0, None, [4, 5, 6])
    rec.update(3, torch.tensor([3, 3, 3]), torch.tensor([1, 3, 0]), 0.0, 0.0, None, [4, 5, 6])
    rec.update(0, torch.tensor([0]), torch.tensor([0]), 0.0, 0.0, None, [4])
    assert rec.hits == {4: [0, 1], 5: [1], 6: [1, 0]} and rec.choose() == 3


def test_hit_recorder_keeps_what_catch_ups_read_back_in_order_when_asked():
    rec = HitRecorder(1, hindsight=True)
    assert rec.hindsight_rows([4, 5]) == [True, True] and HitRecorder(1).hindsight_rows([4]) is None
    rec.update(1, torch.tensor([1]), torch.tensor([1]), 0.0, 0.0, None, [4])
    rec.hindsight([4], [[False]])  # the bonus token of the step that accepted its draft token
    rec.update(1, torch.tensor([1]), torch.tensor([0]), 0.0, 0.0, None, [4])
    assert rec.hits == {4: [1, 0, 0]}
