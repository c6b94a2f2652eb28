"""Gemma 3 on the compact runtime against transformers' Gemma3ForCausalLM, on tiny random models."""

from types import SimpleNamespace

import pytest
import torch

from specdraft import kernels
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.models.gemma3 import Gemma3Runtime, Gemma3Weights
from specdraft.models.hf import HFRuntime
from specdraft.models.llama import LlamaRuntime
from specdraft.models.runtime import make_runtime
from specdraft.policy import FixedK
from tests.helpers import decode, plain_greedy, random_prompts

ATOL = 2e-5  # as the Llama tests (tests/models/test_llama.py)
native = pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.status()}")


def tiny_gemma3(window: int = 6, softcap: float | None = 3.0, seed: int = 0, vocab: int = 96):
    """A tiny random Gemma 3: 4 layers (local, local, global, local), GQA, head_dim 16, a scale
    other than 1/sqrt(head_dim), linear RoPE scaling on the global layers, random norm weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        max_position_embeddings=256,
        sliding_window=window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
        },
        final_logit_softcapping=softcap,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma's norms start at weight 0 (scale 1): make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def gemma():
    model = tiny_gemma3()
    return model, Gemma3Runtime(Gemma3Weights.from_hf(model, torch.float32))


def prefill(rt, ids: torch.Tensor, capacity: int, **kw):
    B, T = ids.shape
    state = rt.new_state(B, capacity)
    return state, rt.forward(state, ids, torch.arange(T).expand(B, T), **kw)


def test_the_window_matters_in_transformers():
    """The tests below would not see a wrong window: with 20 tokens and W = 6 it changes the logits."""
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    narrow, wide = hf_logits(tiny_gemma3(window=6), ids), hf_logits(tiny_gemma3(window=64), ids)
    assert torch.allclose(narrow[:, :6], wide[:, :6], atol=ATOL)
    assert (narrow[:, 6:] - wide[:, 6:]).abs().max() > 1e-2


@pytest.mark.parametrize("path", ["scoring", "prefill"])
@pytest.mark.parametrize("window", [6, 64])
def test_logits_equal_transformers(window, path):
    """A whole 20-token sequence, through the scoring path (native attention with the window) and
    the prefill path (``logits_index``: torch's attention with a window mask)."""
    model = tiny_gemma3(window=window)
    rt = Gemma3Runtime(Gemma3Weights.from_hf(model, torch.float32))
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    kw = {"logits_index": torch.arange(20).expand(2, 20)} if path == "prefill" else {}
    _, out = prefill(rt, ids, 24, **kw)
    torch.testing.assert_close(out.logits, hf_logits(model, ids), atol=ATOL, rtol=0)


def test_one_token_steps_past_the_window_equal_transformers(gemma):
    model, rt = gemma
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    state, out = prefill(rt, ids[:, :3], 24)
    steps = [out.logits] + [
        rt.forward(state, ids[:, t : t + 1], torch.tensor([[t]])).logits for t in range(3, 20)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), hf_logits(model, ids), atol=ATOL, rtol=0)


