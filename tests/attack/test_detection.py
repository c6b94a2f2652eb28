"""The collapse detection rule (RowWatch) replayed on recorded and synthetic acceptance (issue 17)."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from specdraft.attack.detection import HitRecorder, rates, replay
from specdraft.errors import SpecdraftError
from specdraft.policy import RowWatch

RECORDED = Path(__file__).parent / "data" / "lookup_hits.json"


def clean_requests(p: float, n: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[int(rng.random() < p) for _ in range(length)] for _ in range(n)]


def steady_requests(p: float, n: int, length: int = 64) -> list[list[int]]:
    """Requests accepted at rate p evenly (hits spread as in Bresenham's line), none unlucky."""
    return [[int(math.floor((i + 1) * p) > math.floor(i * p)) for i in range(length)] for _ in range(n)]


@pytest.mark.parametrize("p, within", [(0.9, 3), (0.6, 5 + 8)])
def test_an_always_wrong_request_is_flagged_within_the_documented_steps(p, within):
    """After warm-up: log(alpha) / log(1 - p) proposals (3 at 0.9, 6 at 0.6); a row is off after a
    run of rejections rare at p (3 at 0.9, 5 at 0.6) and then proposes only at its probes (8, 16,
    32 steps apart)."""
    requests = steady_requests(p, 10) + [[0] * 128]
    flags = replay(requests, tokens=128)
    assert all(f.step is None for f in flags[:-1])
    assert flags[-1].step is not None and flags[-1].step <= within
    # and not before the binomial test allows: (1 - p)^n < alpha needs n >= log(alpha) / log(1 - p)
    assert flags[-1].proposal >= math.log(RowWatch().detect_alpha) / math.log(1 - p) - 1


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
    # the test can fail: looser thresholds flag many of these clean requests
    loose = RowWatch(detect_alpha=0.2, detect_fraction=0.5)
    assert (
        rates(replay(requests, loose, tokens=doc["max_new_tokens"]), adversarial)["false_positive_rate"] > 0.1
    )
    # prompt lookup proposes for free, so a request that is off is watched at every step (the
    # engine's unverified proposals): issue 17's >= 90% flagged, <= 5% false positives. With its
    # probes alone, an always-wrong request makes too few proposals in 64 steps to be flagged.
    shadowed = rates(replay(requests, tokens=doc["max_new_tokens"], shadow=True), adversarial)
    assert shadowed["detected_rate"] >= 0.9 and shadowed["false_positive_rate"] <= 0.05, shadowed
    assert r["detected_rate"] < 0.5, r


def test_hit_recorder_keeps_first_token_outcomes_per_request():
    rec = HitRecorder(3)
    rec.update(3, torch.tensor([3, 0, 2]), torch.tensor([0, 0, 2]), 0.0, 0.0, None, [4, 5, 6])
    rec.update(3, torch.tensor([3, 3, 3]), torch.tensor([1, 3, 0]), 0.0, 0.0, None, [4, 5, 6])
    rec.update(0, torch.tensor([0]), torch.tensor([0]), 0.0, 0.0, None, [4])
    assert rec.hits == {4: [0, 1], 5: [1], 6: [1, 0]} and rec.choose() == 3
