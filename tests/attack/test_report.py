"""``specdraft report`` over hand-made attack.json files: the table, the plot, the findings."""

import json

from tests.helpers import run_cli


def _attack(draft: str, method: str, clean: float, attacked: float, defended_speedup) -> dict:
    overall = {
        "clean_mean_accepted": clean,
        "attacked_mean_accepted": attacked,
        "defended_mean_accepted": 1.04 if defended_speedup is not None else None,
        "identical_prefix_rate": 0.9,
        "rouge_l": 0.83,
        "clean_speedup": 1.31,
        "attacked_speedup": None if defended_speedup is None else 0.87,
        "defended_speedup": defended_speedup,
        "detected_rate": None if defended_speedup is None else 0.75,
        "false_positive_rate": 0.05,
        "halved_rate": 0.6,
        "prompts": 10,
    }
    config = {"draft": draft, "method": method, "command": f"specdraft attack --draft {draft}"}
    return {"config": config, "overall": overall, "notes": {}, "prompts": []}


def test_report_over_attack_files(capsys, tmp_path):
    paths = []
    for i, doc in enumerate(
        [_attack("lookup", "lookup", 1.42, 1.07, 0.98), _attack("prune:0,1", "continuous", 2.5, 1.1, None)]
    ):
        (tmp_path / str(i)).mkdir()
        paths.append(tmp_path / str(i) / "attack.json")
        paths[-1].write_text(json.dumps(doc))
    rc, _, err = run_cli(capsys, "report", *map(str, paths), "--out", str(tmp_path / "rep"))
    assert rc == 0, err
    text = (tmp_path / "rep" / "REPORT.md").read_text()
    assert (tmp_path / "rep" / "attack.png").stat().st_size > 1000
    rows = [line for line in text.splitlines() if line.startswith("| lookup (lookup)")]
    assert rows == [
        "| lookup (lookup) | 10 | 1.42 / 1.07 / 1.04 | 1.31x / 0.87x / 0.98x | 90% | 0.83 | 75% | 5% |"
    ]
    # the continuous attack's unmeasured figures are n/a, never 0
    assert "| prune:0,1 (continuous) | 10 | 2.50 / 1.10 / n/a | 1.31x / n/a / n/a |" in text
    assert "**Attack `lookup (lookup)`** (10 prompts): mean accepted length 1.42 -> 1.07" in text
    assert "0.87x plain undefended, 0.98x defended" in text
    assert "`specdraft attack --draft lookup`" in text


def test_report_rejects_an_unknown_json(capsys, tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"overall": {"speedup": 1.0}}))
    rc, _, err = run_cli(capsys, "report", str(bad), "--out", str(tmp_path / "rep"))
    assert rc == 2 and "attack.json" in err and len(err.strip().splitlines()) == 1


def test_label_names_a_pruned_draft_by_its_layer_ranges():
    from pathlib import Path

    from specdraft.attack.report import label

    doc = {"config": {"draft": "prune:" + ",".join(map(str, range(15))), "method": "continuous"}}
    assert label(Path("x/attack.json"), doc) == "prune:0-14 (continuous)"
    assert label(Path("lookup/attack.json"), {"config": {}}) == "lookup"
