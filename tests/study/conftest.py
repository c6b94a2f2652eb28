"""Fixtures for the study tests: prompt files and one small sweep shared by the report tests
(the sweep itself runs in a few seconds on the tiny random model). ``tiny_pipe`` is the root
conftest's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SPEC_BENCH = [
    {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 3, "category": "qa", "turns": ["How far away is the moon?"]},
    {"question_id": 4, "category": "math", "turns": ["What is 12 times 12?", "And 13 times 13?"]},
    {"question_id": 5, "category": "math", "turns": ["Solve 2x + 3 = 9."]},
    {"question_id": 6, "category": "math", "turns": ["Is 97 prime?"]},
]
HELLASWAG = [f"A person walks into the room number {i} and starts to" for i in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("study-data")
    return write_jsonl(d / "question.jsonl", SPEC_BENCH), write_jsonl(
        d / "hellaswag_prompts.jsonl", [{"prompt": p} for p in HELLASWAG]
    )


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Continuations are cached under a per-session folder, never the user's cache."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path_factory.getbasetemp() / "specdraft-cache"))


def small_config(**kw):
    from specdraft.study.sweep import StudyConfig

    args = {
        "target": "tiny",
        "dtype": "fp32",
        "threads": 1,
        "drafts": ["prune:0", "lookup"],
        "ks": [1, 2, 4],
        "batches": [1, 2],
        "max_new_tokens": 24,
        "contexts": [16, 64],
        "profile_repeats": 1,
    }
    args.update(kw)
    return StudyConfig(**args)


def small_datasets(pipe, data_files, names=None, per_dataset=2, heldout=2, max_new_tokens=24, cache_dir=None):
    from specdraft.study import datasets as ds

    texts, held = ds.select_prompts(data_files[0], data_files[1], names, per_dataset, heldout)
    return ds.build_datasets(
        pipe,
        texts,
        held,
        dtype="fp32",
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=256,
        k_max=8,
        log=lambda m: None,
        cache_dir=cache_dir,
    )


@pytest.fixture(scope="session")
def sweep_results(tmp_path_factory, tiny_pipe, data_files) -> Path:
    """results.jsonl of a small inline sweep with two online validations."""
    from specdraft.study.store import ResultStore, code_version
    from specdraft.study.sweep import latency_rows, run_sweep
    from specdraft.study.validate import validate

    out = tmp_path_factory.mktemp("sweep") / "results.jsonl"
    config = small_config()
    datasets, heldout = small_datasets(tiny_pipe, data_files, cache_dir=out.parent / "cache")
    store = ResultStore(out)
    run_sweep(config, datasets, heldout, store, workers=0, progress=False, log=lambda m: None)
    lat = latency_rows(config, code_version(), store, tiny_pipe, lambda m: None)
    validate(config, {d.name: d for d in datasets}, lat, store, 2, log=lambda m: None)
    return out
