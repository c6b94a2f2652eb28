"""The sweep: rows per configuration, predictions, resume after an interruption, executors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdraft import analytic
from specdraft.durable import read_rows
from specdraft.errors import SpecdraftError
from specdraft.study import sweep
from specdraft.study.latency import Latencies
from specdraft.study.offline import OfflineProposals, simulate
from specdraft.study.store import ResultStore
from specdraft.study.sweep import default_drafts, run_sweep
from tests.study.conftest import small_config, small_datasets

REPO = Path(__file__).resolve().parents[2]


def _config_rows(path):
    return [r for r in read_rows(path) if r["kind"] == "config"]


def test_default_drafts_cover_depths_and_layer_choices():
    d = default_drafts(30)
    assert d[:4] == ["prune:0,29", "prune:0,1,29", "prune:0,1,2,29", "prune:0,1,2,3,29"]
    assert "prune:0,1,2,3" in d and "prune:0,10,19,29" in d and d[-1] == "lookup"
    assert len(d) == len(set(d)) >= 8
    assert default_drafts(2) == ["prune:0", "lookup"]  # never the whole target


def test_config_validation():
    with pytest.raises(SpecdraftError):
        small_config(ks=[0, 1])
    with pytest.raises(SpecdraftError):
        small_config(batches=[])
    with pytest.raises(SpecdraftError):
        small_config(drafts=[])


def test_sweep_rows(sweep_results):
    rows = read_rows(sweep_results)
    cfg = [r for r in rows if r["kind"] == "config"]
    # 2 drafts x 3 k x 2 batches x 3 datasets
    assert len(cfg) == 36 and len({r["key"] for r in rows}) == len(rows)
    assert {(r["draft"], r["k"], r["batch"], r["dataset"]) for r in cfg} == {
        (d, k, b, ds)
        for d in ("prune:0", "lookup")
        for k in (1, 2, 4)
        for b in (1, 2)
        for ds in ("qa", "math", "hellaswag")
    }
    for r in cfg:
        assert 1.0 <= r["mean_accepted_length"] <= r["k"] + 1
        assert r["predicted_tokens_per_s"] > 0 and r["predicted_plain_tokens_per_s"] > 0
        assert r["predicted_speedup"] == pytest.approx(
            r["predicted_tokens_per_s"] / r["predicted_plain_tokens_per_s"], rel=1e-3
        )
        assert r["code_version"] and r["config"]["k"] == r["k"]
    model = [r for r in cfg if r["draft"] == "prune:0"]
    assert all(r["draft_perplexity_dataset"] > 1 for r in model)
    assert all(r["draft_perplexity_dataset"] is None for r in cfg if r["draft"] == "lookup")
    quality = {r["draft"]: r for r in rows if r["kind"] == "quality"}
    assert quality["prune:0"]["dataset"] == "hellaswag-heldout" and quality["prune:0"]["perplexity"] > 1
    assert 0 <= quality["prune:0"]["top1_agreement"] <= 1 and quality["lookup"]["perplexity"] is None
    assert {r["draft"] for r in rows if r["kind"] == "latency"} == {None, "prune:0", "lookup"}
    online = [r for r in rows if r["kind"] == "online"]
    assert len(online) == 2
    for r in online:  # greedy: the real run reproduces the cached continuations and their acceptance
        assert r["outputs_equal_cached"] == r["prompts"]
        assert r["online_mean_accepted_length"] >= r["offline_mean_accepted_length"]
        assert r["relative_error"] == pytest.approx(
            analytic.relative_error(r["predicted_tokens_per_s"], r["measured_tokens_per_s"]), abs=1e-4
        )
        # plain decoding ran interleaved: the same tokens, and the speedup is the ratio of the rates
        assert r["outputs_equal_plain"] == r["prompts"] and r["measured_plain_tokens_per_s"] > 0
        assert r["measured_speedup"] == pytest.approx(
            r["measured_tokens_per_s"] / r["measured_plain_tokens_per_s"], rel=1e-3
        )
        assert r["predicted_speedup"] == pytest.approx(
            r["predicted_tokens_per_s"] / r["predicted_plain_tokens_per_s"], rel=1e-3
        )
        assert r["speedup_relative_error"] == pytest.approx(
            analytic.relative_error(r["predicted_speedup"], r["measured_speedup"]), abs=1e-4
        )


def test_prediction_replays_the_analytic_step_time():
    """A fixed latency table: T_target(b, n) = 10 ms * b * n + 5 ms, T_draft(b) = 1 ms * b."""
    from specdraft.bench.profile import LatencyProfile

    def prof(draft):
        return LatencyProfile(
            "t",
            draft or "none",
            "fp32",
            1,
            100,
            1,
            0,
            {b: {n: 0.010 * b * n + 0.005 for n in range(1, 6)} for b in (1, 2)},
            {b: 0.001 * b for b in (1, 2)} if draft else {},
        )

    lat = Latencies(target={100: prof(None)}, drafts={"d": {100: prof("d")}}, draft_kinds={"d": "model"})
    p = OfflineProposals(90, matched=[3, 0, 1, 0, 2, 0], valid=[4] * 6)
    sim = simulate([p], k=2, batch=1)
    tokens, seconds = sweep.predict(sim, lat, "d")
    steps = [s for s in sim.steps if not s.first]
    assert tokens == sum(s.emitted for s in steps)
    assert seconds == pytest.approx(sum(2 * 0.001 + 0.010 * 3 + 0.005 for _ in steps))
    lat.draft_kinds["d"] = "lookup"  # one search per step, whatever k
    assert sweep.predict(sim, lat, "d")[1] == pytest.approx(sum(0.001 + 0.010 * 3 + 0.005 for _ in steps))


def test_prediction_charges_a_draft_that_stops_early_only_the_forwards_it_ran():
    """Gated drafts record per-position draft forwards; a batched step runs the most any row needs."""
    from specdraft.bench.profile import LatencyProfile

    def prof(draft):
        return LatencyProfile(
            "t",
            draft or "none",
            "fp32",
            1,
            100,
            1,
            0,
            {b: {n: 0.010 * n for n in range(1, 6)} for b in (1, 2)},
            {b: 0.001 for b in (1, 2)} if draft else {},
        )

    lat = Latencies(target={100: prof(None)}, drafts={"d": {100: prof("d")}}, draft_kinds={"d": "model"})
    a = OfflineProposals(90, matched=[0, 0, 0, 0], valid=[1, 1, 1, 1], steps=[1, 3, 1, 1])
    b = OfflineProposals(90, matched=[0, 0, 0, 0], valid=[2, 2, 2, 2], steps=[2, 2, 2, 2])
    sim = simulate([a, b], k=4, batch=2)
    assert [s.draft_steps for s in sim.steps] == [2, 3, 2, 2]
    assert [s.draft_steps for s in simulate([a, b], k=2, batch=2).steps] == [2, 2, 2, 2]  # capped at k
    seconds = sweep.predict(sim, lat, "d")[1]
    # first step left out
    assert seconds == pytest.approx(3 * 0.001 + 0.010 * 3 + 2 * (2 * 0.001 + 0.010 * 3))
    # not recorded: k
    assert simulate([OfflineProposals(90, [0], [1])], k=4, batch=1).steps[0].draft_steps is None


def test_interrupted_sweep_resumes_without_duplicates_or_losses(tmp_path, tiny_pipe, data_files, monkeypatch):
    config = small_config(drafts=["prune:0", "prune:1", "lookup"])
    datasets, heldout = small_datasets(tiny_pipe, data_files, cache_dir=tmp_path / "cache")
    path = tmp_path / "results.jsonl"
    real = sweep.run_task
    calls = []

    def dies_on_fourth(task):
        calls.append(task)
        if len(calls) == 4:
            raise KeyboardInterrupt  # the user hits Ctrl-C in the middle of the sweep
        return real(task)

    monkeypatch.setattr(sweep, "run_task", dies_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, datasets, heldout, ResultStore(path), workers=0, progress=False, log=lambda m: None)
    monkeypatch.setattr(sweep, "run_task", real)
    partial = read_rows(path)
    # and a kill in the middle of writing a row
    with path.open("a") as f:
        f.write('{"key": "half-writ')
    summary = run_sweep(
        config, datasets, heldout, ResultStore(path), workers=0, progress=False, log=lambda m: None
    )
    rows = read_rows(path)
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys))  # no duplicates
    assert [r["key"] for r in rows[: len(partial)]] == [r["key"] for r in partial]  # nothing rewritten
    assert len(_config_rows(path)) == 3 * 3 * 2 * 3 == summary.configurations
    assert len([r for r in rows if r["kind"] == "quality"]) == 3
    assert summary.computed == len(rows) - len(partial)  # only the missing rows were computed
    again = run_sweep(
        config, datasets, heldout, ResultStore(path), workers=0, progress=False, log=lambda m: None
    )
    assert again.computed == 0 and again.tasks == 0


def test_killed_cli_sweep_resumes(tmp_path, data_files):
    """A real SIGKILL of `specdraft study` (local process pool of two workers) in the middle, then a rerun."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "specdraft.cli",
        "study",
        "--target",
        "tiny",
        "--drafts",
        "prune:0;prune:1;lookup",
        "--k",
        "1-8",
        "--batch",
        "1,2,4",
        "--spec-bench",
        str(data_files[0]),
        "--hellaswag",
        str(data_files[1]),
        "--prompts-per-dataset",
        "4",
        "--heldout",
        "2",
        "--max-new-tokens",
        "48",
        "--contexts",
        "16,64",
        "--profile-repeats",
        "1",
        "--workers",
        "2",
        "--validate",
        "0",
        "--no-progress",
        "--out",
        str(out),
    ]
    env = {**os.environ, "SPECDRAFT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if results.exists() and b'"kind":"config"' in results.read_bytes():
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stdout.close()
    before = read_rows(results, tolerate_truncated_tail=True)
    total = 3 * 8 * 3 * 3
    assert 0 < len([r for r in before if r["kind"] == "config"]) < total
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read_rows(results)
    assert len(rows) == len({r["key"] for r in rows})
    assert len([r for r in rows if r["kind"] == "config"]) == total
    assert "resuming" in done.stderr


def test_unknown_executor(tmp_path, tiny_pipe, data_files):
    datasets, _ = small_datasets(tiny_pipe, data_files, names=["qa"], cache_dir=tmp_path / "cache")
    with pytest.raises(SpecdraftError, match="unknown executor"):
        run_sweep(
            small_config(drafts=["lookup"]),
            datasets,
            None,
            ResultStore(tmp_path / "r.jsonl"),
            executor="slurm",
            progress=False,
            log=lambda m: None,
        )


def test_online_runs_interleave_the_arms_step_by_step(monkeypatch):
    """Every arm has each batch open at once and the arm furthest behind in emitted tokens steps
    next, so a drift of the machine's speed falls on all arms alike; each arm's run keeps its own
    tokens, outputs and steady-state counts (the first step of each batch left out)."""
    from specdraft.study import validate as v

    log = []

    class FakeEngine:  # the speculative arm emits 2 tokens per row and step, plain decoding 1
        def __init__(self, runtime, drafter, policy):
            self.name, self.per_step = drafter or "plain", 2 if drafter else 1
            self.stats = v.SpecStats()

        def add(self, reqs):
            self.left = {i: r.max_new_tokens for i, r in enumerate(reqs)}
            return list(self.left)

        @property
        def active(self):
            return len(self.left)

        def step(self):
            log.append(self.name)
            events = []
            for i in list(self.left):
                n = min(self.per_step, self.left[i])
                self.left[i] -= n
                events.append(SimpleNamespace(request_id=i, tokens=[7] * n))
                if not self.left[i]:
                    del self.left[i]
            return events

    monkeypatch.setattr(v, "Engine", FakeEngine)
    spec, plain = v.online_runs(None, [("spec", 2), (None, 0)], [[1], [2], [3]], 2, 4, ())
    # batch [1, 2]: spec at 0 tokens steps (4), plain at 0 (2), plain at 2 (4), spec at 4 (8, done),
    # plain (6), plain (8, done); batch [3] alike with one row
    assert log == ["spec", "plain", "plain", "spec", "plain", "plain"] * 2
    assert spec.outputs == plain.outputs == [[7] * 4] * 3
    assert (spec.total_tokens, spec.tokens) == (12, 6) and (plain.total_tokens, plain.tokens) == (12, 9)
    assert spec.seconds > 0 and plain.seconds > 0


def test_summarize_takes_the_median_of_each_error_present():
    from specdraft.study.validate import summarize

    rows = [
        {"relative_error": 0.1, "speedup_relative_error": 0.02},
        {"relative_error": 0.3, "speedup_relative_error": 0.04},
        {"relative_error": 0.2},  # validated before speedups were measured
    ]
    assert summarize(rows) == {
        "validated": 3,
        "median_relative_error": 0.2,
        "median_speedup_relative_error": pytest.approx(0.03),
    }
    assert summarize([]) == {"validated": 0}
