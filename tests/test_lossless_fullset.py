"""The whole-set lossless check (specdraft.lossless.run_fullset, benchmarks/check_lossless.py) on the
tiny random target: identical drafters, a verification that is not bit-identical reported as
divergent with its first differing token, resuming after a kill, settings that changed."""

import dataclasses
import fcntl
import json
import sys
from pathlib import Path

import pytest
import torch

from specdraft import api, lossless
from specdraft.bench.prompts import BenchPrompt
from specdraft.errors import SpecdraftError

PROMPTS = [
    BenchPrompt("1", "writing", ("Write a poem about the sea.", "Now make it shorter.")),
    BenchPrompt("2", "qa", ("Who wrote Hamlet?",)),
    BenchPrompt("3", "qa", ("abc abc abc abc abc abc",)),
]
OPTIONS = lossless.FullsetOptions(k=3, max_new_tokens=8, progress=False)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe():
    return api.load("tiny", "none", dtype="fp32", draft_dtype="fp32")


def drafters(pipe, specs=("lookup", "self")):
    return [(s, lambda s=s: api.make_drafter(s, pipe.target, pipe.runtime, torch.float32)) for s in specs]


class Skewed:
    """The target with a bias on one token's logit in multi-token decode forwards: a verification
    that is not bit-identical to one-token steps (prefill and plain steps are untouched)."""

    def __init__(self, runtime, token: int):
        self.inner, self.token = runtime, token
        self.vocab_size, self.max_context, self.dtype = runtime.vocab_size, runtime.max_context, runtime.dtype

    def new_state(self, batch_size, capacity):
        return self.inner.new_state(batch_size, capacity)

    def forward(self, state, tokens, positions, **kwargs):
        out = self.inner.forward(state, tokens, positions, **kwargs)
        if tokens.shape[1] > 1 and kwargs.get("logits_index") is None:
            bias = torch.zeros(out.logits.shape[-1])
            bias[self.token] = 1000.0
            out = dataclasses.replace(out, logits=out.logits + bias)
        return out


class KilledAfter:
    """A drafter that raises KeyboardInterrupt at its ``n``-th proposal (a run killed mid-question)."""

    def __init__(self, drafter, n: int):
        self.inner, self.left = drafter, n

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, *args, **kwargs):
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt
        return self.inner.propose(*args, **kwargs)


def steady(report: dict) -> dict:
    """The report without its timings (they differ from run to run)."""
    drop = ("seconds", "tokens_per_s")
    return {name: {k: v for k, v in d.items() if k not in drop} for name, d in report["drafters"].items()}


def test_identical_drafters_and_a_skewed_verification_reported_as_divergent(pipe, tmp_path):
    report = lossless.run_fullset(pipe, drafters(pipe), PROMPTS, tmp_path, OPTIONS)
    for name in ("lookup", "self"):
        d = report["drafters"][name]
        assert (d["checked"], d["identical"], d["divergent"], d["complete"]) == (3, 3, 0, True)
    assert report["drafters"]["self"]["mean_accepted_tokens"] > 2.0  # the self draft is always right
    assert report["drafters"]["self"]["drafted"] == report["drafters"]["self"]["accepted"] > 0
    reference = lossless.read_jsonl(tmp_path / lossless.REFERENCE)
    assert [(r["id"], r["turn"]) for r in reference] == [("1", 0), ("1", 1), ("2", 0), ("3", 0)]

    firsts = {r["tokens"][0] for r in reference}
    token = min(set(range(pipe.runtime.vocab_size)) - firsts)
    skewed = api.Pipeline(pipe.target, Skewed(pipe.runtime, token), None)
    build = lambda: api.make_drafter("self", pipe.target, pipe.runtime, torch.float32)  # noqa: E731
    report = lossless.run_fullset(skewed, [("skewed", build)], PROMPTS, tmp_path, OPTIONS)
    assert lossless.read_jsonl(tmp_path / lossless.REFERENCE) == reference  # computed once, reused
    d = report["drafters"]["skewed"]
    assert (d["checked"], d["identical"], d["divergent"]) == (3, 0, 3)
    firsts = {r["id"]: r["tokens"][0] for r in reference if r["turn"] == 0}
    assert d["differences"] == [
        {"id": q, "category": c, "verdict": "divergent", "turn": 0, "position": 0}
        | {"plain_token": firsts[q], "spec_token": token}
        for q, c in (("1", "writing"), ("2", "qa"), ("3", "qa"))
    ]
    assert report["drafters"]["lookup"]["identical"] == 3  # earlier drafters stay in the report
    table = (tmp_path / lossless.REPORT_MD).read_text()
    assert f"| `skewed` | 3/3 | 0 | 0 | 3 | q1 turn 1 token 0: {firsts['1']} -> {token};" in table
    assert json.loads((tmp_path / lossless.REPORT_JSON).read_text()) == report


