"""``design build --kind feature --prompt-pairs N``: a feature draft that reads the prompt's pairs,
warm-started from a feature draft (``--init-from``); the count travels in ``specdraft.json`` to the
engine-side drafter, and decoding with it is plain decoding's output. Bad values are one line."""

import json

import pytest

from specdraft import api
from specdraft.cli import main
from specdraft.engine import Engine
from tests.helpers import TINY_BUILD, decode, random_prompts

BASE = [*TINY_BUILD, "--layers", "1", "--batch-size", "2", "--kind"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))


def test_a_feature_draft_reading_the_prompt_is_built_loaded_and_lossless(tmp_path):
    feat, read = tmp_path / "feat", tmp_path / "read"
    assert main([*BASE, "feature", "--head", "64", "--steps", "2", "--out", str(feat)]) == 0
    cmd = [
        *BASE,
        "feature",
        "--init-from",
        str(feat),
        "--prompt-pairs",
        "16",
        "--steps",
        "2",
        "--out",
        str(read),
    ]
    assert main(cmd) == 0
    assert json.loads((read / "specdraft.json").read_text())["arch"] == {"prompt_pairs": 16}
    assert json.loads((feat / "specdraft.json").read_text())["arch"] == {}
    assert api.load("tiny", draft=f"designed:{feat}", dtype="fp32").drafter.prompt_pairs == 0
    pipe = api.load("tiny", draft=f"designed:{read}", dtype="fp32")
    assert pipe.drafter.prompt_pairs == 16
    prompts = random_prompts([5, 30, 8], seed=4)
    engine = pipe.engine(3)
    assert decode(engine, prompts, 16) == decode(Engine(pipe.runtime), prompts, 16)
    assert engine.stats.drafted > 0


@pytest.mark.parametrize("bad", [["layers", "--prompt-pairs", "4"], ["feature", "--prompt-pairs", "-1"]])
def test_impossible_prompt_pairs_are_one_line(tmp_path, capsys, bad):
    assert main([*BASE, *bad, "--steps", "0", "--out", str(tmp_path / "x")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prompt-pairs" in err[0]
