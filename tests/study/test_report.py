"""specdraft report: sections, plots, generated findings, bench JSON, bad input."""

from __future__ import annotations

import json

import pytest

from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.study.report import _ranks, pearson, short_name, spearman, write_report

BENCH = {
    "config": {
        "target": "tiny",
        "draft": "lookup",
        "k": "5",
        "command": "specdraft bench --target tiny --draft lookup",
    },
    "overall": {
        "prompts": 2,
        "tokens_per_s": 30.0,
        "plain_tokens_per_s": 20.0,
        "speedup": 1.5,
        "mean_accepted_tokens": 1.8,
        "acceptance_rate": 0.3,
        "identical": 2,
        "tie_divergent": 0,
        "divergent": 0,
        "hf_plain_tokens_per_s": 10.0,
        "hf_assisted_tokens_per_s": 12.0,
    },
    "categories": {
        "qa": {
            "prompts": 1,
            "tokens_per_s": 25.0,
            "plain_tokens_per_s": 20.0,
            "speedup": 1.25,
            "mean_accepted_tokens": 1.5,
            "acceptance_rate": 0.2,
            "identical": 1,
            "tie_divergent": 0,
            "divergent": 0,
            "hf_plain_tokens_per_s": 9.0,
            "hf_assisted_tokens_per_s": 11.0,
        },
        "math": {
            "prompts": 1,
            "tokens_per_s": 35.0,
            "plain_tokens_per_s": 20.0,
            "speedup": 1.75,
            "mean_accepted_tokens": 2.1,
            "acceptance_rate": 0.4,
            "identical": 1,
            "tie_divergent": 0,
            "divergent": 0,
            "hf_plain_tokens_per_s": 11.0,
            "hf_assisted_tokens_per_s": 13.0,
        },
    },
    "prompts": [
        {"id": "1", "category": "qa", "speedup": 1.25},
        {"id": "4", "category": "math", "speedup": 1.75},
    ],
    "skipped": [],
}


def _pngs_ok(out, names):
    for n in names:
        data = (out / n).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, n


def test_study_report(sweep_results, tmp_path):
    path = write_report([sweep_results], tmp_path / "rep")
    text = path.read_text()
    assert path.name == "REPORT.md"
    for section in (
        "## Findings",
        "## Drafts",
        "## Throughput vs k",
        "## Speedup vs draft latency",
        "## Acceptance vs draft perplexity",
        "## Draft-step latency breakdown",
        "## Predicted vs measured throughput",
        "## Best configuration per batch size",
    ):
        assert section in text, section
    assert "Throughput depends mainly on draft latency: cannot be judged** from 2 draft(s)" in text
    assert (
        "barely predicts acceptance: " in text
        and "**The best k**" in text
        and "median |predicted - measured|" in text
        and "the speedup over plain decoding, run interleaved with each run" in text
    )
    assert "**Verification cost on this hardware:** a target forward over k + 1 tokens costs " in text
    _pngs_ok(
        path.parent,
        [
            "throughput_vs_k.png",
            "speedup_vs_latency.png",
            "acceptance_vs_perplexity.png",
            "draft_latency_breakdown.png",
            "predicted_vs_measured.png",
            "best_per_batch.png",
        ],
    )
    for png in [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]:
        assert (path.parent / png).is_file()


def test_findings_follow_the_data(sweep_results, tmp_path):
    """Rewrite the latencies so that speedup falls with draft latency: the claim must then hold."""
    rows = [json.loads(x) for x in sweep_results.read_text().splitlines()]
    fake = tmp_path / "fake.jsonl"
    for r in rows:
        if r["kind"] == "config":
            slow = r["draft"] == "prune:0"
            r["t_draft_s"] = 0.010 if slow else 0.001
            r["predicted_speedup"] = 0.5 if slow else 2.0
            r["predicted_tokens_per_s"] = r["predicted_plain_tokens_per_s"] * r["predicted_speedup"]
    rows.append(
        {
            **next(r for r in rows if r["kind"] == "config"),
            "draft": "prune:1",
            "t_draft_s": 0.005,
            "predicted_speedup": 1.0,
            "draft_kind": "model",
        }
    )
    fake.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report([fake], tmp_path / "rep").read_text()
    assert "Throughput depends mainly on draft latency: holds here.** Across 3 drafts" in text
    assert "Spearman rho between draft step latency and predicted speedup is -1.00" in text


def test_bench_only_report_for_the_demo(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    path = write_report([bench], tmp_path / "demo")
    text = path.read_text()
    assert "## Bench: bench.json" in text and "| qa | 1 |" in text and "| **overall** | 2 |" in text
    assert "`specdraft bench --target tiny --draft lookup`" in text
    assert "30.0 tokens/s vs 20.0 plain (1.50x)" in text and "identical to plain decoding for 2 of 2" in text
    _pngs_ok(path.parent, ["bench_1_bench.png"])


def test_profile_json_is_rendered(tmp_path):
    from specdraft.bench.profile import LatencyProfile

    prof = LatencyProfile(
        "t",
        "prune:0",
        "fp32",
        1,
        64,
        3,
        1,
        {1: {1: 0.01, 2: 0.012}},
        {1: 0.002},
        {"attention": 0.0005, "mlp": 0.0005, "lm_head": 0.001},
        "test",
    )
    prof.save(tmp_path / "profile.json")
    text = write_report([tmp_path / "profile.json"], tmp_path / "rep").read_text()
    assert "## Latency profile: profile.json" in text and "## Draft-step latency breakdown" in text
    _pngs_ok(tmp_path / "rep", ["draft_latency_breakdown.png"])


def test_bad_inputs(tmp_path, capsys):
    bad = tmp_path / "results.jsonl"
    bad.write_text('{"kind": "config"}\nnot json\n')
    with pytest.raises(SpecdraftError, match=r"results\.jsonl:2: malformed JSON"):
        write_report([bad], tmp_path / "rep")
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(SpecdraftError, match="not a study results file, bench JSON, latency profile"):
        write_report([other], tmp_path / "rep")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SpecdraftError, match="no results"):
        write_report([empty], tmp_path / "rep")
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"specdraft report: error: report input not found: {tmp_path / 'missing.jsonl'}"]


def test_correlations():
    assert _ranks([10, 20, 20, 5]) == [2, 3.5, 3.5, 1]
    assert pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [1, 10, 100, 1000]) == pytest.approx(1.0)  # monotone, not linear
    assert pearson([1, 2, 3, 4], [1, 10, 100, 1000]) < 0.95
    # ties: ranks [1, 2.5, 2.5, 4] vs [4, 3, 2, 1]
    assert spearman([1, 2, 2, 3], [4, 3, 2, 1]) == pytest.approx(-0.9486833, abs=1e-6)
    assert spearman([1, 2], [1, 2]) is None and pearson([1, 1, 1], [1, 2, 3]) is None


def test_short_names():
    assert short_name("prune:0,1,2,3,29") == "prune:0-3,29"
    assert short_name("prune:0,1,29") == "prune:0,1,29"
    assert short_name("designed:smollm2-135m-family/d1-full-h16k") == "designed:d1-full-h16k"
    assert short_name("designed:smollm2-135m-l2") == "designed:smollm2-135m-l2"
    assert short_name("prune:" + ",".join(map(str, range(28)))) == "prune:0-27"
    assert short_name("lookup") == "lookup"
    assert short_name("prune:0,1,2,17,head=16384") == "prune:0-2,17,head=16384"
