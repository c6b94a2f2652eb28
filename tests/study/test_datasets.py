"""Datasets of the study: selection, held-out slice, bad input."""

from __future__ import annotations

import pytest

from specdraft.errors import SpecdraftError
from specdraft.study.datasets import HELDOUT, select_prompts
from tests.study.conftest import HELLASWAG


def test_categories_hellaswag_tail_and_disjoint_heldout(data_files):
    texts, held = select_prompts(data_files[0], data_files[1], None, per_dataset=2, heldout=3)
    assert list(texts) == ["qa", "math", "hellaswag"]
    assert texts["qa"] == ["What is the capital of France?", "Who wrote Hamlet?"]
    assert texts["math"][0] == "What is 12 times 12?"  # first turn only
    assert texts["hellaswag"] == HELLASWAG[-2:]
    assert held == HELLASWAG[-5:-2] and not set(held) & set(texts["hellaswag"])


def test_dataset_filter_and_unknown_name(data_files):
    texts, _ = select_prompts(data_files[0], data_files[1], ["math"], 5, 0)
    assert list(texts) == ["math"] and len(texts["math"]) == 3
    with pytest.raises(SpecdraftError, match="unknown dataset poetry: available are qa, math, hellaswag"):
        select_prompts(data_files[0], data_files[1], ["poetry"], 2, 0)


def test_bad_files(tmp_path, data_files):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(SpecdraftError, match="has no prompts"):
        select_prompts(empty, None, None, 2, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "broken\n')
    with pytest.raises(SpecdraftError, match=r"bad\.jsonl:2: malformed JSON"):
        select_prompts(None, bad, None, 1, 0)
    with pytest.raises(SpecdraftError, match="needs 2 \\+ 9 held out"):
        select_prompts(None, data_files[1], None, 2, 9)
    with pytest.raises(SpecdraftError, match="no datasets"):
        select_prompts(None, None, None, 2, 0)


def test_build_attaches_continuations(tiny_pipe, data_files, tmp_path):
    from tests.study.conftest import small_datasets

    datasets, heldout = small_datasets(
        tiny_pipe, data_files, names=["qa"], per_dataset=2, heldout=2, max_new_tokens=10, cache_dir=tmp_path
    )
    assert [d.name for d in datasets] == ["qa"] and heldout.name == HELDOUT
    assert all(len(s.continuation) == 10 and s.prompt for s in datasets[0].sequences)
    assert datasets[0].fingerprint != heldout.fingerprint
