"""``specdraft demo``: bench, profile and report in one folder, the time budget, a clone with no data
folder."""

import json

import torch

from specdraft import cli
from specdraft.bench import prompts


def test_demo_writes_bench_profile_and_report(tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    lines = [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Shorter."]},
        {"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]},
        {"question_id": 3, "category": "qa", "turns": ["Second qa question, left out by --limit 1"]},
    ]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "demo"
    threads = torch.get_num_threads()
    try:
        argv = [
            "demo",
            "--target",
            "tiny",
            "--draft",
            "prune:0",
            "--k",
            "3",
            "--dtype",
            "fp32",
            "--threads",
            "1",
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            "6",
        ]
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    bench = json.loads((out / "bench.json").read_text())
    assert bench["overall"]["prompts"] == 2 and set(bench["categories"]) == {"writing", "qa"}
    assert bench["config"]["command"].startswith("specdraft demo --target tiny --draft prune:0 --k 3")
    assert json.loads((out / "profile.json").read_text())["t_target"]["1"].keys() == {
        "1",
        "2",
        "4",
    }  # n = 1, 2, k + 1
    report = (out / "REPORT.md").read_text()
    assert "bench.json" in report and "profile.json" in report
    stdout = capsys.readouterr().out
    assert f"report: {out / 'REPORT.md'}" in stdout and "| **overall** | 2 |" in stdout


def test_demo_time_budget_leaves_prompts_out(tmp_path):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"prompt {i}", "category": f"c{i}"}) + "\n" for i in range(3))
    )
    out = tmp_path / "demo"
    threads = torch.get_num_threads()
    try:
        argv = [
            "demo",
            "--target",
            "tiny",
            "--draft",
            "prune:0",
            "--dtype",
            "fp32",
            "--threads",
            "1",
            "--no-baselines",
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            "4",
            "--time-budget",
            "0",
        ]
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    bench = json.loads((out / "bench.json").read_text())
    # the first question always runs; with a zero budget no other starts
    assert bench["overall"]["prompts"] == 1
    assert [s["reason"] for s in bench["skipped"]] == ["time budget", "time budget"]


def test_demo_runs_from_a_clone_with_no_data_folder(tmp_path, monkeypatch, capsys):
    """No ``--prompts``, ``$SPECDRAFT_DATA`` pointing nowhere and no ``../shared/data``: the Spec-Bench
    slice shipped in specdraft/data is used, with a note."""
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path / "nonexistent"))
    monkeypatch.setattr(prompts, "SHARED_DATA", tmp_path / "no-shared")
    monkeypatch.setattr(prompts, "_noted", set())
    out = tmp_path / "demo"
    threads = torch.get_num_threads()
    try:
        argv = [
            "demo",
            "--target",
            "tiny",
            "--draft",
            "prune:0",
            "--dtype",
            "fp32",
            "--threads",
            "1",
            "--no-baselines",
            "--out",
            str(out),
            "--max-new-tokens",
            "2",
            "--time-budget",
            "0",
        ]
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    bench = json.loads((out / "bench.json").read_text())
    # --limit 1 (the default) of each of Spec-Bench's 13 categories; the zero budget runs only the first
    assert bench["overall"]["prompts"] == 1 and list(bench["categories"]) == ["writing"]
    assert len(bench["skipped"]) == 12
    err = capsys.readouterr().err
    assert "note: using the 52-question slice of Spec-Bench shipped in specdraft/data" in err


def test_demo_report_links_the_committed_studies(tmp_path, monkeypatch):
    from specdraft.commands import demo

    study = tmp_path / "results" / "study-tiny"
    study.mkdir(parents=True)
    (study / "REPORT.md").write_text(
        "# r\n\n## Seed claims\n\n| claim | paper | here | verdict | plot |\n|---|---|---|---|---|\n"
        "| Throughput depends mainly on draft latency | p | rho -0.9 | holds | x.png |\n\n## Drafts\n"
    )
    (tmp_path / "results" / "study-empty").mkdir()  # no REPORT.md: left out
    monkeypatch.setattr(demo, "STUDIES", tmp_path / "results")
    report = tmp_path / "REPORT.md"
    report.write_text("# demo\n")
    demo._link_studies(report)
    assert report.read_text().endswith(
        "## The seed's claims in the committed studies\n\n"
        f"- [study-tiny]({study / 'REPORT.md'}): Throughput depends mainly on draft latency: holds\n"
    )
