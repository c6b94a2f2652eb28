import json

import pytest

from specdraft.bench import prompts
from specdraft.bench.prompts import (
    SHIPPED_DATA,
    BenchPrompt,
    data_file,
    default_prompts_path,
    fit_context,
    load_prompts,
    parse_categories,
    read_prompts,
)
from specdraft.errors import SpecdraftError


def write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture
def mixed(tmp_path):
    return write(
        tmp_path / "mixed.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Make it shorter."]},
            {"question_id": 82, "category": "writing", "turns": ["Write an email."]},
            "",
            {"question_id": 7, "category": "qa", "turns": ["Who wrote Hamlet?"]},
            {"prompt": "Once upon a time"},
            {"prompt": "The cat", "category": "qa"},
        ],
    )


def test_reads_both_formats_in_file_order(mixed):
    prompts = read_prompts(mixed)
    assert prompts[0] == BenchPrompt("81", "writing", ("Write a poem.", "Make it shorter."))
    assert [p.category for p in prompts] == ["writing", "writing", "qa", "mixed", "qa"]
    assert prompts[3] == BenchPrompt("5", "mixed", ("Once upon a time",))  # id = line number, category = stem


def test_malformed_line_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.jsonl", [{"prompt": "fine"}, '{"prompt": "broken"'])
    with pytest.raises(SpecdraftError, match=r"bad\.jsonl:2: malformed JSON"):
        read_prompts(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ({"question_id": 1, "category": "qa"}, "needs 'turns'"),
        ({"turns": []}, "non-empty list"),
        ({"turns": ["ok", ""]}, "non-empty strings"),
        ({"prompt": "  "}, "non-empty string"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_invalid_lines_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "p.jsonl", [{"prompt": "fine"}, {"prompt": "fine"}, line])
    with pytest.raises(SpecdraftError, match=rf"p\.jsonl:3: .*{message}"):
        read_prompts(path)


def test_empty_file_is_a_clear_error(tmp_path):
    path = write(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(SpecdraftError, match="has no prompts"):
        read_prompts(path)


def test_missing_file(tmp_path):
    with pytest.raises(SpecdraftError, match="prompt file not found"):
        read_prompts(tmp_path / "nope.jsonl")


def test_unknown_category_lists_the_known_ones(mixed):
    with pytest.raises(SpecdraftError, match="unknown category poetry: the file has writing, qa, mixed"):
        load_prompts(mixed, ["qa", "poetry"])


def test_limit_is_per_category_and_categories_filter(mixed):
    prompts = load_prompts(mixed, ["writing", "qa"], limit=1)
    assert [(p.category, p.id) for p in prompts] == [("writing", "81"), ("qa", "7")]
    assert len(load_prompts(mixed, None, limit=2)) == 5
    with pytest.raises(SpecdraftError, match="--limit"):
        load_prompts(mixed, None, limit=0)


def test_parse_categories():
    assert parse_categories(" qa, rag ,") == ["qa", "rag"]
    assert parse_categories("") is None and parse_categories(None) is None


def test_default_suite_falls_back_to_the_shipped_slice_and_specdraft_data_overrides_it(tmp_path, monkeypatch):
    # a clone with no data folder beside it
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path / "nonexistent"))
    monkeypatch.setattr(prompts, "SHARED_DATA", tmp_path / "no-shared")
    assert default_prompts_path() == SHIPPED_DATA / "spec_bench" / "question.jsonl"
    shipped = load_prompts()
    assert len(shipped) == 52 and len({p.category for p in shipped}) == 13  # 4 per category
    assert [p.id for p in load_prompts(categories=["writing"])] == ["81", "82", "83", "84"]
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path))
    (tmp_path / "spec_bench").mkdir()
    write(tmp_path / "spec_bench" / "question.jsonl", [{"question_id": 1, "category": "qa", "turns": ["hi"]}])
    assert default_prompts_path() == tmp_path / "spec_bench" / "question.jsonl"
    assert [p.category for p in load_prompts()] == ["qa"]


def test_the_full_suite_comes_from_shared_data_when_present(monkeypatch):
    monkeypatch.delenv("SPECDRAFT_DATA", raising=False)
    if not (prompts.SHARED_DATA / "spec_bench" / "question.jsonl").is_file():
        pytest.skip("no ../shared/data beside this checkout")
    assert default_prompts_path() == prompts.SHARED_DATA / "spec_bench" / "question.jsonl"
    full = load_prompts()
    assert len(full) == 480 and len({p.category for p in full}) == 13


def test_a_missing_data_file_names_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "SHARED_DATA", tmp_path / "shared")
    monkeypatch.setenv("SPECDRAFT_DATA", str(tmp_path))
    assert data_file("nothing.jsonl") == tmp_path / "nothing.jsonl"
    monkeypatch.delenv("SPECDRAFT_DATA")
    assert data_file("nothing.jsonl") == tmp_path / "shared" / "nothing.jsonl"
    with pytest.raises(SpecdraftError, match="prompt file not found: .*nothing.jsonl"):
        read_prompts(data_file("nothing.jsonl"))


def test_fit_context_truncates_the_middle_or_skips():
    ids = list(range(100))
    assert fit_context(ids, 100).ids == ids and fit_context(ids, 100).message is None
    cut = fit_context(ids, 40, "truncate", keep_tail=10)
    assert cut.ids == list(range(30)) + list(range(90, 100))
    assert cut.dropped == 60 and "truncated from 100 to 40" in cut.message
    skipped = fit_context(ids, 40, "skip")
    assert skipped.ids is None and "skipped" in skipped.message
