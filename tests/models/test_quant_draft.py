"""Drafts beside a quantized target run on GGUF blocks too (``--draft-dtype q``, issue 15 item 4):
a layer-pruned draft is a view of the target's own blocks (no copy, no transformers model, also
with a head subset), a designed draft's matrices (a feature draft's input projection too) are Q8_0
blocks made at load with the GGUF's embedding, a GGUF draft model runs its own blocks; greedy
speculative output equals plain decoding for each, and bad input gets one clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdraft import api, cli, kernels
from specdraft.bench import harness
from specdraft.design import artifact
from specdraft.design.prune import depth_prune, with_head
from specdraft.design.vocab import VocabSubset
from specdraft.drafters.feature import FeatureDrafter
from specdraft.drafters.gated import GatedDrafter
from specdraft.drafters.model import ModelDrafter
from specdraft.dtypes import QUANT
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.models import loading, quant
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.quant import QuantRuntime, QuantWeights, dequantize_rows
from specdraft.models.subset_head import SubsetHeadRuntime
from specdraft.policy import FixedK, VerifyCost
from tests.helpers import decode, plain_greedy, random_prompts
from tests.models.test_quant import TYPES, fake_conversion_cache, write_tiny_gguf

pytestmark = pytest.mark.skipif(
    not kernels.available() or "avx2" not in quant.variants(),
    reason=f"native kernels unavailable ({kernels.status()})",
)

EOS = 95
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], *random_prompts([9, 3], vocab=90, seed=2)]
HEAD = torch.tensor([3, 5, 6, 7, 8, 11, 20, 33, 40, 57, 64, 71, 88, 90, EOS])  # a designed draft's head ids


@pytest.fixture
def target(tmp_path, monkeypatch):
    """A Q4_1 GGUF target (its tokenizer in the conversion cache), its transformers reference, and
    load_model made to fail: nothing here may build the target's transformers model."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "t.gguf"
    model = write_tiny_gguf(path, TYPES["Q4_1"])
    fake_conversion_cache(path, eos=(EOS,))
    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("load_model called"))
    monkeypatch.setattr(api, "load_model", lambda *a, **kw: pytest.fail("load_model called"))
    return path, model


def same_as_plain(pipe) -> None:
    """Greedy speculative output equals the quantized target's plain output, batched and alone,
    and drafts were accepted."""
    plain = [plain_greedy(pipe.runtime, p, 12, eos_ids=pipe.eos_ids) for p in PROMPTS]
    for k in (1, 3):
        out, stats = api.run_batch(pipe, PROMPTS, max_new_tokens=12, k=k)
        assert out == plain and stats.drafted > 0, k


def blocks(w: QuantWeights) -> list[np.ndarray]:
    return [getattr(ly, n).data for ly in w.layers for n in quant.MATRICES]


@pytest.mark.parametrize("draft_dtype", ["auto", "q"])
def test_prune_draft_is_a_view_of_the_targets_blocks(target, draft_dtype):
    pipe = api.load(str(target[0]), "prune:1", threads=1, draft_dtype=draft_dtype)
    rt, draft = pipe.runtime, pipe.drafter.runtime
    assert isinstance(rt, QuantRuntime) and isinstance(draft, QuantRuntime) and pipe.target.model is None
    assert all(a is b for a, b in zip(blocks(draft.w), blocks(rt.w)[len(quant.MATRICES) :], strict=True))
    assert draft.w.embed is rt.w.embed and draft.w.head is rt.w.head  # nothing de-quantized, nothing copied
    assert draft.new_state(1, 8).k[0] is not None and len(draft.new_state(1, 8).k) == 1  # its own cache
    same_as_plain(pipe)


def test_token_trees_grow_from_quantized_drafts(target, tmp_path):
    """``tree:prune:...`` (auto: the view) and ``tree:designed:...`` at q: the draft's tree steps
    read ancestors its earlier forwards left at slots beyond the context."""
    path, model = target
    d, _ = designed_draft(tmp_path, model, HEAD)
    for spec, dt in (("tree:prune:1", "auto"), (f"tree:designed:{d}", "q")):
        pipe = api.load(str(path), spec, threads=1, draft_dtype=dt)
        runtime = pipe.drafter.model.runtime
        assert isinstance(getattr(runtime, "runtime", runtime), QuantRuntime) and pipe.target.model is None
        same_as_plain(pipe)


