"""The prompt slices shipped in specdraft/data: what the README says of them, that they are cut from
the full files by the committed rule, and where a data file is read from (``$SPECDRAFT_DATA``, then
``../shared/data``, then the slice, with a note)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from specdraft.bench import prompts as P
from specdraft.bench.prompts import SHIPPED_DATA, data_file, load_prompts
from specdraft.data.make_slices import SLICES, make_slices
from specdraft.design import data as D
from specdraft.design.build import source_name
from specdraft.errors import SpecdraftError
from specdraft.study import datasets

LICENCES = {
    "spec_bench/question.jsonl": "spec_bench/LICENSE",
    "hellaswag_prompts.jsonl": "LICENSE.hellaswag",
    "gsm8k/train.jsonl": "gsm8k/LICENSE",
}
FULL = P.SHARED_DATA  # the real ../shared/data (tests below move P.SHARED_DATA)
needs_full_data = pytest.mark.skipif(
    not all((FULL / s.path).is_file() for s in SLICES), reason="the full data files are not at ../shared/data"
)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def no_data_folder(tmp_path, monkeypatch):
    """A clone with nothing beside it: ``$SPECDRAFT_DATA`` points nowhere, no ``../shared/data``."""
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path / "nonexistent"))
    monkeypatch.setattr(P, "SHARED_DATA", tmp_path / "no-shared" / "data")
    monkeypatch.setattr(P, "_noted", set())


def fake_data_folder(root, tag: str):
    """A data folder whose files are recognisably ``tag``'s."""
    (root / "gsm8k").mkdir(parents=True)
    (root / "spec_bench").mkdir()
    for name, key in (("gsm8k/train.jsonl", "question"), ("hellaswag_prompts.jsonl", "prompt")):
        (root / name).write_text("".join(json.dumps({key: f"{tag} {key} {i}"}) + "\n" for i in range(300)))
    (root / "spec_bench/question.jsonl").write_text(json.dumps({"category": tag, "turns": ["hi"]}) + "\n")
    return root


def test_slices_are_what_the_readme_says():
    readme = (SHIPPED_DATA / "README.md").read_text()
    sums = re.findall(r"^([0-9a-f]{64})  (full|slice) (\S+)$", readme, re.MULTILINE)
    full = {name: digest for digest, kind, name in sums if kind == "full"}
    shipped = {name: digest for digest, kind, name in sums if kind == "slice"}
    assert full.keys() == shipped.keys() == LICENCES.keys() == {s.path for s in SLICES}
    for s in SLICES:
        assert sha256(SHIPPED_DATA / s.path) == shipped[s.path], s.path
        assert full[s.path] == s.full_sha256, s.path
        assert len((SHIPPED_DATA / s.path).read_bytes().splitlines()) == s.lines, s.path
        assert (SHIPPED_DATA / LICENCES[s.path]).stat().st_size > 500, LICENCES[s.path]
    assert "Apache License" in (SHIPPED_DATA / "spec_bench/LICENSE").read_text()
    questions = [json.loads(line) for line in (SHIPPED_DATA / "spec_bench/question.jsonl").open()]
    counts = Counter(q["category"] for q in questions)
    assert len(counts) == 13 and set(counts.values()) == {4}, counts
    assert "52-question slice of Spec-Bench" in readme and "first 400" in readme and "last 400" in readme
    files = [f for f in SHIPPED_DATA.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    total = sum(f.stat().st_size for f in files)
    assert total < 420_000, total  # slices, not copies


@needs_full_data
def test_slices_are_cut_from_the_full_files_by_the_committed_rule(tmp_path):
    written = make_slices(FULL, tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [s.path for s in SLICES]
    for s in SLICES:
        assert sha256(FULL / s.path) == s.full_sha256
        assert (tmp_path / s.path).read_bytes() == (SHIPPED_DATA / s.path).read_bytes(), s.path
    gsm8k = (FULL / "gsm8k/train.jsonl").read_bytes().splitlines(keepends=True)
    hellaswag = (FULL / "hellaswag_prompts.jsonl").read_bytes().splitlines(keepends=True)
    assert (SHIPPED_DATA / "gsm8k/train.jsonl").read_bytes() == b"".join(gsm8k[:400])
    assert (SHIPPED_DATA / "hellaswag_prompts.jsonl").read_bytes() == b"".join(hellaswag[-400:])
    full_bench = [json.loads(line) for line in (FULL / "spec_bench/question.jsonl").open()]
    seen: Counter = Counter()
    firsts = [q for q in full_bench if (seen.update([q["category"]]) or seen[q["category"]]) <= 4]
    assert [json.loads(line) for line in (SHIPPED_DATA / "spec_bench/question.jsonl").open()] == firsts


def test_slices_are_only_cut_from_the_upstream_files(tmp_path):
    fake_data_folder(tmp_path / "fake", "fake")
    with pytest.raises(SpecdraftError, match="sha256 .* is not the upstream file's"):
        make_slices(tmp_path / "fake", tmp_path / "out")
    with pytest.raises(SpecdraftError, match="full data file not found"):
        make_slices(tmp_path / "nothing", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_clone_with_no_data_folder_reads_the_slices_with_a_note(no_data_folder, capsys):
    for s in SLICES:
        assert data_file(s.path) == SHIPPED_DATA / s.path
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"note: using the {s.lines}-{s.unit} slice of {s.name} shipped in specdraft/data; "
        "set SPECDRAFT_DATA for the full set"
        for s in SLICES
    ]
    assert err[0].startswith("note: using the 52-question slice of Spec-Bench shipped in specdraft/data")
    data_file(SLICES[0].path)
    assert capsys.readouterr().err == ""  # once per file
    assert datasets.default_hellaswag_path() == SHIPPED_DATA / "hellaswag_prompts.jsonl"
    assert datasets.default_prompts_path() == SHIPPED_DATA / "spec_bench/question.jsonl"
    bench = load_prompts()
    assert len(bench) == 52 and len(load_prompts(limit=1)) == 13
    texts = D.training_prompts(6)
    assert texts == D.training_prompts(6, root=SHIPPED_DATA) and len(set(texts)) == 6
    assert len(D.training_prompts(1000)) == 400  # 200 per source after the 200 held out
    assert len(set(D.training_prompts(400, split="val"))) == 400
    assert source_name("gsm8k").startswith("specdraft/data/gsm8k/train.jsonl (the slice shipped")


def test_shared_data_is_preferred_and_specdraft_data_first(tmp_path, monkeypatch):
    shared = fake_data_folder(tmp_path / "shared" / "data", "shared")
    monkeypatch.setattr(P, "SHARED_DATA", shared)
    monkeypatch.delenv("SPECDRAFT_DATA", raising=False)
    for s in SLICES:
        assert data_file(s.path) == shared / s.path
    assert [p.category for p in load_prompts()] == ["shared"]
    assert all(t.startswith("shared ") for t in D.training_prompts(10))
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path / "nonexistent"))  # set but absent: ../shared/data
    assert data_file("gsm8k/train.jsonl") == shared / "gsm8k/train.jsonl"
    env = tmp_path / "env"
    (env / "gsm8k").mkdir(parents=True)
    (env / "gsm8k/train.jsonl").write_text("".join(f'{{"question": "env q{i}"}}\n' for i in range(300)))
    monkeypatch.setenv("SPECDRAFT_DATA", str(env))  # replaces one file; the others from ../shared/data
    texts = D.training_prompts(4)
    assert all(t.startswith("env ") for t in texts[0::2])
    assert all(t.startswith("shared ") for t in texts[1::2])
    assert source_name("gsm8k") == str(env / "gsm8k/train.jsonl")