@native
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_verification_equals_one_token_steps_bit_for_bit(weights):
    """A (k+1)-token step for 2 rows at different lengths, past the window, gives each row's logits
    and cache entries bit for bit what that row gets from k+1 one-token steps alone."""
    rt = Gemma3Runtime(Gemma3Weights.from_hf(tiny_gemma3(), weights, compute=torch.float32))
    g = torch.Generator().manual_seed(4)
    lengths, T = [9, 13], 5
    prompts = [torch.randint(3, 96, (1, n), generator=g) for n in lengths]
    new = torch.randint(3, 96, (2, T), generator=g)
    positions = torch.stack([torch.arange(n, n + T) for n in lengths])  # (2, T)
    state = rt.new_state(2, 24)
    for b, p in enumerate(prompts):  # ragged prefill: one row at a time into the batch state
        one, _ = prefill(rt, p, 24)
        for big, small in zip(state.k + state.v, one.k + one.v):
            big[b] = small[0]
    step = rt.forward(state, new, positions).logits  # (2, T, V)
    for b, p in enumerate(prompts):
        one, _ = prefill(rt, p, 24)
        singles = torch.cat(
            [
                rt.forward(one, new[b : b + 1, t : t + 1], positions[b : b + 1, t : t + 1]).logits
                for t in range(T)
            ],
            1,
        )
        assert torch.equal(step[b], singles[0]), f"row {b}: {float((step[b] - singles[0]).abs().max())}"
        for big, small in zip(state.k + state.v, one.k + one.v):
            assert torch.equal(big[b], small[0])


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_greedy_with_prompt_lookup_equals_plain_decoding(weights):
    """Batch 1 and 2, k = 1 and 4, generating past the window; prompts with repeats so that the
    lookup drafter proposes (and some proposals are accepted)."""
    rt = Gemma3Runtime(Gemma3Weights.from_hf(tiny_gemma3(), weights))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], random_prompts([7], vocab=96, seed=5)[0]]
    reference = [plain_greedy(rt, p, 24) for p in prompts]
    for k in (1, 4):
        engine = Engine(rt, PromptLookupDrafter(), FixedK(k))
        assert decode(engine, prompts[:1], 24) == reference[:1]
        assert decode(engine, prompts, 24) == reference
        assert engine.stats.accepted > 0


def test_make_runtime_picks_the_compact_gemma_runtime(gemma):
    model, _ = gemma
    loaded = SimpleNamespace(model=model)
    assert isinstance(make_runtime(loaded, "auto", torch.float32), Gemma3Runtime)
    assert isinstance(make_runtime(loaded, "compact", torch.float32), Gemma3Runtime)
    assert isinstance(make_runtime(loaded, "hf"), HFRuntime)
    assert not isinstance(make_runtime(SimpleNamespace(model=_tiny_llama()), "auto"), Gemma3Runtime)


def _tiny_llama():
    from specdraft.models.tiny import tiny_llama

    rt_model = tiny_llama(seed=0)
    assert isinstance(make_runtime(SimpleNamespace(model=rt_model), "auto"), LlamaRuntime)
    return rt_model


def test_layer_subset_and_refusals(gemma):
    _, rt = gemma
    sub = Gemma3Runtime(rt.w.subset([0, 2], torch.float32))
    assert [layer.sliding for layer in sub.layers] == [True, False]
    assert sub.layers[1].wqkv is rt.w.layers[2].wqkv  # the same dtype shares the target's tensors
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(6))
    pruned = tiny_gemma3()
    pruned.model.layers = torch.nn.ModuleList([pruned.model.layers[i] for i in (0, 2)])
    pruned.config.layer_types = [pruned.config.layer_types[i] for i in (0, 2)]
    pruned.config.num_hidden_layers = 2
    _, out = prefill(sub, ids, 16)
    with torch.no_grad():
        ref = pruned(ids, use_cache=False).logits
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)
    for dtype in (torch.bfloat16, torch.qint8):  # drafts in another precision: a cast copy
        cast = Gemma3Runtime(rt.w.subset([0, 2], dtype))
        assert cast.w.layers[0].wqkv.dtype == (torch.float32 if dtype == torch.qint8 else dtype)
        _, other = prefill(cast, ids, 16)
        assert (other.logits - out.logits).abs().max() < 0.5  # close, not equal
    with pytest.raises(SpecdraftError, match="invalid"):
        rt.w.subset([4], torch.float32)
    capped = tiny_gemma3()
    capped.config.attn_logit_softcapping = 50.0
    with pytest.raises(SpecdraftError, match="soft-capping"):
        Gemma3Weights.from_hf(capped, torch.float32)


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
def test_pruned_draft_runs_gemma_layers_and_stays_lossless(gemma, draft_dtype):
    from specdraft import registry

    model, rt = gemma
    target = registry.Target(SimpleNamespace(model=model), rt, draft_dtype)
    drafter = registry.build_drafter("prune:0,2", target)
    assert isinstance(drafter.runtime, Gemma3Runtime)
    assert [layer.sliding for layer in drafter.runtime.layers] == [True, False]
    prompts = random_prompts([5, 9], vocab=96, seed=7)
    reference = [plain_greedy(rt, p, 12) for p in prompts]
    assert decode(Engine(rt, drafter, FixedK(3)), prompts, 12) == reference


@pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.status()}")
def test_api_auto_and_compact_load_gemma_on_the_compact_runtime(tmp_path):
    """``--runtime auto`` and ``compact`` give the Gemma runtime with the compact runtime's weights
    (bf16 without native bf16, as for Llama), ``hf`` the transformers adapter."""
    from specdraft import api
    from specdraft.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    tiny_gemma3(vocab=len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for runtime in ("auto", "compact"):
        rt = api.load(str(tmp_path), "none", runtime=runtime, threads=1).runtime
        assert isinstance(rt, Gemma3Runtime) and rt.w.dtype == api.resolve_dtype("auto"), runtime
    assert isinstance(api.load(str(tmp_path), "none", runtime="hf", threads=1).runtime, HFRuntime)


def test_compact_weights_load_from_files_without_the_transformers_model(tmp_path, monkeypatch):
    """Nothing that needs the transformers model: the weights come from the safetensors file alone,
    equal to :meth:`Gemma3Weights.from_hf`'s (logits bit for bit), also when a tensor is read in
    several blocks of rows; a draft kind or a run that needs the model keeps it."""
    from specdraft import api
    from specdraft.models import gemma3
    from specdraft.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_gemma3(vocab=len(tok))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(gemma3._SafetensorsReader, "ROWS", 40)  # the embedding in 3 blocks
    ids = torch.randint(3, len(tok), (1, 12), generator=torch.Generator().manual_seed(9))
    want = prefill(Gemma3Runtime(Gemma3Weights.from_hf(model, torch.bfloat16)), ids, 16)[1].logits
    for draft in ("none", "prune:0,2"):
        pipe = api.load(str(tmp_path), draft, dtype="bf16", threads=1)
        assert pipe.target.model is None and isinstance(pipe.runtime, Gemma3Runtime), draft
        assert torch.equal(prefill(pipe.runtime, ids, 16)[1].logits, want)
    assert api.load(str(tmp_path), "none", dtype="bf16", threads=1, needs=("hf",)).target.model is not None
    assert api.load(str(tmp_path), "none", dtype="bf16", runtime="hf", threads=1).target.model is not None
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpecdraftError, match="cannot read the Gemma 3 weights"):
        Gemma3Weights.from_safetensors(tmp_path, torch.float32)


@native
def test_token_tree_rows_equal_chain_steps_past_the_window(gemma):
    """A token-tree step (issue 16) after a context longer than the window: every node's logits are
    bit for bit those of a chain step over its path (the native attention applies the window to
    the keys each node sees)."""
    from specdraft.tree import TokenTree

    model, rt = gemma
    context, root = random_prompts([10], vocab=96, seed=8)[0], 7
    tree = TokenTree.from_chains([[11, 12, 13], [11, 14], [15, 16, 17, 18], [20]])
    P = len(context)
    state, _ = prefill(rt, torch.tensor([context]), 32)
    logits = rt.forward(
        state,
        torch.cat([torch.tensor([root]), tree.tokens]).unsqueeze(0),
        tree.positions(P).unsqueeze(0),
        attn_mask=tree.step_mask(P, 32).unsqueeze(0),
        slots=tree.slots(P).unsqueeze(0),
    ).logits[0]  # (N + 1, V)
    for i in range(-1, tree.num_nodes):
        chain = [root, *([] if i < 0 else tree.tokens[tree.ancestors[i]].tolist())]
        one, _ = prefill(rt, torch.tensor([context]), 32)
        want = rt.forward(one, torch.tensor([chain]), torch.arange(P, P + len(chain)).unsqueeze(0)).logits[
            0, -1
        ]
        assert torch.equal(logits[1 + i], want), i
        reference = hf_logits(model, torch.tensor([context + chain]))[0, -1]
        torch.testing.assert_close(logits[1 + i], reference, atol=ATOL, rtol=0)