def test_a_tree_step_over_cached_ancestors_is_a_chain_step(target):
    """Tokens 10 and 11 fed one tree step each at slots 13 and 14 (after a 10-token context) give
    token 11 the logits of a chain step, bit for bit."""
    rt = QuantRuntime(target[0])
    x = torch.tensor([random_prompts([12], vocab=90, seed=7)[0]])
    chain = rt.new_state(1, 16)
    rt.forward(chain, x[:, :11], torch.arange(11)[None])
    want = rt.forward(chain, x[:, 11:], torch.tensor([[11]])).logits
    tree = rt.new_state(1, 16)
    rt.forward(tree, x[:, :10], torch.arange(10)[None])
    mask = torch.zeros(1, 1, 16, dtype=torch.bool)
    mask[..., :10] = True
    for i, slot in ((10, 13), (11, 14)):
        mask[..., slot] = True
        pos, slots = torch.tensor([[i]]), torch.tensor([[slot]])
        got = rt.forward(tree, x[:, i : i + 1], pos, attn_mask=mask, slots=slots).logits
    assert torch.equal(got, want)


def test_prune_head_takes_the_quantized_heads_rows(target):
    pipe = api.load(str(target[0]), "prune:0", threads=1)
    ids = torch.tensor([EOS, 2, 5, 6, 7, 8, 40])
    sub = with_head(pipe.drafter, ids)
    assert isinstance(sub.runtime, SubsetHeadRuntime) and isinstance(sub.runtime.runtime, QuantRuntime)
    head = sub.runtime.runtime.w.head
    assert head.rows == len(ids) and torch.equal(
        dequantize_rows(head, torch.arange(len(ids))), dequantize_rows(pipe.runtime.w.head, ids)
    )
    x = torch.tensor([[1, 2, 3, 4]])
    full = pipe.drafter.runtime.forward(pipe.drafter.runtime.new_state(1, 8), x, torch.arange(4)[None]).logits
    part = sub.runtime.forward(sub.runtime.new_state(1, 8), x, torch.arange(4)[None]).logits
    assert torch.equal(part[..., ids], full[..., ids])  # row blocks are independent: the same logits
    assert torch.isinf(part).sum() == 4 * (96 - len(ids))
    pipe.drafter = sub
    same_as_plain(pipe)


def test_a_dense_draft_dtype_keeps_bf16_for_a_prune_draft(target, monkeypatch):
    """``prune:`` at bf16 / fp32 / int8 runs the target's layers in the compact runtime (so the
    target is bf16); at auto and q the quantized target stays (``tree:prune:...`` alike)."""
    seen = []

    def record(target, needs=()):
        seen.append(needs)
        raise SpecdraftError("stop")

    monkeypatch.setattr(api, "auto_quant_runtime", record)
    for draft, dt in (
        ("prune:0", "fp32"),
        ("tree:prune:0", "bf16"),
        ("tree:prune:0", "auto"),
        ("prune:0", "q"),
    ):
        with pytest.raises(SpecdraftError, match="stop"):
            api.load(str(target[0]), draft, threads=1, draft_dtype=dt)
    assert ["prune" in n for n in seen] == [True, True, False, False]


def designed_draft(tmp_path, model, head: torch.Tensor | None):
    """A one-layer designed draft of the tiny target (its layer 1), written as ``specdraft design``
    writes one; returns its directory and the transformers draft."""
    draft = depth_prune(model, [1])
    draft.model.layers[0].mlp.up_proj.weight.data.mul_(1.3)  # not the target's own layer
    subset = None if head is None else VocabSubset(head, 1.0)
    meta = artifact.DraftMeta.for_target(model, "tiny-gguf", head=subset, init_layers=[1])
    path = artifact.save_draft(tmp_path / ("d-head" if head is not None else "d"), draft, meta)
    return path, draft


