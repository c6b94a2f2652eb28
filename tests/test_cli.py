"""The ``specdraft`` command table across subcommands: every bad input as one line on stderr with a
non-zero exit status and no traceback, bad arguments refused before a model loads. Each command's
own behaviour is tested in tests/commands/."""

import subprocess
import sys
from pathlib import Path

import pytest

from specdraft.models.tiny import tiny_llama, tiny_tokenizer
from tests.helpers import TINY_CLI as TINY
from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory):
    """A draft model whose tokenizer has two more tokens than the tiny target's."""
    d = tmp_path_factory.mktemp("other-vocab")
    tok = tiny_tokenizer()
    tok.add_tokens(["<x>", "<y>"])
    tiny_llama(vocab_size=len(tok), seed=2).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", *TINY, ""], "empty prompt"),
        (["generate", *TINY, "   "], "empty prompt"),
        (["generate", *TINY, "--k", "-1", "hi"], "k must be"),
        (["generate", *TINY, "--k", "lots", "hi"], "--k must be"),
        (["generate", "--target", "no-such-model", "hi"], "unknown model 'no-such-model'"),
        (["generate", *TINY, "--draft", "no-such-draft", "hi"], "unknown model 'no-such-draft'"),
        (["generate", *TINY, "--max-new-tokens", "600", "hi"], "context window"),
        (["generate", *TINY, "--max-new-tokens", "0", "hi"], "--max-new-tokens: must be >= 1, got 0"),
        (["generate", *TINY, "--temperature", "-1", "hi"], "temperature"),
        (["generate", *TINY, "--draft", "prune:x", "hi"], "argument --draft: bad draft spec prune:x"),
        (["check", *TINY, "--draft", "none", "--prompt", "hi"], "nothing to check"),
        (["check", *TINY, "--prompts", "/no/such/file.txt"], "prompt file not found"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert lines[0].startswith(f"specdraft {argv[0]}: error:")
    assert "Traceback" not in err + out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "--port", "70000"], "argument --port: must be a TCP port (0-65535), got 70000"),
        (["serve", "--port", "-1"], "argument --port: must be >= 0, got -1"),
        (["serve", "--k", "-1"], "argument --k: draft length k must be >= 0, got -1"),
        (["generate", "--threads", "0", "hi"], "argument --threads: must be >= 1, got 0"),
        (["generate", "--max-new-tokens", "0", "hi"], "argument --max-new-tokens: must be >= 1, got 0"),
        (["generate", "--k", "-1", "hi"], "argument --k: draft length k must be >= 0, got -1"),
        (["generate", "--k", "two", "hi"], "argument --k: --k must be an integer >= 0"),
        (["generate", "--threads", "many", "hi"], "argument --threads: expected an integer, got 'many'"),
        (["check", "--max-new-tokens", "0", "--prompt", "hi"], "argument --max-new-tokens: must be >= 1"),
        (["demo", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["generate", "--dtype", "fp8", "hi"], "argument --dtype: invalid choice: 'fp8'"),
        (["bench", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
        (["study", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["design", "data", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_loads(capsys, monkeypatch, argv, message):
    """The default target (the real SmolLM2) would load first if these were checked after parsing."""
    from specdraft import api

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(api, "load", no_load)
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    prog = "specdraft " + " ".join(argv[:2] if argv[0] == "design" else argv[:1])  # design has actions
    assert line.startswith(f"{prog}: error: {message}"), err


def test_vocab_mismatch_in_a_real_process(other_tokenizer_dir):
    """The command end to end (a draft model loads first): one line, exit 2, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdraft.cli", "generate", *TINY, "--draft", str(other_tokenizer_dir), "hi"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "different tokenizer" in lines[0], proc.stderr
    assert lines[0].startswith("specdraft generate: error:")
    assert "Traceback" not in proc.stderr + proc.stdout


FREEZE = """
import gc, sys
from specdraft import cli
sys.argv = ["specdraft", "no-such-command"]
rc = cli.main()
print(gc.get_freeze_count() > 0, gc.isenabled(), rc)
"""


def test_the_command_freezes_its_imports_and_callers_with_arguments_do_not(capsys):
    """``specdraft`` (``main()``) freezes what it imported out of the garbage collector's reach
    (start time, issue 15) and leaves the collector on; ``main(argv)`` freezes nothing."""
    import gc

    before = gc.get_freeze_count()
    assert run_cli(capsys, "no-such-command")[0] == 2
    assert gc.get_freeze_count() == before and gc.isenabled()
    out = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == ["True", "True", "2"]
