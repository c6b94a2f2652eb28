"""Draft specs: parsed in one place, printed back the same way, refused with one line."""

import pytest

from specdraft.errors import SpecdraftError
from specdraft.registry import DEFAULT_DRAFT, DRAFTERS, DraftSpec, usage


@pytest.mark.parametrize(
    "text, kind, arg",
    [
        ("none", "none", ""),
        ("lookup", "lookup", ""),
        ("lookup:4", "lookup", "4"),
        ("prune:0, 1,2,29", "prune", "0,1,2,29"),
        ("designed", "designed", ""),
        ("designed:smollm2-135m-l2", "designed", "smollm2-135m-l2"),
        ("self", "self", ""),
        ("smollm2-135m", "model", "smollm2-135m"),
        ("/tmp/some/draft.gguf", "model", "/tmp/some/draft.gguf"),
        ("model:odd-name", "model", "model:odd-name"),
    ],
)
def test_parse_and_str_round_trip(text, kind, arg):
    spec = DraftSpec.parse(text)
    assert (spec.kind, spec.arg) == (kind, arg)
    assert DraftSpec.parse(str(spec)) == spec


def test_default_is_the_default_draft():
    assert DraftSpec.parse("default") == DraftSpec.parse(DEFAULT_DRAFT) == DraftSpec.parse(None)


def test_prune_layers():
    assert DraftSpec.parse("prune:0,1,29").layers == [0, 1, 29]


@pytest.mark.parametrize(
    "text", ["lookup:0", "lookup:x", "prune:", "prune:a,b", "prune:1,1", "prune:-1", "none:3", "self:2"]
)
def test_bad_specs_are_refused_with_one_line(text):
    with pytest.raises(SpecdraftError) as e:
        DraftSpec.parse(text)
    assert "\n" not in str(e.value) and text.split(":")[0] in str(e.value)


def test_usage_names_every_kind():
    line = usage()
    for kind in DRAFTERS:
        assert DRAFTERS[kind].usage in line