@pytest.mark.parametrize("head", [None, HEAD], ids=["full-head", "head-subset"])
def test_designed_draft_runs_q8_0_blocks_without_the_transformers_model(target, tmp_path, head):
    path, model = target
    d, draft = designed_draft(tmp_path, model, head)
    pipe = api.load(str(path), f"designed:{d}", threads=1, draft_dtype="q")
    drafter = pipe.drafter
    assert isinstance(drafter, GatedDrafter) and pipe.target.model is None
    rt = drafter.runtime if head is None else drafter.runtime.runtime
    assert isinstance(rt, QuantRuntime) and rt.w.types == {"Q8_0": 8} and rt.w.embed is pipe.runtime.w.embed
    assert harness.runtime_precision(drafter.runtime) == "q8_0"  # reports see through the head subset
    # it computes the draft: logits close to the transformers draft's (the same RoPE order, norms)
    x = torch.tensor([random_prompts([10], vocab=90, seed=5)[0]])
    got = drafter.runtime.forward(drafter.runtime.new_state(1, 16), x, torch.arange(10)[None]).logits
    with torch.no_grad():
        ref = draft(x).logits
    cols = torch.arange(96) if head is None else head
    err = (got[..., cols] - ref[..., cols]).abs().max() / ref.abs().max()
    assert err < 0.05, err
    # the gate's measured cost may price every proposal out on a slow host (CI: drafted 0); the gate
    # has its own tests (tests/drafters/test_gated.py), here free verification makes the draft propose
    drafter.cost = VerifyCost([1.0] * 9, 0.0)
    same_as_plain(pipe)


def feature_draft(tmp_path, model):
    """A one-layer feature draft of the tiny target (its layer 1; an input projection reading the
    token's embedding and a little of the feature), saved as ``specdraft design`` saves one; its
    directory, transformers layers and projection."""
    draft = depth_prune(model, [1])
    C = model.config.hidden_size
    fc = torch.cat([0.1 * torch.randn(C, C, generator=torch.Generator().manual_seed(0)), torch.eye(C)], 1)
    meta = artifact.DraftMeta.for_target(model, "tiny-gguf", kind="feature", init_layers=[1])
    return artifact.save_draft(tmp_path / "f", draft, meta, extra={"fc.weight": fc}), draft, fc


def test_a_feature_draft_runs_q8_0_blocks_beside_the_quantized_target(target, tmp_path):
    """``--draft-dtype auto`` (q) runs a feature draft's layer and input projection as Q8_0 blocks
    over the GGUF's embedding, without the transformers model: it computes what the same draft
    computes densely, and greedy speculative output equals plain decoding."""
    path, model = target
    d, draft, fc = feature_draft(tmp_path, model)
    pipe = api.load(str(path), f"designed:{d}", threads=1)
    drafter = pipe.drafter
    assert isinstance(drafter, FeatureDrafter) and pipe.target.model is None
    assert isinstance(drafter.fc, quant.QuantMatrix) and harness.runtime_precision(drafter.runtime) == "q8_0"
    V, C = pipe.runtime.w.embed.rows, pipe.runtime.w.embed.cols
    embed = dequantize_rows(pipe.runtime.w.embed, torch.arange(V))
    dense = FeatureDrafter(LlamaRuntime(LlamaWeights.from_hf(draft, torch.float32)), fc, embed, "dense")
    feats = torch.randn(1, 4, C, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[5, 6, 7, 8]])
    got, want = drafter.inputs(feats, tokens), dense.inputs(feats, tokens)
    assert (got - want).abs().max() / want.abs().max() < 0.02
    pos = torch.arange(4)[None]
    got = drafter._forward(drafter.new_state(1, 8), want, pos)[0]
    want = dense._forward(dense.new_state(1, 8), want, pos)[0]
    assert (got - want).abs().max() / want.abs().max() < 0.05
    same_as_plain(pipe)


def test_the_quantized_embeddings_fingerprint_is_the_designed_drafts(target):
    path, model = target
    w = QuantWeights.from_gguf(path)
    got = w.embedding_fingerprint(block=7)  # blocks that do not divide V
    want = artifact.fingerprint(dequantize_rows(w.embed, torch.arange(w.embed.rows)))
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.allclose(got, artifact.fingerprint(model.get_input_embeddings().weight), rtol=1e-4, atol=1e-5)


def test_a_designed_draft_for_another_target_or_kind_is_refused(target, tmp_path):
    path, model = target
    d, _ = designed_draft(tmp_path, model, None)
    meta = json.loads((d / artifact.META_FILE).read_text())
    (d / artifact.META_FILE).write_text(json.dumps({**meta, "embed_fingerprint": [1.0] * 10}))
    with pytest.raises(SpecdraftError, match="embedding differs"):
        api.load(str(path), f"designed:{d}", threads=1, draft_dtype="q")
    (d / artifact.META_FILE).write_text(json.dumps({**meta, "kind": "dream"}))
    with pytest.raises(SpecdraftError, match="token-level and feature designed drafts, not dream"):
        api.load(str(path), f"designed:{d}", threads=1, draft_dtype="q")
    (d / artifact.META_FILE).write_text(json.dumps({**meta, "kind": "feature"}))  # no input projection
    with pytest.raises(SpecdraftError, match="lacks fc.weight"):
        api.load(str(path), f"designed:{d}", threads=1, draft_dtype="q")


