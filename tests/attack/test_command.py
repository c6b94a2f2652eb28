"""``specdraft attack`` on the tiny model: both files with the contract's keys; bad input is one line."""

import json

import pytest

from tests.helpers import TINY_CLI as TINY
from tests.helpers import run_cli

CONTRACT = {
    "clean_mean_accepted",
    "attacked_mean_accepted",
    "identical_prefix_rate",
    "rouge_l",
    "clean_speedup",
    "attacked_speedup",
    "defended_speedup",
    "detected_rate",
    "false_positive_rate",
}


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"question_id": 7, "category": "writing", "turns": ["the cat sat on the mat", "and then?"]},
        {"prompt": "abc abc abc hello"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "method, draft, extra",
    [
        ("continuous", "prune:0", ("--steps", "2")),
        ("discrete", "prune:0", ("--steps", "2", "--candidates", "4")),
        ("lookup", "lookup", ()),
    ],
)
def test_attack_writes_both_files(capsys, tmp_path, prompts, method, draft, extra):
    out = tmp_path / "out"
    argv = ["attack", *TINY, "--draft", draft, "--method", method, "--prompts", str(prompts), "--limit", "2"]
    rc, stdout, err = run_cli(capsys, *argv, "--max-new-tokens", "6", "--out", str(out), *extra)
    assert rc == 0 and "wrote" in stdout, err
    rows = [json.loads(line) for line in (out / "attacked.jsonl").read_text().splitlines()]
    assert [r["question_id"] for r in rows] == ["7", "2"] and all(len(r["turns"]) == 1 for r in rows)
    result = json.loads((out / "attack.json").read_text())
    assert CONTRACT <= set(result["overall"]) and len(result["prompts"]) == 2
    assert result["config"]["command"].startswith("specdraft attack --target tiny")
    command = result["config"]["command"]  # the method's options are in it: it reproduces the run
    assert all(f"{flag} {value}" in command for flag, value in zip(extra[::2], extra[1::2]))
    overall = result["overall"]
    assert 1.0 <= overall["clean_mean_accepted"] <= 6 and 0.0 <= overall["rouge_l"] <= 1.0
    cats = overall["by_category"]
    assert set(cats) == {"writing", "p"} and sum(c["prompts"] for c in cats.values()) == 2
    if method == "continuous":  # embeddings are not text: what the engine cannot measure is null
        assert overall["attacked_speedup"] is None and overall["defended_speedup"] is None
        assert 0.0 <= overall["detected_rate"] <= 1.0 and 0.0 <= overall["false_positive_rate"] <= 1.0
        sim = result["prompts"][0]["simulated"]  # detection replays one outcome per position
        assert len(sim["hits"]) == len(sim["attacked_hits"]) == 6 and set(sim["hits"]) <= {"0", "1"}
    else:
        assert overall["attacked_speedup"] > 0 and rows[0]["turns"][0].startswith("the cat sat on the mat")
    # the file is a prompt file specdraft bench reads
    from specdraft.bench.prompts import read_prompts

    assert len(read_prompts(out / "attacked.jsonl")) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "/nonexistent/p.jsonl"], "prompt file not found"),
        (["--limit", "0"], "--limit"),
        (["--method", "lookup", "--draft", "prune:0"], "--method lookup attacks prompt lookup"),
        (["--method", "continuous", "--draft", "lookup"], "no differentiable model"),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, prompts, args, message):
    argv = ["attack", *TINY, "--method", "discrete", "--draft", "prune:0", "--prompts", str(prompts)]
    rc, _, err = run_cli(capsys, *argv, "--out", str(tmp_path / "o"), "--max-new-tokens", "4", *args)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_halving_counts_the_bonus_and_the_draft_tokens_apart():
    from specdraft.attack.run import _halving

    # 3.0 -> 1.5 halves both; 1.5 -> 1.0 removes every accepted draft token but not half the length;
    # 1.02 has no draft tokens to remove (left out of the draft rate); 2.0 -> 1.8 halves neither
    got = _halving([3.0, 1.5, 1.02, 2.0], [1.5, 1.0, 1.0, 1.8])
    assert got == {"halved_rate": 0.25, "draft_halved_rate": round(2 / 3, 4)}
    assert _halving([], []) == {"halved_rate": None, "draft_halved_rate": None}


def test_min_rouge_is_a_fraction(capsys, tmp_path, prompts):
    argv = ["attack", *TINY, "--method", "lookup", "--draft", "lookup", "--prompts", str(prompts)]
    rc, _, err = run_cli(capsys, *argv, "--out", str(tmp_path / "o"), "--min-rouge", "1.5")
    assert rc == 2 and "--min-rouge: must be <= 1, got 1.5" in err, err


def test_continuous_detection_replays_clean_then_attacked_outcomes_in_turn():
    """Each prompt's clean record, then its attacked one, through one policy: attacked answers the
    draft never matches are flagged, clean ones that it matches half the time are not; read-backs
    (catch_up) flag them where probes alone do not. Swapping the labels would fail both rates."""
    import random

    from specdraft.attack.run import _replayed

    rng = random.Random(0)
    records = [
        {"simulated": {"hits": "".join(rng.choice("01") for _ in range(128)), "attacked_hits": "0" * 128}}
        for _ in range(12)
    ]
    with_reads, probes = _replayed(records, catch_up=16), _replayed(records, catch_up=0)
    assert with_reads["false_positive_rate"] == 0.0 and with_reads["detected_rate"] >= 0.9
    assert probes["detected_rate"] < with_reads["detected_rate"]
