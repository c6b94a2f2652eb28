"""The seed-claims table (specdraft.study.claims): grouping, bootstrap intervals, verdicts."""

from __future__ import annotations

import pytest

from specdraft.study import claims
from specdraft.study.report import Inputs, Study, spearman

# (spec, layers, width, T_draft ms, tok/s at k=1 and k=2, perplexity); plain decoding runs 20 tok/s
DRAFTS = [
    ("designed:fam/d1-full", 1, 4, 2.0, (26.0, 24.0), 60.0),
    ("designed:fam/d2-half", 2, 2, 2.6, (24.0, 23.0), 55.0),
    ("designed:fam/d4-quarter", 4, 1, 3.4, (22.0, 21.0), 50.0),
    ("designed:fam/d2-full", 2, 4, 3.9, (21.0, 20.5), 40.0),
    ("designed:fam/d4-half", 4, 2, 4.6, (19.0, 18.0), 45.0),
    ("prune:0", 1, 4, 2.1, (16.0, 12.0), 3e6),
    ("lookup", 0, 0, 0.3, (23.0, 25.0), None),
]


def _study(drafts=DRAFTS, batches=(1, 4)) -> Study:
    inp = Inputs()
    for spec, layers, width, ms, tps, ppl in drafts:
        for b in batches:
            for k, rate in zip((1, 2), tps):
                inp.config.append(
                    {
                        "target": "tiny",
                        "draft": spec,
                        "dataset": "qa",
                        "k": k,
                        "batch": b,
                        "t_draft_s": ms / 1e3,
                        "t_target_plain_s": 0.05,
                        "mean_accepted_length": 1.5,
                        "predicted_tokens_per_s": rate * b,
                        "predicted_plain_tokens_per_s": 20.0 * b,
                        "predicted_speedup": rate / 20.0,
                        "draft_kind": "model" if layers else "lookup",
                    }
                )
        if ppl is not None:
            inp.quality.append(
                {"target": "tiny", "draft": spec, "perplexity": ppl, "top1_agreement": 1 / ppl}
            )
        if layers:
            shape = {
                "layers": layers,
                "query_heads": 2 * width,
                "kv_heads": width,
                "ffn": 96 * width,
                "head_rows": 64,
                "layer_parameters": 1000 * layers * width,
                "head_parameters": 64 * 32,
            }
            inp.latency.append({"draft": spec, "draft_shape": shape})
    return Study(inp)


def test_origin():
    assert claims.origin("designed:smollm2-135m-l2") == "trained"
    assert claims.origin("prune:0,1") == "existing"
    assert claims.origin("lookup") == "model-free" and claims.origin("suffix") == "model-free"


def test_bootstrap_interval_brackets_the_estimate():
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    y = [2.0, 1.0, 4.0, 3.0, 6.0, 5.0, 8.0, 7.0]
    lo, hi = claims.bootstrap_spearman(x, y)
    assert -1.0 <= lo <= spearman(x, y) <= hi <= 1.0 and lo < hi
    assert claims.bootstrap_spearman(x, y) == (lo, hi)  # seeded
    assert claims.bootstrap_spearman(x, [-v for v in x]) == pytest.approx((-1.0, -1.0))  # all monotone
    assert claims.bootstrap_spearman(x[:3], y[:3]) is None


def test_equal_parameter_groups_compare_depths_at_one_size():
    groups = claims.equal_parameter_groups(_study())
    by_size = {g[0][0]["layer_parameters"]: [d.draft for _, d in g] for g in groups}
    # 4000 parameters: d1-full, d2-half, d4-quarter; 8000: d2-full, d4-half; prune:0 is not trained
    assert by_size == {
        4000: ["designed:fam/d1-full", "designed:fam/d2-half", "designed:fam/d4-quarter"],
        8000: ["designed:fam/d2-full", "designed:fam/d4-half"],
    }


def test_designed_vs_existing_at_fixed_k():
    st = _study()
    c = claims.designed_vs_existing(st, 1)
    assert c["trained"].draft == "designed:fam/d1-full" and c["existing"].draft == "prune:0"
    assert c["ratio"] == pytest.approx(26.0 / 16.0)  # each at its best fixed k (k=1 both)
    assert claims.designed_vs_existing(_study(DRAFTS[:5]), 1) is None  # no existing draft


def test_section_verdicts_follow_the_data(tmp_path):
    text = claims.section(_study(), tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    # latency: rho -1 over the five trained drafts, its interval below 0, stronger than perplexity's
    assert "holds" in rows["Throughput depends mainly on draft latency"].split(" | ")[3]
    assert "-1.00 [-1.00, -1.00]" in rows["Throughput depends mainly on draft latency"]
    # perplexity rises as speedup rises except one pair: rho 0.9 -> does not hold
    assert "does not hold" in rows["Draft quality barely predicts throughput"]
    assert rows["Depth dominates draft latency (equal parameters)"].split(" | ")[3] == "holds"
    assert "not reached: best 1.62x" in rows["Designed draft +111% over existing (fixed k)"]
    assert (tmp_path / "depth_vs_width.png").read_bytes()[:4] == b"\x89PNG"
    # a deeper draft that is faster at equal size turns the depth verdict
    flipped = [d if d[0] != "designed:fam/d4-half" else (*d[:3], 3.0, *d[4:]) for d in DRAFTS]
    text = claims.section(_study(flipped), tmp_path)
    assert "| partly |" in text


def test_verdicts_read_back_the_table(tmp_path):
    table = claims.section(_study(), tmp_path)
    text = f"# r\n\n## Findings\n\n- x\n\n{table}\n\n## Drafts\n\n| a | b |\n"
    got = dict(claims.verdicts(text))
    assert got["Throughput depends mainly on draft latency"] == "holds"
    assert got["Designed draft +111% over existing (fixed k)"] == "not reached: best 1.62x"
    assert len(got) == 5 and claims.verdicts("# no table\n") == []


def test_groups_span_ten_percent_from_their_smallest_draft():
    from types import SimpleNamespace

    sizes = {"a": (1, 5.41e6), "b": (2, 5.57e6), "c": (4, 5.57e6), "d": (2, 7.08e6), "e": (4, 7.08e6)}
    st = SimpleNamespace(
        drafts=[SimpleNamespace(draft=f"designed:{n}") for n in sizes],
        latency=[
            {
                "draft": f"designed:{n}",
                "draft_shape": {"layers": depth, "layer_parameters": p, "head_rows": 8},
            }
            for n, (depth, p) in sizes.items()
        ],
    )
    groups = [[d.draft for _, d in g] for g in claims.equal_parameter_groups(st)]
    assert groups == [["designed:a", "designed:b", "designed:c"], ["designed:d", "designed:e"]]
