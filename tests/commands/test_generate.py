"""``specdraft generate`` on the tiny model: text and statistics, and --json equal to plain decoding."""

import json

from tests.helpers import TINY_CLI as TINY
from tests.helpers import run_cli


def test_generate_prints_text_and_stats(capsys):
    argv = ("generate", *TINY, "--draft", "self", "--k", "3", "--max-new-tokens", "8", "--no-chat", "hello")
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0 and out.endswith("\n") and len(out) > 1
    assert "mean accepted length 4.00 (bonus token included)" in err


def test_generate_json_matches_plain(capsys):
    args = ("generate", *TINY, "--max-new-tokens", "12", "--json", "--no-chat", "abcabcabc")
    rc, out, _ = run_cli(capsys, *args, "--draft", "lookup", "--k", "4")
    spec = json.loads(out)
    rc0, out0, _ = run_cli(capsys, *args, "--draft", "none")
    plain = json.loads(out0)
    assert rc == rc0 == 0
    assert spec["tokens"] == plain["tokens"] and len(spec["tokens"]) == 12
    assert spec["stats"]["generated"] == 12 and plain["stats"]["mean_accepted_length"] == 1.0


def test_color_marks_each_source(capsys):
    argv = (
        "generate",
        *TINY,
        "--draft",
        "self",
        "--k",
        "3",
        "--max-new-tokens",
        "8",
        "--no-chat",
        "--color",
        "hi",
    )
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0  # (the tiny byte-level tokenizer's pieces rarely decode apart: plain text then)
    assert "draft tokens by source: self green" in err  # the target drafting for itself


def test_coloured_gives_each_source_its_own_colour():
    from types import SimpleNamespace

    from specdraft.commands.generate import RESET, _coloured

    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(chr(97 + i) for i in ids))
    delta = SimpleNamespace(
        text="abcd",
        tokens=[0, 1, 2, 3],
        from_draft=[True, True, True, False],
        source=["lookup", "pool", "lookup", "target"],
    )
    palette = {}
    out = _coloured(tok, delta, palette)
    green, cyan = palette["lookup"], palette["pool"]
    assert green != cyan and "target" not in palette
    assert out == f"{green}a{RESET}{cyan}b{RESET}{green}c{RESET}d"
