"""The ``specdraft`` command: generate and check on the tiny model, and every bad input as one line
on stderr with a non-zero exit status and no traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft import cli
from specdraft.models.tiny import tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = ["--target", "tiny", "--dtype", "fp32", "--threads", "1"]


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory):
    """A draft model whose tokenizer has two more tokens than the tiny target's."""
    d = tmp_path_factory.mktemp("other-vocab")
    tok = tiny_tokenizer()
    tok.add_tokens(["<x>", "<y>"])
    tiny_llama(vocab_size=len(tok), seed=2).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_prints_text_and_stats(capsys):
    rc, out, err = run_cli(capsys, "generate", *TINY, "--draft", "self", "--k", "3", "--max-new-tokens", "8", "--no-chat", "hello")
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
    proc = subprocess.run([sys.executable, "-m", "specdraft.cli", "generate", *TINY, "--draft", str(other_tokenizer_dir), "hi"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "different tokenizer" in lines[0], proc.stderr
    assert lines[0].startswith("specdraft generate: error:")
    assert "Traceback" not in proc.stderr + proc.stdout


# ------------------------------------------------------------------------------------------- check
def test_check_identical_in_fp32(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n\nabcabcabcabc\n")
    rc, out, _ = run_cli(capsys, "check", *TINY, "--draft", "prune:0", "--k", "3", "--prompts", str(prompts),
                         "--max-new-tokens", "12", "--drift")
    assert rc == 0
    assert out.count("] identical") == 2 and "tolerance 0.0" in out
    assert "summary: 2 prompts: 2 identical, 0 tie-divergent, 0 divergent" in out
    assert "largest drift" in out


def test_check_reads_jsonl_and_flags_divergence(capsys, tmp_path, monkeypatch):
    import torch

    import specdraft.verify as verify_module
    from specdraft.verify import Verdict

    def accept_everything(draft_tokens, target_logits, num_valid=None):
        tokens = torch.cat([draft_tokens, target_logits[:, -1:].argmax(-1)], 1)
        return Verdict(num_accepted=torch.full((draft_tokens.shape[0],), draft_tokens.shape[1]), tokens=tokens)

    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["first turn", "second"]}) + "\n"
                       + json.dumps({"prompt": "a plain prompt"}) + "\n")
    monkeypatch.setattr(verify_module, "verify_greedy", accept_everything)
    rc, out, _ = run_cli(capsys, "check", *TINY, "--draft", "prune:0", "--k", "3", "--prompts", str(prompts),
                         "--limit", "1", "--max-new-tokens", "12")
    assert rc == 1
    assert "] divergent" in out and "first difference at token" in out
    assert "summary: 1 prompts: 0 identical, 0 tie-divergent, 1 divergent" in out


def test_check_tie_tolerance(capsys):
    """With a huge tolerance every difference counts as a near-tie (the flag is wired through)."""
    rc, out, _ = run_cli(capsys, "check", *TINY, "--draft", "prune:0", "--k", "2", "--prompt", "hi", "--tol", "1e9",
                         "--max-new-tokens", "6")
    assert rc == 0 and "tolerance 1000000000.0" in out
