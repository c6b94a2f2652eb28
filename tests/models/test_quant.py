"""The quantized runtime: GGUF block kernels (scalar reference == AVX2, rows independent of each
other for 1..64 rows), and a tiny random Llama written as a GGUF: its logits close to the
de-quantized fp32 model's, a k + 1-token step bit-identical to k + 1 one-token steps, and greedy
speculative output identical to its plain output."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft import kernels
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.models import quant
from specdraft.models.quant import QuantMatrix, QuantRuntime, dequantize_rows, quant_matmul
from specdraft.policy import FixedK
from tests.helpers import decode, plain_greedy, random_prompts

pytestmark = pytest.mark.skipif(
    not kernels.available() or "avx2" not in quant.variants(),
    reason=f"native kernels unavailable ({kernels.status()})",
)

TYPES = {
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
}
VARIANTS = quant.variants()  # every kernel variant this CPU runs


def quantized(w: np.ndarray, qtype) -> QuantMatrix:
    """``w (N, K)`` float32 as GGUF blocks, quantized by the gguf library (ggml's reference)."""
    return QuantMatrix(np.ascontiguousarray(gguf.quants.quantize(w, qtype)), int(qtype), w.shape[1])


def dequantized(m: QuantMatrix) -> torch.Tensor:
    return torch.from_numpy(
        gguf.quants.dequantize(m.data, gguf.GGMLQuantizationType(m.type)).astype(np.float32)
    )


@pytest.mark.parametrize("K", [32, 160, 1024])
@pytest.mark.parametrize("name", TYPES)
def test_kernel_variants_agree_and_rows_are_independent(name, K):
    """Every variant, on the file's layout and on the x8 one, gives bit-identical outputs; row i of
    an M-row product equals the 1-row product of row i alone, for M = 1..64, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(K)
    N = 37  # not a multiple of anything the kernels tile by
    w = quantized((torch.randn(N, K, generator=g) * 0.1).numpy(), TYPES[name])
    x = torch.randn(64, K, generator=g) * 3
    x[5] = 0.0  # an all-zero row (scale 0)
    single = torch.cat([quant_matmul(w, x[i : i + 1], "ref", 1) for i in range(64)])
    for layout in (w, w.repacked()):  # N = 37: 4 groups of 8 rows, 5 rows left as they are
        for variant in VARIANTS:
            for threads in (1, 2):
                for M in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64):
                    y = quant_matmul(layout, x[:M], variant, threads)
                    assert torch.equal(y, single[:M]), (layout.x8, variant, threads, M)
    # and it computes the product: close to the de-quantized weights times x
    ref = x @ dequantized(w).T
    err = (single - ref).abs().max() / ref.abs().max()
    assert err < 0.02, err


@pytest.mark.parametrize("K", [160, 1024])
@pytest.mark.parametrize("name", TYPES)
def test_extreme_blocks_sum_without_overflow(name, K):
    """Weights at the largest |integer| of their type and activations at +-127 with the weights'
    signs, so every product is as large as it gets and all add up: the kernels' 16-bit partial sums
    must not wrap (a wrapped sum is off by 2^16 d_w d_a, far outside the tolerance)."""
    N = 12
    w = torch.ones(N, K)
    w[:, ::32] = 0.0  # Q4_1: min 0, max 1 -> nibbles 0 and 15
    if name != "Q4_1":
        w = -w  # Q4_0: the extreme -1 -> integer -8; Q8_0: -127
    m = quantized(w.numpy(), TYPES[name])
    x = -torch.ones(9, K) if name != "Q4_1" else torch.ones(9, K)  # all products >= 0, a = +-127
    ref = (x.double() @ dequantized(m).double().T).float()
    for layout in (m, m.repacked()):
        for variant in VARIANTS:
            for M in (1, 2, 3, 5, 9):
                y = quant_matmul(layout, x[:M], variant, 1)
                torch.testing.assert_close(y, ref[:M], rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", TYPES)
def test_repacked_rows_read_back_as_the_file_has_them(name):
    """The x8 copy holds the same blocks: its rows taken back (take_rows) are the file's bytes, and
    its de-quantized rows the file's values, in the groups of 8 and in the rows left after them."""
    g = torch.Generator().manual_seed(2)
    w = quantized(torch.randn(21, 96, generator=g).numpy(), TYPES[name])
    x8 = w.repacked()
    ids = torch.tensor([0, 7, 8, 15, 16, 20, 3])
    assert x8.x8 and x8.data.shape == w.data.shape and not np.array_equal(x8.data, w.data)
    assert np.array_equal(x8.take_rows(ids).data, w.data[ids.numpy()])
    assert torch.equal(dequantize_rows(x8, ids), dequantize_rows(w, ids))


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_rows_match_gguf(name):
    g = torch.Generator().manual_seed(1)
    w = quantized(torch.randn(20, 96, generator=g).numpy(), TYPES[name])
    ids = torch.tensor([[3, 0], [19, 3]])
    out = dequantize_rows(w, ids)
    ref = dequantized(w)
    assert out.shape == (2, 2, 96)
    torch.testing.assert_close(out, ref[ids], rtol=0, atol=1e-6 * float(ref.abs().max()))
    with pytest.raises(SpecdraftError):
        dequantize_rows(w, torch.tensor([[20]]))


# --------------------------------------------------------------------------------------------
# A tiny Llama written as a GGUF
# --------------------------------------------------------------------------------------------

CFG = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
ROPE_THETA = 10000.0  # transformers' default


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The GGUF llama converter's q / k row order (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, qtype, head_scale: float | None = None, **config):
    """A random Llama (transformers) and the same model as a GGUF with ``qtype`` matrices; the
    transformers model gets the de-quantized weights, so it is the exact fp32 reference.
    ``config`` overrides :data:`CFG`; ``head_scale``: an untied head (``output.weight``, Q8_0),
    scaled to make the next-token distributions peaked."""
    tied = head_scale is None
    cfg = LlamaConfig(**{**CFG, **config, "tie_word_embeddings": tied}, initializer_range=0.15)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    g = torch.Generator().manual_seed(1)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)

    def matrix(name, param, heads=None, t=qtype):
        data = param.detach().float().numpy()
        q = gguf.quants.quantize(data, t)
        param.data.copy_(torch.from_numpy(gguf.quants.dequantize(q, t)))  # the reference's exact weights
        if heads:  # rows quantize independently, so permuting the blocks = quantizing the permuted rows
            q = permute(q, heads)
        w.add_tensor(name, q, raw_dtype=t)

    def vector(name, param):
        param.data.copy_(torch.linspace(0.5, 1.5, param.numel())[torch.randperm(param.numel(), generator=g)])
        w.add_tensor(name, param.detach().float().numpy())

    matrix("token_embd.weight", model.model.embed_tokens.weight, t=gguf.GGMLQuantizationType.Q8_0)
    if not tied:
        model.lm_head.weight.data.mul_(head_scale)
        matrix("output.weight", model.lm_head.weight, t=gguf.GGMLQuantizationType.Q8_0)
    vector("output_norm.weight", model.model.norm.weight)
    for i, layer in enumerate(model.model.layers):
        at, mlp = layer.self_attn, layer.mlp
        vector(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        vector(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        matrix(f"blk.{i}.attn_q.weight", at.q_proj.weight, H)
        matrix(f"blk.{i}.attn_k.weight", at.k_proj.weight, G)
        matrix(f"blk.{i}.attn_v.weight", at.v_proj.weight)
        matrix(f"blk.{i}.attn_output.weight", at.o_proj.weight)
        matrix(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        matrix(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        matrix(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module", params=list(TYPES))
def tiny_gguf(request, tmp_path_factory, monkeypatch_module):
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    model = write_tiny_gguf(path, TYPES[request.param])
    return model, path


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))  # the GGUF index cache
    yield mp
    mp.undo()


def test_logits_close_to_dequantized_reference(tiny_gguf):
    model, path = tiny_gguf
    rt = QuantRuntime(path)
    tokens = torch.tensor([random_prompts([12], vocab=96, seed=3)[0]])
    out = rt.forward(rt.new_state(1, 32), tokens, torch.arange(12).unsqueeze(0)).logits
    with torch.no_grad():
        ref = model(tokens).logits
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err  # 8-bit activations; a wrong RoPE row order gives ~1
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_steps_are_bit_identical_to_one_token_steps(tiny_gguf):
    """A T-token forward (prefill or a k + 1 verification) == T one-token forwards, bit for bit,
    for every kernel variant; and the variants agree with each other."""
    _, path = tiny_gguf
    tokens = torch.tensor([random_prompts([20], vocab=96, seed=4)[0]])
    results = []
    for variant in VARIANTS:
        rt = QuantRuntime(path, variant)
        state = rt.new_state(1, 32)
        whole = rt.forward(state, tokens, torch.arange(20).unsqueeze(0)).logits[0]
        state = rt.new_state(1, 32)
        rt.forward(state, tokens[:, :11], torch.arange(11).unsqueeze(0))
        verify = rt.forward(state, tokens[:, 11:], torch.arange(11, 20).unsqueeze(0)).logits[
            0
        ]  # a 9-token step
        state = rt.new_state(1, 32)
        steps = torch.cat(
            [rt.forward(state, tokens[:, i : i + 1], torch.tensor([[i]])).logits[0] for i in range(20)]
        )
        assert torch.equal(whole, steps), variant
        assert torch.equal(verify, steps[11:]), variant
        results.append(whole)
    assert all(torch.equal(r, results[0]) for r in results)


def test_fp16_cache_is_half_the_bytes_and_close_to_fp32(tiny_gguf):
    """The default cache keeps keys and values in fp16 (quant.KV_DTYPE): half the bytes of fp32,
    logits within rounding of the fp32 cache's, and a verification step still a one-token step's
    bits (test above); an fp32 cache given to an fp16 runtime is refused."""
    _, path = tiny_gguf
    tokens = torch.tensor([random_prompts([24], vocab=96, seed=5)[0]])
    logits = {}
    for dt in (torch.float16, torch.float32):
        rt = QuantRuntime(path, kv_dtype=dt)
        state = rt.new_state(1, 32)
        assert state.k[0].dtype == dt and state.v[0].element_size() == torch.finfo(dt).bits // 8
        logits[dt] = rt.forward(state, tokens, torch.arange(24).unsqueeze(0)).logits[0]
    half, full = logits[torch.float16], logits[torch.float32]
    assert not torch.equal(half, full)  # the cache is really fp16 (its rounding reaches the logits)
    # 8-bit activation blocks turn the cache's rounding into a few flipped levels per layer: within
    # the tolerance of the reference test above (SmolLM2-135M: perplexity 30.36 against 30.43 on 26
    # Spec-Bench prompts, results/kv16-2026-12-07/)
    assert (half - full).abs().max() / full.abs().max() < 0.05
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75
    with pytest.raises(SpecdraftError, match="cache of torch.float32"):
        QuantRuntime(path).forward(
            QuantRuntime(path, kv_dtype=torch.float32).new_state(1, 32), tokens[:, :1], torch.tensor([[0]])
        )


def test_greedy_speculative_equals_plain(tiny_gguf):
    _, path = tiny_gguf
    rt = QuantRuntime(path)
    prompts = random_prompts([1, 7], vocab=96) + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    reference = [plain_greedy(rt, p, 16) for p in prompts]
    for drafter in (ModelDrafter(rt, "self"), PromptLookupDrafter()):
        for k in (1, 4):
            assert decode(Engine(rt, drafter, FixedK(k)), prompts, 16) == reference


def test_hidden_states_and_refusals(tiny_gguf):
    _, path = tiny_gguf
    rt = QuantRuntime(path)
    tokens, pos = torch.tensor([[1, 2, 3]]), torch.arange(3).unsqueeze(0)
    plain = rt.forward(rt.new_state(1, 8), tokens, pos).logits
    out = rt.forward(rt.new_state(1, 8), tokens, pos, hidden_layers=(0, -1), logits_index=torch.tensor([[2]]))
    assert torch.equal(out.logits[0, 0], plain[0, 2])  # split layer calls change nothing
    assert set(out.hidden) == {0, -1} and out.hidden[0].shape == (1, 3, CFG["hidden_size"])
    with pytest.raises(SpecdraftError, match="tree masks"):  # query 0 would see later tokens
        rt.forward(rt.new_state(1, 8), tokens, pos, attn_mask=torch.ones(1, 3, 3, dtype=torch.bool))
    with pytest.raises(SpecdraftError, match="capacity"):
        rt.forward(rt.new_state(1, 2), tokens, pos)


def test_unsupported_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "f16.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecdraftError):
        QuantRuntime(path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(SpecdraftError, match="GGUF"):
        QuantRuntime(tmp_path / "junk.gguf")


def test_gguf_path(tmp_path):
    (tmp_path / "x.gguf").touch()
    assert quant.gguf_path(str(tmp_path / "x.gguf")) == tmp_path / "x.gguf"
    with pytest.raises(SpecdraftError, match="GGUF target"):
        quant.gguf_path("tiny")


# --------------------------------------------------------------------------------------------
# --dtype q loads the tokenizer only
# --------------------------------------------------------------------------------------------


def fake_conversion_cache(gguf_file, eos=(7, 9)):
    """The conversion cache entry load_model would write for ``gguf_file``, without its weights:
    the tiny byte-level tokenizer, a generation config and the marker with each file's sha256."""
    import json

    from specdraft.models import loading
    from specdraft.models.tiny import tiny_tokenizer

    cache = loading._cache_dir(gguf_file.stem, [gguf_file])
    cache.mkdir(parents=True)
    tiny_tokenizer().save_pretrained(cache)
    (cache / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}))
    marker = {"gguf": str(gguf_file), "files": loading._file_records(cache)}
    (cache / loading._CACHE_MARKER).write_text(json.dumps(marker))
    return cache


def test_load_tokenizer_reads_the_conversion_cache(tmp_path, monkeypatch):
    from specdraft.models import loading
    from specdraft.models.tiny import EOS_ID, tiny_tokenizer

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TYPES["Q8_0"])
    cache = fake_conversion_cache(path)
    called = []
    monkeypatch.setattr(loading, "load_model", lambda name, dtype: called.append(name) or "converted")
    loaded = loading.load_tokenizer(str(path))
    assert loaded.model is None and not called
    text = "speculative decoding"
    assert loaded.tokenizer(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]
    assert loaded.eos_ids() == tuple(sorted({7, 9, EOS_ID}))
    assert loaded.is_chat()
    # a damaged tokenizer file is not used: the model is loaded (converted again) instead
    with (cache / "tokenizer.json").open("a") as f:
        f.write(" ")
    assert loading.load_tokenizer(str(path)) == "converted" and called == [str(path)]


@pytest.mark.parametrize("dtype", ["q", "auto"])
def test_api_load_q_builds_no_transformers_model(tmp_path, monkeypatch, dtype):
    """``--dtype q`` (and ``auto``, for a quantized GGUF) with a drafter that needs no target model:
    the tokenizer only, and the same greedy tokens as plain decoding of the quantized runtime."""
    from specdraft import api
    from specdraft.models import loading

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TYPES["Q4_1"])
    fake_conversion_cache(path, eos=(95,))
    monkeypatch.setattr(loading, "load_model", lambda *a: pytest.fail("load_model called"))
    pipe = api.load(str(path), "lookup", dtype=dtype, threads=1)
    assert pipe.target.model is None and isinstance(pipe.runtime, QuantRuntime)
    assert 95 in pipe.eos_ids
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], random_prompts([9], vocab=90, seed=2)[0]]
    out, _ = api.run_batch(pipe, prompts, max_new_tokens=12, k=3)
    assert out == [plain_greedy(pipe.runtime, p, 12, eos_ids=pipe.eos_ids) for p in prompts]


def test_reports_name_the_block_types_and_keep_exact_equality(tiny_gguf):
    from specdraft.bench import harness

    rt = QuantRuntime(tiny_gguf[1])
    precision = harness.runtime_precision(rt)
    assert precision == "+".join(sorted(t.lower() for t in rt.w.types)) and precision.startswith("q")
    assert harness.tolerance(rt) == 0.0  # rows are bit-identical: no near-tie margin
