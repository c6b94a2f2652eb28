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