def test_a_gguf_draft_model_runs_its_own_blocks(target, tmp_path):
    path, _ = target
    other = tmp_path / "draft.gguf"
    write_tiny_gguf(other, TYPES["Q8_0"], num_hidden_layers=1)
    fake_conversion_cache(other, eos=(EOS,))
    pipe = api.load(str(path), str(other), threads=1, draft_dtype="q")
    assert isinstance(pipe.drafter, ModelDrafter) and isinstance(pipe.drafter.runtime, QuantRuntime)
    assert pipe.drafter.runtime.w.path == other
    same_as_plain(pipe)


def test_the_studys_same_draft_dtype_is_the_quantized_targets_blocks(target):
    from specdraft.study import sweep

    pipe = api.load(str(target[0]), "none", threads=1)
    drafter = sweep.build_drafter(pipe, "prune:1", "same")
    assert (
        isinstance(drafter.runtime, QuantRuntime) and drafter.runtime.w.layers[0] is pipe.runtime.w.layers[1]
    )


def test_bad_draft_dtypes_get_one_line(target, capsys):
    path = str(target[0])
    with pytest.raises(SpecdraftError, match="beside a quantized target"):
        api.load("tiny", "prune:0", dtype="fp32", threads=1, draft_dtype="q")
    with pytest.raises(SpecdraftError, match="unknown dtype 'q8'"):
        api.load(path, "prune:0", threads=1, draft_dtype="q8")
    rt = QuantRuntime(path)
    for spec in ("flex", "local:designed:x", "diffusion:x"):
        with pytest.raises(SpecdraftError, match="do not run on GGUF blocks"):
            api.draft_precision("q", rt, spec)
    assert (
        api.draft_precision("auto", rt, "prune:0") == api.draft_precision("auto", rt, "tree:prune:0") == QUANT
    )
    assert api.draft_precision("auto", rt, "designed:auto") == api.resolve_dtype("auto", draft=True)
    assert capsys.readouterr().err == ""  # refused before the target loaded
    argv = ["generate", "--target", "tiny", "--dtype", "fp32", "--draft", "prune:0", "--draft-dtype", "q"]
    assert cli.main([*argv, "--threads", "1", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "beside a quantized target" in err[0]


def test_engine_with_a_quantized_view_draft_matches_plain_on_every_variant(target):
    """The view runs the same kernels as the target: for each variant, speculative == plain."""
    for variant in quant.variants():
        rt = QuantRuntime(target[0], variant)
        draft = ModelDrafter(QuantRuntime(rt.w.with_layers([0]), variant), "prune:0")
        reference = [plain_greedy(rt, p, 10) for p in PROMPTS]
        assert decode(Engine(rt, draft, FixedK(2)), PROMPTS, 10) == reference, variant
    with pytest.raises(SpecdraftError, match="invalid"):
        rt.w.with_layers([0, 2])


def test_auto_runs_token_level_designed_drafts_on_q8_0_blocks_and_keeps_bf16_for_dream_ones(target, tmp_path):
    """``--draft-dtype auto`` beside a quantized target: a token-level designed draft (and a tree of
    it) and a feature draft run on GGUF blocks; a DREAM draft, which has no quantized path, keeps the
    dense auto."""
    path, model = target
    d, _ = designed_draft(tmp_path, model, None)
    rt = QuantRuntime(path)
    assert api.draft_precision("auto", rt, f"designed:{d}") == QUANT
    assert api.draft_precision("auto", rt, f"tree:designed:{d}") == QUANT
    pipe = api.load(str(path), f"designed:{d}", threads=1)
    assert harness.runtime_precision(pipe.drafter.runtime) == "q8_0" and pipe.target.model is None
    meta = json.loads((d / artifact.META_FILE).read_text())
    (d / artifact.META_FILE).write_text(json.dumps({**meta, "kind": "feature"}))
    assert api.draft_precision("auto", rt, f"designed:{d}") == QUANT
    (d / artifact.META_FILE).write_text(json.dumps({**meta, "kind": "dream"}))
    assert api.draft_precision("auto", rt, f"designed:{d}") == api.resolve_dtype("auto", draft=True)
