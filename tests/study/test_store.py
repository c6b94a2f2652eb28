"""The results file: unique keys, fsynced appends, resume after a kill, clear errors."""

from __future__ import annotations

import json

import pytest

from specdraft.durable import read_rows
from specdraft.errors import SpecdraftError
from specdraft.study.store import ResultStore, code_version, row_key


def test_keys_depend_on_config_and_code_version():
    a = row_key({"draft": "lookup", "k": 2}, "v1")
    assert a == row_key({"k": 2, "draft": "lookup"}, "v1")  # key order does not matter
    assert a != row_key({"draft": "lookup", "k": 3}, "v1")
    assert a != row_key({"draft": "lookup", "k": 2}, "v2")
    v = code_version()
    assert v == code_version() and v.startswith("0.") and "+" in v


def test_append_skips_known_keys_and_survives_reopen(tmp_path):
    path = tmp_path / "r.jsonl"
    s = ResultStore(path)
    assert s.append({"key": "a", "kind": "config", "x": 1})
    assert not s.append({"key": "a", "kind": "config", "x": 2})
    assert s.extend([{"key": "b", "kind": "quality"}, {"key": "a"}]) == 1
    again = ResultStore(path)
    assert [r["key"] for r in again.rows] == ["a", "b"] and "b" in again
    assert [r["x"] for r in again.of_kind("config")] == [1]


def test_truncated_last_line_is_dropped_and_cut(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"key": "a"}) + "\n" + '{"key": "b", "val')  # a kill mid-write
    s = ResultStore(path)
    assert s.keys == {"a"}
    s.append({"key": "b"})
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == ["a", "b"]


def test_whole_last_row_without_newline_is_kept_on_disk_once(tmp_path):
    """A kill between a row and its newline: the row counts as done, so it must stay in the file."""
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"key": "a"}) + "\n" + json.dumps({"key": "b", "x": 1}))
    s = ResultStore(path)
    assert s.keys == {"a", "b"}
    assert not s.append({"key": "b", "x": 2})  # done: not recomputed
    assert s.append({"key": "c"})
    again = ResultStore(path)
    assert [r["key"] for r in again.rows] == ["a", "b", "c"] and again.rows[1]["x"] == 1
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"key": "a"}\n{oops\n{"key": "c"}\n')
    with pytest.raises(SpecdraftError, match=r"r\.jsonl:2: malformed JSON"):
        ResultStore(path)
    path.write_text('{"key": "a"}\n[1, 2]\n')
    with pytest.raises(SpecdraftError, match=r"r\.jsonl:2: expected a JSON object"):
        read_rows(path)
    with pytest.raises(SpecdraftError, match="not found"):
        read_rows(tmp_path / "missing.jsonl")
