"""`specdraft study` and `specdraft report` through the CLI table: a small run, then bad input."""

from __future__ import annotations

import pytest

from specdraft.cli import main
from specdraft.durable import read_rows


def _study(data_files, out, *extra):
    return [
        "study",
        "--target",
        "tiny",
        "--drafts",
        "prune:0;lookup",
        "--k",
        "1-2",
        "--batch",
        "1,2",
        "--spec-bench",
        str(data_files[0]),
        "--hellaswag",
        str(data_files[1]),
        "--prompts-per-dataset",
        "2",
        "--heldout",
        "2",
        "--max-new-tokens",
        "16",
        "--contexts",
        "16,64",
        "--profile-repeats",
        "1",
        "--workers",
        "0",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


def test_study_then_report(tmp_path, data_files, capsys):
    assert (
        main(
            _study(
                data_files,
                tmp_path / "study",
                "--datasets",
                "qa,hellaswag",
                "--validate",
                "1",
                "--validate-reprofile",
            )
        )
        == 0
    )
    out = capsys.readouterr().out
    # 2 drafts x 2 k x 2 batches x 2 datasets + 2 quality rows
    assert "configurations: 16 (computed now: 18)" in out
    assert "online validation: 1 configurations, median |predicted - measured| / measured = " in out
    assert "(with latencies re-measured right before and after each run: " in out
    assert "; of the speedup over plain decoding run interleaved: " in out and "% re-measured)" in out
    rows = read_rows(tmp_path / "study" / "results.jsonl")
    run = [r for r in rows if r["kind"] == "run"]
    assert len(run) == 1 and run[0]["command"].startswith(
        "specdraft study --target tiny --drafts 'prune:0;lookup' --k 1,2"
    )
    assert main(["report", str(tmp_path / "study" / "results.jsonl")]) == 0
    report = tmp_path / "study" / "REPORT.md"
    assert f"report: {report}" in capsys.readouterr().out
    assert "Produced by: `specdraft study --target tiny" in report.read_text()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--datasets", "poetry"], "unknown dataset poetry: available are qa, math, hellaswag"),
        (["--prompts-per-dataset", "0"], "need --prompts-per-dataset >= 1"),
        (["--batch", "1,4"], "--batch 4 needs at least 4 prompts per dataset (--prompts-per-dataset 2)"),
        (["--draft-dtype", "same", "--drafts", "prune:x"], "bad draft spec prune:x"),
    ],
)
def test_bad_input_is_one_line(tmp_path, data_files, capsys, extra, message):
    assert main(_study(data_files, tmp_path / "s", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdraft study: error: ") and message in err[0], err


def test_empty_prompt_file(tmp_path, data_files, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = _study(data_files, tmp_path / "s")
    args[args.index("--hellaswag") + 1] = str(empty)
    assert main(args) == 2
    assert f"prompt file {empty} has no prompts" in capsys.readouterr().err


def test_bad_number_list(capsys):
    assert main(["study", "--k", "one-eight"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected integers like 1-8" in err[0], err
