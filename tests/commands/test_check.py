"""``specdraft check`` on the tiny model: identical in fp32, jsonl prompts, a broken verifier flagged as
divergent, the near-tie tolerance."""

import json

from tests.helpers import TINY_CLI as TINY
from tests.helpers import run_cli


def test_check_identical_in_fp32(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n\nabcabcabcabc\n")
    rc, out, _ = run_cli(
        capsys,
        "check",
        *TINY,
        "--draft",
        "prune:0",
        "--k",
        "3",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--drift",
    )
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
        return Verdict(
            num_accepted=torch.full((draft_tokens.shape[0],), draft_tokens.shape[1]), tokens=tokens
        )

    prompts = tmp_path / "q.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "x", "turns": ["first turn", "second"]})
        + "\n"
        + json.dumps({"prompt": "a plain prompt"})
        + "\n"
    )
    monkeypatch.setattr(verify_module, "verify_greedy", accept_everything)
    rc, out, _ = run_cli(
        capsys,
        "check",
        *TINY,
        "--draft",
        "prune:0",
        "--k",
        "3",
        "--prompts",
        str(prompts),
        "--limit",
        "1",
        "--max-new-tokens",
        "12",
    )
    assert rc == 1
    assert "] divergent" in out and "first difference at token" in out
    assert "summary: 1 prompts: 0 identical, 0 tie-divergent, 1 divergent" in out


def test_check_tie_tolerance(capsys):
    """With a huge tolerance every difference counts as a near-tie (the flag is wired through)."""
    rc, out, _ = run_cli(
        capsys,
        "check",
        *TINY,
        "--draft",
        "prune:0",
        "--k",
        "2",
        "--prompt",
        "hi",
        "--tol",
        "1e9",
        "--max-new-tokens",
        "6",
    )
    assert rc == 0 and "tolerance 1000000000.0" in out