def test_missing_everywhere_names_the_first_place_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "SHARED_DATA", tmp_path / "shared" / "data")
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path / "env"))
    assert data_file("nothing.jsonl") == tmp_path / "env" / "nothing.jsonl"
    monkeypatch.delenv("SPECDRAFT_DATA")
    assert data_file("nothing.jsonl") == tmp_path / "shared" / "data" / "nothing.jsonl"


@needs_full_data
def test_the_full_files_keep_the_recipes_names(monkeypatch):
    monkeypatch.delenv("SPECDRAFT_DATA", raising=False)
    recipe = json.loads((P.REPO_ROOT / "drafts/smollm2-135m-l2/specdraft.json").read_text())
    assert [source_name(s) for s in ("gsm8k", "hellaswag")] == recipe["recipe"]["data"]["sources"]


def test_cache_keys_full_files_as_before_slices_apart(tmp_path, monkeypatch):
    """Answers to the full files keep the keys they had before the slices; a slice gets its own."""
    target = SimpleNamespace(name="tiny", source="stub")
    pipe = SimpleNamespace(target=target, runtime=SimpleNamespace(vocab_size=256))
    # no prompts: only the cache folder (its key and meta.json) is made
    kw = {"n_prompts": 0, "max_new_tokens": 2, "topk": 2, "cache": tmp_path / "cache", "progress": False}
    monkeypatch.setattr(P, "_noted", set())
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path / "nonexistent"))
    monkeypatch.setattr(P, "SHARED_DATA", fake_data_folder(tmp_path / "shared" / "data", "shared"))
    D.target_data(pipe, **kw)
    spec = {"split": "train", "seed": 0, "max_new": 2, "topk": 2, "hidden": False}  # the fields before slices
    full_key = f"data-{D._cache_key('tiny', 256, spec)}"
    assert [d.name for d in (tmp_path / "cache").iterdir()] == [full_key]
    monkeypatch.setattr(P, "SHARED_DATA", tmp_path / "no-shared")
    D.target_data(pipe, **kw)
    (slice_dir,) = [d for d in (tmp_path / "cache").iterdir() if d.name != full_key]
    meta = json.loads((slice_dir / "meta.json").read_text())
    digests = {s: sha256(SHIPPED_DATA / D.SOURCE_FILES[s])[:12] for s in ("gsm8k", "hellaswag")}
    assert meta["slices"] == digests