def test_pruned_draft_with_a_head_subset_is_lossless_and_leaves_the_target_alone(gemma):
    """``prune:0,2,head=N``: the draft's head is the N ids most frequent in the training prompts
    (plus end-of-sequence), it scores nothing else (-inf), the target keeps its whole head, and
    greedy output equals plain decoding."""
    from specdraft import registry
    from specdraft.design.prune import prompt_head
    from specdraft.models.loading import LoadedModel
    from specdraft.models.subset_head import SubsetHeadRuntime
    from specdraft.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    rt = Gemma3Runtime(Gemma3Weights.from_hf(tiny_gemma3(vocab=len(tok)), torch.float32))
    V = rt.vocab_size
    loaded = LoadedModel(model=None, tokenizer=tok, name="tiny-gemma", source="test")
    drafter = registry.build_drafter("prune:0,2,head=40", registry.Target(loaded, rt, torch.float32))
    head = prompt_head(tok, 40, V, loaded.eos_ids())
    assert isinstance(drafter.runtime, SubsetHeadRuntime) and drafter.name == "prune:0,2,head=40"
    assert torch.equal(drafter.runtime.token_ids, head.token_ids) and 40 <= len(head) <= 41
    assert set(loaded.eos_ids()) <= set(head.token_ids.tolist()) and 0 < head.coverage < 1
    assert rt.w.lm_head.shape[0] == V and drafter.runtime.runtime.w.lm_head.shape[0] == len(head)
    state = drafter.runtime.new_state(1, 8)
    logits = drafter.runtime.forward(state, torch.tensor([[5, 6, 7]]), torch.arange(3).unsqueeze(0)).logits
    outside = torch.ones(V, dtype=torch.bool)
    outside[head.token_ids] = False
    assert torch.isinf(logits[..., outside]).all() and torch.isfinite(logits[..., ~outside]).all()
    prompts = random_prompts([5, 9], vocab=V, seed=7)
    reference = [plain_greedy(rt, p, 12) for p in prompts]
    assert decode(Engine(rt, drafter, FixedK(3)), prompts, 12) == reference


@pytest.mark.parametrize(
    "text, layers, head",
    [("prune:0,2", [0, 2], None), ("prune:0, 2,head=40", [0, 2], 40), ("prune:5,head=7", [5], 7)],
)
def test_prune_spec_with_a_head_size(text, layers, head):
    from specdraft.registry import DraftSpec

    spec = DraftSpec.parse(text)
    assert (spec.layers, spec.head) == (layers, head) and DraftSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text", ["prune:head=40", "prune:0,head=0", "prune:0,head=x", "prune:0,head=4,1"])
def test_bad_prune_head_specs_are_one_error_line(text):
    from specdraft.registry import DraftSpec

    with pytest.raises(SpecdraftError, match="head=N"):
        DraftSpec.parse(text)


def test_the_attack_refuses_a_pruned_draft_with_a_head_subset():
    """The attack rebuilds a pruned draft as a transformers model with the whole head: it says so."""
    from specdraft.attack.run import diff_models
    from specdraft.models.tiny import tiny_llama

    pipe = SimpleNamespace(target=SimpleNamespace(model=tiny_llama(seed=0)), draft_spec="prune:0,head=5")
    with pytest.raises(SpecdraftError, match="no head="):
        diff_models(pipe)
