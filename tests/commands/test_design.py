"""``specdraft design`` end to end on the tiny target: build (data, prune, head, distil, save), use
the draft through --draft designed:..., export, search, compare; bad input is one clear line."""

import json

import pytest

from specdraft.cli import main

TINY = ["--target", "tiny", "--threads", "1"]
DATA = ["--prompts", "6", "--val-prompts", "4", "--max-new-tokens", "8", "--gen-batch", "4", "--quiet"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def built(tmp_path):
    out = tmp_path / "d"
    rc = main(
        [
            "design",
            "build",
            *TINY,
            *DATA,
            "--layers",
            "1",
            "--head",
            "64",
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--checkpoint-every",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    return out


def test_build_writes_a_draft_with_its_recipe(built, capsys):
    meta = json.loads((built / "specdraft.json").read_text())
    assert meta["init_layers"] == [1] and len(meta["head_tokens"]) >= 64
    r = meta["recipe"]
    assert r["command"].startswith("specdraft ") and r["seed"] == 0 and r["data"]["train_prompts"] == 6
    assert r["offline"]["steps"] == 3 and {"data_s", "train_s", "total_s"} <= set(r["time_s"])
    assert "spec_bench" not in json.dumps(r["data"]["sources"])
    assert "## Reproduce" in (built / "RECIPE.md").read_text()


def test_built_draft_generates_through_the_cli_and_exports(built, tmp_path, capsys):
    assert (
        main(["generate", "hello", *TINY, "--draft", f"designed:{built}", "--max-new-tokens", "6", "--json"])
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(res["tokens"]) == 6 and res["stats"]["generated"] == 6
    assert main(["design", "export", str(built), *TINY, "--out", str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.num_hidden_layers == 1


def test_rerunning_the_recipe_reproduces_the_weights(built, tmp_path):
    from safetensors.torch import load_file

    again = tmp_path / "again"
    assert (
        main(
            [
                "design",
                "build",
                *TINY,
                *DATA,
                "--layers",
                "1",
                "--head",
                "64",
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--checkpoint-every",
                "1",
                "--out",
                str(again),
            ]
        )
        == 0
    )
    a, b = load_file(str(built / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_search_and_compare_write_rows(tmp_path, capsys):
    assert (
        main(["design", "search", *TINY, *DATA, "--max-depth", "2", "--json", str(tmp_path / "s.json")]) == 0
    )
    cands = json.loads((tmp_path / "s.json").read_text())["candidates"]
    assert len(cands) == 3 and cands[0]["tokens_per_s"] >= cands[-1]["tokens_per_s"]  # [0], [1], [0, 1]
    assert (
        main(
            [
                "design",
                "compare",
                *TINY,
                *DATA,
                "--budget-layers",
                "1",
                "--deep",
                "2",
                "--json",
                str(tmp_path / "c.json"),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["depth"] for r in rows] == [1, 2]
    assert abs(rows[1]["params"] - rows[0]["params"]) / rows[0]["params"] < 0.05
    assert all(r["t_draft_ms"] > 0 and 0 <= r["alpha"] <= 1 for r in rows)


def test_incompatible_or_corrupted_draft_is_one_line(built, tmp_path, capsys):
    from specdraft.models.tiny import tiny_llama

    other = tmp_path / "other-target"
    tiny_llama(seed=3).save_pretrained(other)
    from specdraft.models.tiny import tiny_tokenizer

    tiny_tokenizer().save_pretrained(other)
    assert main(["generate", "hi", "--target", str(other), "--draft", f"designed:{built}"]) == 2
    assert "embedding differs" in capsys.readouterr().err
    (built / "model.safetensors").write_bytes(b"garbage")
    assert main(["generate", "hi", *TINY, "--draft", f"designed:{built}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "corrupted" in err and len(err.splitlines()) == 1
    assert main(["generate", "hi", *TINY, "--draft", "designed:no-such-draft"]) == 2
    assert "not found" in capsys.readouterr().err
