"""The prompt sets shipped in specdraft/data: what the README says of them, and that every reader
finds them when no data folder lies beside the clone (``$SPECDRAFT_DATA`` pointing nowhere)."""

from __future__ import annotations

import hashlib
import re

import pytest

from specdraft.bench.prompts import SHIPPED_DATA, data_file
from specdraft.design import data as D
from specdraft.design.build import source_name
from specdraft.study import datasets

FILES = {"spec_bench/question.jsonl": "spec_bench/LICENSE", "hellaswag_prompts.jsonl": "LICENSE.hellaswag",
         "gsm8k/train.jsonl": "gsm8k/LICENSE"}


@pytest.fixture
def no_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path / "nonexistent"))


def test_readme_sums_match_and_each_file_has_its_licence():
    readme = (SHIPPED_DATA / "README.md").read_text()
    sums = dict((name, digest) for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M))
    assert sums.keys() == FILES.keys()
    for name, licence in FILES.items():
        assert hashlib.sha256((SHIPPED_DATA / name).read_bytes()).hexdigest() == sums[name], name
        assert (SHIPPED_DATA / licence).stat().st_size > 500, licence
    assert "Apache License" in (SHIPPED_DATA / "spec_bench/LICENSE").read_text()


def test_training_prompts_and_study_defaults_come_from_the_shipped_copy(no_data_folder):
    for name in FILES:
        assert data_file(name) == SHIPPED_DATA / name
    assert datasets.default_hellaswag_path() == SHIPPED_DATA / "hellaswag_prompts.jsonl"
    assert datasets.default_prompts_path() == SHIPPED_DATA / "spec_bench/question.jsonl"
    texts = D.training_prompts(6)
    assert texts == D.training_prompts(6, root=SHIPPED_DATA) and len(set(texts)) == 6
    assert len(D.training_prompts(10, split="val", sources=("gsm8k",))) == 10
    assert source_name("gsm8k") == "specdraft/data/gsm8k/train.jsonl"


def test_specdraft_data_replaces_one_training_file(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k/train.jsonl").write_text("".join(f'{{"question": "q{i}"}}\n' for i in range(300)))
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path))
    texts = D.training_prompts(4)
    assert all(t.startswith("q") for t in texts[0::2])  # gsm8k from $SPECDRAFT_DATA
    assert not any(t.startswith("q") for t in texts[1::2])  # hellaswag from the shipped copy
    assert source_name("gsm8k") == str(tmp_path / "gsm8k/train.jsonl")