def test_a_killed_and_resumed_run_reports_as_an_uninterrupted_one(pipe, tmp_path):
    whole = lossless.run_fullset(pipe, drafters(pipe), PROMPTS, tmp_path / "whole", OPTIONS)

    out = tmp_path / "resumed"
    lookup, self_ = drafters(pipe)
    killed = ("self", lambda: KilledAfter(self_[1](), 6))  # stops inside the second question
    with pytest.raises(KeyboardInterrupt):
        lossless.run_fullset(pipe, [lookup, killed], PROMPTS, out, OPTIONS)
    checks = [(r["drafter"], r["id"]) for r in lossless.read_jsonl(out / lossless.CHECKS)]
    assert checks[:3] == [("lookup", q) for q in "123"] and len(checks) < 6
    report = json.loads((out / lossless.REPORT_JSON).read_text())  # written when it stopped
    assert report["drafters"].get("self", {"complete": False})["complete"] is False
    ref = (out / lossless.REFERENCE).read_text()  # killed in the middle of writing question 3's line
    (out / lossless.REFERENCE).write_text(ref[: ref.rindex('{"id": "3"') + 30])
    with open(out / lossless.CHECKS, "a") as f:  # and of a check's
        f.write('{"drafter": "self", "id": "3", "ver')
    resumed = lossless.run_fullset(pipe, drafters(pipe), PROMPTS, out, OPTIONS)
    assert steady(resumed) == steady(whole)
    for name in (lossless.REFERENCE, lossless.CHECKS):
        assert all(
            line.startswith("{") and line.endswith("}") for line in (out / name).read_text().splitlines()
        )
    assert lossless.read_jsonl(out / lossless.REFERENCE) == lossless.read_jsonl(
        tmp_path / "whole" / lossless.REFERENCE
    )


def test_resuming_with_other_settings_is_refused(pipe, tmp_path):
    lossless.run_fullset(pipe, drafters(pipe, ("lookup",)), PROMPTS[1:], tmp_path, OPTIONS)
    other = lossless.FullsetOptions(k=3, max_new_tokens=9, progress=False)
    with pytest.raises(SpecdraftError, match="max_new_tokens 8 -> 9"):
        lossless.run_fullset(pipe, drafters(pipe, ("lookup",)), PROMPTS[1:], tmp_path, other)
    with open(tmp_path / lossless.META) as held:  # another process checking there
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SpecdraftError, match="another check is running"):
            lossless.run_fullset(pipe, drafters(pipe, ("bigram",)), PROMPTS[1:], tmp_path, OPTIONS)
    assert "bigram" not in lossless.fullset_report(tmp_path, 2)["drafters"]
    with open(tmp_path / lossless.CHECKS, "a") as f:
        f.write("not json\n{}\n")
    with pytest.raises(SpecdraftError, match="not a JSON line"):
        lossless.read_jsonl(tmp_path / lossless.CHECKS)


def test_cli(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import check_lossless

    base = ["--target", "tiny", "--dtype", "fp32", "--draft-dtype", "fp32", "--max-new-tokens", "4"]
    base += ["--categories", "qa", "--limit", "1", "--no-progress", "--out", str(tmp_path)]
    assert check_lossless.main([*base, "--drafters", "lookup;bigram"]) == 0
    out = capsys.readouterr().out
    assert "| `lookup` | 1/1 | 1 | 0 | 0 | - |" in out and "| `bigram` | 1/1 | 1 | 0 | 0 | - |" in out
    assert check_lossless.main([*base, "--drafters", "tree:dyn=1,lookup"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
