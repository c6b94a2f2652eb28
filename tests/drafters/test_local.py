"""The DeLS-Spec local head: counting, the product of experts inside a feature drafter (lossless),
tuning (a, b), and ``specdraft design local`` + ``--draft local:designed:...`` end to end."""

import json

import pytest
import torch

from specdraft import api
from specdraft.cli import main
from specdraft.design.local import agreement, train_gru, tune
from specdraft.drafters.feature import FeatureDrafter
from specdraft.drafters.local import GRULocalHead, LocalHead, load_local
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.tiny import tiny_llama
from specdraft.verify import SamplingParams
from tests.helpers import decode, random_prompts, target_answers


def test_counts_and_smoothing():
    head = LocalHead.count(
        [torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 4]), torch.tensor([5, 1, 2])], 8, M=4, beta=1.0
    )
    assert head.succ_ids[1, 0] == 2 and head.succ_counts[1, 0] == 4  # 1 -> 2 four times
    assert head.succ_ids[2, :2].tolist() == [3, 4] and head.succ_counts[2, :2].tolist() == [2.0, 1.0]
    p = head.log_local(torch.tensor([1, 2, 7])).exp()
    assert torch.allclose(p.sum(-1), torch.ones(3))  # every successor kept: rows are distributions
    assert p[0].argmax() == 2 and p[1].argmax() == 3
    assert torch.allclose(p[2], head.prior)  # a token never seen first: the prior
    kept = LocalHead.count([torch.tensor([2, 3, 2, 3, 2, 4, 2, 5])], 8, M=1)
    assert kept.succ_ids[2].tolist() == [3] and kept.row_counts[2] == 4  # the top successor only


def test_tune_picks_the_local_head_only_when_it_helps():
    g = torch.Generator().manual_seed(0)
    N, H = 400, 16
    target = torch.randint(0, H, (N,), generator=g)
    long = torch.randn(N, H, generator=g)  # a long drafter that knows nothing
    right = torch.full((N, H), -5.0).scatter(1, target.unsqueeze(1), 0.0)  # a local head that does
    prior = torch.zeros(H)
    a, b, grid = tune(long, right, prior, target)
    assert a > 0 and agreement(long, right, prior, target, a, b) > 0.9 > agreement(
        long, right, prior, target, 0, 0
    )
    noise = torch.randn(N, H, generator=g) * 5  # a local head that knows nothing
    assert tune(long + 3 * right, noise, prior, target)[0] == 0.0
    assert len(grid) == 35


def _feature_drafter(target_rt, local, V=256, seed=5):
    w = LlamaWeights.from_hf(tiny_llama(vocab_size=V, seed=seed), torch.float32)
    fc = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.1
    return FeatureDrafter(LlamaRuntime(w), fc, target_rt.w.embed, "feature", local=local)


def test_fused_drafting_is_lossless_and_follows_the_local_head(tiny_pipe):
    prompts = random_prompts([6, 9, 5], seed=2)
    plain = decode(Engine(tiny_pipe.runtime), prompts, 16)
    # a local head that saw the target's own continuations: with a large a it drafts them
    seqs = [torch.tensor(p + o) for p, o in zip(prompts, plain)]
    local = LocalHead.count(seqs, 256, M=4)
    local.a = 20.0
    rates = {}
    for a in (0.0, 20.0):
        local.a = a
        drafter = _feature_drafter(tiny_pipe.runtime, local)
        engine = Engine(tiny_pipe.runtime, drafter, api.make_policy(3), hidden_layers=drafter.hidden_layers)
        assert decode(engine, prompts, 16) == plain
        rates[a] = engine.stats.accepted / engine.stats.drafted
        sampled = decode(engine, prompts, 8, SamplingParams(temperature=0.9, seed=3))
        assert [len(s) for s in sampled] == [8, 8, 8]
    assert rates[20.0] > rates[0.0] + 0.3


def test_design_local_and_the_local_spec_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "d"
    tiny = ["--target", "tiny", "--threads", "1"]
    data = ["--prompts", "8", "--val-prompts", "4", "--max-new-tokens", "8", "--gen-batch", "4", "--quiet"]
    build = ["design", "build", *tiny, *data, "--kind", "feature", "--layers", "1", "--head", "64"]
    assert main([*build, "--steps", "2", "--batch-size", "2", "--out", str(out)]) == 0
    gen = ["generate", "hello", *tiny, "--max-new-tokens", "6", "--json"]
    assert main([*gen, "--draft", f"local:designed:{out}"]) != 0  # no local head yet: one line
    assert "no local head" in capsys.readouterr().err
    assert main(["design", "local", *tiny, *data, str(out)]) == 0
    assert "local:designed:" in capsys.readouterr().out
    head = LocalHead.load(out)
    assert head.succ_ids.shape == (256, 16) and head.a >= 0 and head.b >= 0
    from safetensors import safe_open

    with safe_open(str(out / "local_head.safetensors"), "pt") as f:
        info = json.loads(f.metadata()["info"])
    # every training answer counted; (a, b) tuned on one half of the held-out answers, measured on the other
    assert (info["counted_answers"], info["tune_answers"], info["val_answers"]) == (8, 2, 2)
    assert info["grid_alpha_tune"]["0.0,0.0"] >= 0
    assert main([*gen, "--draft", f"local:designed:{out}"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(res["tokens"]) == 6 and res["stats"]["drafted"] > 0
    prune = ["design", "build", *tiny, *data, "--layers", "1", "--head", "64", "--steps", "1"]
    assert main([*prune, "--batch-size", "2", "--out", str(tmp_path / "l")]) == 0  # a token-level draft
    capsys.readouterr()
    assert main([*gen, "--draft", f"local:designed:{tmp_path / 'l'}"]) != 0
    assert "feature or dream drafts only" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["local:designed:auto", "local:", "local:lookup", "local:designed:"])
def test_bad_local_specs_are_one_line(spec, capsys):
    assert main(["generate", "hi", "--target", "tiny", "--threads", "1", "--draft", spec]) != 0
    err = capsys.readouterr().err
    assert "local:designed:NAME" in err and "Traceback" not in err


def test_gru_head_learns_the_continuations_and_fused_drafting_stays_lossless(tiny_pipe, tmp_path):
    """The GRU head (trained on the target's own continuations) lifts acceptance when fused; it
    reads the last ``window`` tokens, saves and loads back by its file's type."""
    prompts = random_prompts([6, 9, 5], seed=2)
    plain = decode(Engine(tiny_pipe.runtime), prompts, 16)
    seqs = [torch.tensor(p + o) for p, o in zip(prompts, plain)]
    embed = tiny_pipe.runtime.w.embed
    torch.manual_seed(0)
    gru = GRULocalHead(embed, LocalHead.count(seqs, 256).prior, hidden=64, rank=64, window=4)
    recent = torch.cat(
        [s[(torch.arange(len(s) - 1).unsqueeze(1) - 3 + torch.arange(4)).clamp(min=0)] for s in seqs]
    )
    nxt = torch.cat([s[1:] for s in seqs])
    losses = train_gru(gru, recent, nxt, steps=150, batch_size=32, lr=3e-2, progress=False)
    assert losses[-1] < 0.1 * losses[0]
    assert float((gru.logits(recent).argmax(-1) == nxt).float().mean()) > 0.9
    lp = gru.log_local(recent[:5])
    assert torch.allclose(lp.exp().sum(-1), torch.ones(5), atol=1e-5)
    longer = torch.cat([torch.zeros(5, 3, dtype=torch.int64), recent[:5]], 1)
    assert torch.allclose(gru.log_local(longer), lp)  # only the last window tokens are read
    gru.save(tmp_path)
    back = load_local(tmp_path, embed)
    assert isinstance(back, GRULocalHead) and back.window == 4
    assert torch.allclose(back.log_local(recent[:5]), lp)
    rates = {}
    for a in (0.0, 20.0):
        back.a = a
        drafter = _feature_drafter(tiny_pipe.runtime, back)
        engine = Engine(tiny_pipe.runtime, drafter, api.make_policy(3), hidden_layers=drafter.hidden_layers)
        assert decode(engine, prompts, 16) == plain
        rates[a] = engine.stats.accepted / engine.stats.drafted
    assert rates[20.0] > rates[0.0] + 0.3
    (tmp_path / "local_head.safetensors").write_bytes(b"junk")
    with pytest.raises(SpecdraftError, match="corrupted"):
        load_local(tmp_path, embed)


def test_gru_head_scores_a_bf16_embedding_in_the_runtimes_arithmetic(tiny_pipe, monkeypatch):
    """Where bf16 is emulated the head scores with an exact fp32 copy of a bf16 embedding (the
    caller's tensor is untouched); where it is native, with the embedding itself."""
    from specdraft.models import llama

    embed = tiny_pipe.runtime.w.embed.to(torch.bfloat16)
    prior = torch.full((embed.shape[0],), 1.0 / embed.shape[0])
    monkeypatch.setattr(llama, "bf16_compute_dtype", lambda: torch.float32)
    head = GRULocalHead(embed, prior, hidden=8, rank=8, window=2)
    assert head.embed.dtype == torch.float32 and torch.equal(head.embed, embed.float())
    assert embed.dtype == torch.bfloat16
    monkeypatch.setattr(llama, "bf16_compute_dtype", lambda: torch.bfloat16)
    assert GRULocalHead(embed, prior, hidden=8, rank=8, window=2).embed is embed


def test_design_local_gru_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "d"
    tiny = ["--target", "tiny", "--threads", "1"]
    data = ["--prompts", "8", "--val-prompts", "4", "--max-new-tokens", "8", "--gen-batch", "4", "--quiet"]
    build = ["design", "build", *tiny, *data, "--kind", "feature", "--layers", "1", "--head", "64"]
    assert main([*build, "--steps", "1", "--batch-size", "2", "--out", str(out)]) == 0
    local = ["design", "local", *tiny, *data, str(out), "--local", "gru", "--gru-steps", "3", "--window", "4"]
    assert main(local) == 0
    capsys.readouterr()
    gen = ["generate", "hello", *tiny, "--max-new-tokens", "6", "--json", "--draft", f"local:designed:{out}"]
    assert main(gen) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(res["tokens"]) == 6 and res["stats"]["drafted"] > 0


def test_a_local_head_needs_two_held_out_answers(tiny_pipe):
    from specdraft.design.data import _subset
    from specdraft.design.local import build_local

    data = target_answers(tiny_pipe, random_prompts([5, 6], seed=1), max_new_tokens=6)
    with pytest.raises(SpecdraftError, match="at least 2 validation answers"):
        build_local(None, data, _subset(data, [0]), 256)


def test_a_restricted_gru_head_fuses_to_the_same_draft_distribution(tiny_pipe):
    """Scoring only a subset head's tokens (no log-softmax normaliser) leaves the fused draft's
    softmax and argmax as the full product gives them; outside the head the logits stay -inf."""
    embed = tiny_pipe.runtime.w.embed
    torch.manual_seed(0)
    gru = GRULocalHead(embed, torch.full((256,), 1 / 256), hidden=16, rank=16, window=3, a=0.7, b=0.2)
    head = torch.randperm(256)[:64]
    logits = torch.full((4, 256), float("-inf"))
    logits[:, head] = torch.randn(4, 64)
    recent = torch.randint(0, 256, (4, 3))
    full = gru.fuse(logits, recent)
    gru.restrict(head)
    part = gru.fuse(logits, recent)
    assert torch.isinf(part[:, [t for t in range(256) if t not in set(head.tolist())]]).all()
    assert torch.allclose(part.softmax(-1), full.softmax(-1), atol=1e-6)
    assert torch.equal(part.argmax(-1), full.argmax(-1))
