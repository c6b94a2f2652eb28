"""The native few-row kernels: correct, row-invariant, and used (or cleanly skipped) by the runtime."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specdraft import kernels
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.tiny import tiny_llama
from specdraft.tree import TokenTree

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"native kernel: {kernels.status()}")


@needs_kernel
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [301, 336])  # 336: bf16 goes through the packed kernel (N % 16 == 0)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 40, 100])
def test_fewrows_matmul_matches_torch(M, N, wdtype):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 200, generator=g)
    w = torch.randn(N, 200, generator=g).to(wdtype)  # K % 8 == 0
    y = kernels.fewrows_matmul(x, w)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N", [1000, 1008])  # 1008 = 63 blocks of 16: the packed bf16 kernel, odd split
@pytest.mark.parametrize("K", [576, 1000])  # row groups take K in chunks: 2 x 288, 4 x 250
def test_each_row_is_bit_identical_whatever_else_is_in_the_batch(wdtype, threads, N, K):
    """The property that makes a (k+1)-token verification agree with k+1 one-token steps."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, K, generator=g)
    w = (torch.randn(N, K, generator=g) * 0.05).to(wdtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        singles = torch.cat([kernels.fewrows_matmul(x[i : i + 1], w) for i in range(40)])
        for M in (2, 3, 5, 7, 8, 9, 13, 16, 40):
            assert torch.equal(kernels.fewrows_matmul(x[:M], w), singles[:M]), M
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_packed_copy_follows_in_place_changes_of_the_weight():
    x = torch.randn(2, 64)
    w = torch.randn(32, 64).bfloat16()
    before = kernels.fewrows_matmul(x, w)
    assert kernels.packed(w) is kernels.packed(w)  # cached
    w.mul_(2)
    assert torch.equal(kernels.fewrows_matmul(x, w), before * 2)  # exact: a power-of-two scale


@needs_kernel
def test_a_runtime_packs_its_weights_when_built_not_in_its_first_step(monkeypatch):
    """The first decode step is timed by an adaptive policy: packing in it read as draft latency
    (a feature draft's first proposal took 30 ms instead of 3 and k = auto decoded plainly)."""
    model = tiny_llama(vocab_size=256, dtype=torch.float32, hidden_size=64, seed=3)
    rt = LlamaRuntime(LlamaWeights.from_hf(model, torch.bfloat16, compute=torch.float32))
    calls = []
    monkeypatch.setattr(kernels, "pack_bf16", lambda w: calls.append(w.shape))
    state = rt.new_state(1, 16)
    rt.forward(state, torch.tensor([[1, 2, 3]]), torch.arange(3).view(1, -1))
    rt.forward(state, torch.tensor([[4]]), torch.tensor([[3]]))
    assert calls == []
    fc = torch.randn(64, 128).bfloat16()
    kernels.prepack(fc, torch.randn(64, 128))  # fp32 weights are not packed
    kernels.packed(fc)  # cached: not packed again
    assert calls == [(64, 128)]


def test_pack_bf16_layout():
    w = torch.arange(32 * 3, dtype=torch.float32).view(32, 3).bfloat16()
    p = kernels.pack_bf16(w)
    assert p.shape == (2, 3, 16)
    for j in range(2):
        for pos in range(16):
            col = 16 * j + pos // 2 + 8 * (pos % 2)
            assert torch.equal(p[j, :, pos], w[col])


@needs_kernel
def test_supports_only_what_the_kernel_handles():
    w = torch.randn(64, 32)
    assert kernels.supports(torch.randn(3, 32), w)
    assert kernels.supports(torch.randn(3, 32), w.bfloat16())
    assert not kernels.supports(torch.randn(3, 30), torch.randn(64, 30))  # K % 8
    assert not kernels.supports(torch.randn(kernels.MAX_ROWS + 1, 32), w)  # many rows: torch's GEMM
    # bf16 weights the packed kernel takes: up to PACKED_MAX_ROWS (torch would widen W every call)
    assert kernels.supports(torch.randn(kernels.PACKED_MAX_ROWS, 32), w.bfloat16())
    assert not kernels.supports(torch.randn(kernels.PACKED_MAX_ROWS + 1, 32), w.bfloat16())
    # N % 16 != 0
    assert not kernels.supports(torch.randn(kernels.MAX_ROWS + 1, 32), torch.randn(40, 32).bfloat16())
    assert not kernels.supports(torch.randn(3, 32).bfloat16(), w.bfloat16())  # bf16 activations
    assert not kernels.supports(torch.randn(3, 32), torch.randn(32, 64).t())  # not contiguous


@needs_kernel
def test_rms_norm_matches_torch():
    x, w = torch.randn(2, 5, 64), torch.randn(64)
    assert torch.allclose(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5), atol=1e-6)
    assert kernels.rms_norm(x.bfloat16(), w, 1e-5) is None  # not for bf16
    assert kernels.rms_norm(torch.randn(2, 30), torch.randn(30), 1e-5) is None  # K % 8


def test_disabled_by_environment_falls_back(tmp_path):
    code = "from specdraft import kernels; print(kernels.available(), kernels.status())"
    env = dict(os.environ, SPECDRAFT_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False disabled by SPECDRAFT_KERNELS=0"


def test_a_failed_build_is_reported_not_raised(tmp_path):
    """No compiler: the runtime falls back to torch; status says why."""
    code = "from specdraft import kernels; print(kernels.available()); print(kernels.status())"
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), SPECDRAFT_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    if "CPU lacks" in lines[1]:
        pytest.skip(lines[1])
    assert lines[0] == "False" and lines[1].startswith("build failed:"), lines


@needs_kernel
def test_bf16_weights_run_with_fp32_arithmetic_and_verification_matches_single_steps():
    """bf16 weights on a CPU without native bf16: fp32 activations, and the logits of a 5-token
    forward equal (bit for bit) those of five 1-token forwards."""
    model = tiny_llama(vocab_size=256, dtype=torch.float32, hidden_size=64, seed=3)
    rt = LlamaRuntime(LlamaWeights.from_hf(model, torch.bfloat16, compute=torch.float32))
    assert rt.w.dtype == torch.bfloat16 and rt.dtype == torch.float32
    assert "fp32 compute" in repr(rt)
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    new = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))

    a = rt.new_state(1, 32)
    rt.forward(a, prompt, torch.arange(12).view(1, -1))
    together = rt.forward(a, new, torch.arange(12, 17).view(1, -1)).logits  # (1, 5, V)

    b = rt.new_state(1, 32)
    rt.forward(b, prompt, torch.arange(12).view(1, -1))
    one_by_one = torch.cat(
        [rt.forward(b, new[:, i : i + 1], torch.tensor([[12 + i]])).logits for i in range(5)], 1
    )
    assert together.dtype == torch.float32
    assert torch.equal(together.argmax(-1), one_by_one.argmax(-1))
    assert torch.allclose(together, one_by_one, atol=1e-5)

    # and the model is the bf16-weight model: close to the fp32 one, not equal to it
    ref = LlamaRuntime(LlamaWeights.from_hf(model, torch.float32))
    c = ref.new_state(1, 32)
    full = ref.forward(c, torch.cat([prompt, new], 1), torch.arange(17).view(1, -1)).logits[:, 12:]
    assert not torch.equal(full, together)
    assert torch.allclose(full, together, atol=0.05)


def _rope_tables(n: int, D: int):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    fr = torch.outer(torch.arange(n).float(), inv)
    emb = torch.cat((fr, fr), -1)
    return emb.cos().contiguous(), emb.sin().contiguous()


@needs_kernel
@pytest.mark.parametrize("T, amp", [(1, 1.0), (3, 1.0), (8, 1.0), (3, 30.0)])
def test_rope_attend_matches_torch(T, amp):
    """RoPE + cache write + causal attention against the runtime's torch ops, ragged rows. amp = 30
    makes scores of several hundred, whose exps overflow unless the softmax takes its true max."""
    from specdraft.models.llama import rotate_half

    g = torch.Generator().manual_seed(T)
    B, H, G, D, cap = 2, 6, 2, 32, 48
    pos = torch.stack([torch.arange(5, 5 + T), torch.arange(17, 17 + T)])  # rows at different lengths
    qkv = torch.randn(B, T, (H + 2 * G) * D, generator=g) * amp
    cos, sin = _rope_tables(64, D)
    kc, vc = torch.randn(B, G, cap, D, generator=g) * amp, torch.randn(B, G, cap, D, generator=g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out = kernels.RopeAttention(pos, cos, sin, H, G)(qkv, kc, vc)

    qk, v = qkv.view(B, T, H + 2 * G, D).transpose(1, 2).split((H + G, G), dim=1)
    qk = qk * cos[pos].unsqueeze(1) + rotate_half(qk) * sin[pos].unsqueeze(1)
    q, k = qk.split((H, G), dim=1)
    for b in range(B):
        kc_ref[b, :, pos[b]], vc_ref[b, :, pos[b]] = k[b], v[b]
    S = int(pos.max()) + 1
    mask = (torch.arange(S) <= pos.unsqueeze(-1)).unsqueeze(1)
    ref = F.scaled_dot_product_attention(
        q, kc_ref[:, :, :S], vc_ref[:, :, :S], attn_mask=mask, enable_gqa=True
    )
    assert out.shape == (B, T, H * D)
    atol = 1e-5 if amp == 1 else 1e-3  # logits of ~500 carry ~5e-5 of rounding
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref.transpose(1, 2).reshape(B, T, H * D), atol=atol)
    assert torch.allclose(kc, kc_ref, atol=1e-6 * amp) and torch.equal(vc, vc_ref)  # other slots untouched


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_attend_verification_equals_single_steps(threads):
    """T new tokens in one call give bit-identical outputs and caches to T one-token calls (with 2
    threads the one-token calls give each work item one query head, the 8-token call one KV head's
    three: a query's result must not depend on that)."""
    g = torch.Generator().manual_seed(1)
    B, H, G, D, cap, T, start = 1, 9, 3, 64, 64, 8, 21
    qkv = torch.randn(B, T, (H + 2 * G) * D, generator=g)
    cos, sin = _rope_tables(64, D)
    kc = torch.randn(B, G, cap, D, generator=g)
    vc = torch.randn(B, G, cap, D, generator=g)
    kc1, vc1 = kc.clone(), vc.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pos = torch.arange(start, start + T).unsqueeze(0)
        many = kernels.RopeAttention(pos, cos, sin, H, G)(qkv, kc, vc)
        singles = torch.cat(
            [
                kernels.RopeAttention(pos[:, t : t + 1], cos, sin, H, G)(qkv[:, t : t + 1], kc1, vc1)
                for t in range(T)
            ],
            1,
        )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(many, singles)
    assert torch.equal(kc, kc1) and torch.equal(vc, vc1)


@needs_kernel
def test_rope_attention_rejects_mismatched_inputs():
    cos, sin = _rope_tables(16, 32)
    with pytest.raises(ValueError, match="cover 16 positions"):
        kernels.RopeAttention(torch.tensor([[16]]), cos, sin, 4, 2)
    att = kernels.RopeAttention(torch.tensor([[3]]), cos, sin, 4, 2)
    kc = torch.zeros(1, 2, 8, 32)
    with pytest.raises(ValueError, match="qkv"):
        att(torch.zeros(1, 1, 7 * 32), kc, kc.clone())
    with pytest.raises(ValueError, match="contiguous"):
        att(torch.zeros(1, 1, 8 * 32), kc.transpose(2, 3).contiguous().transpose(2, 3), kc.clone())
    small = torch.zeros(1, 2, 3, 32)  # slot 3 does not exist
    with pytest.raises(ValueError, match="beyond cache capacity"):
        att(torch.zeros(1, 1, 8 * 32), small, small.clone())


@needs_kernel
def test_native_decoder_layers_match_layer_by_layer_and_keep_rows_independent(monkeypatch):
    """kernels.DecodeLayers (every layer of a decode step in one native call): close to the
    layer-by-layer forward, and each row's logits bit-identical whatever else is in the step."""
    model = tiny_llama(
        vocab_size=256, dtype=torch.float32, hidden_size=64, num_heads=4, num_kv_heads=2, seed=5
    )
    rt = LlamaRuntime(LlamaWeights.from_hf(model, torch.bfloat16, compute=torch.float32))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (2, 12), generator=g)
    new = torch.randint(0, 256, (2, 5), generator=g)
    pos = torch.stack([torch.arange(12, 17), torch.arange(9, 14)])  # ragged: row 1 continues from position 9

    def step(native: bool, rows=(0, 1), T=5, hidden=()):
        monkeypatch.setattr(kernels, "USE_NATIVE_LAYERS", native)
        st = rt.new_state(len(rows), 32)
        rt.forward(st, prompts[list(rows)], torch.arange(12).expand(len(rows), 12))
        if T == 5:
            return rt.forward(st, new[list(rows)], pos[list(rows)], hidden_layers=hidden), st
        outs = [
            rt.forward(st, new[list(rows), i : i + 1], pos[list(rows), i : i + 1]).logits for i in range(5)
        ]
        return torch.cat(outs, 1), st

    calls = []
    real = kernels.DecodeLayers.__call__
    monkeypatch.setattr(
        kernels.DecodeLayers, "__call__", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw)
    )
    native, st_native = step(True, hidden=(-1,))
    assert calls, "the native layers did not run"
    layerwise, st_layer = step(False, hidden=(-1,))
    assert torch.equal(native.logits.argmax(-1), layerwise.logits.argmax(-1))
    assert torch.allclose(native.logits, layerwise.logits, atol=1e-4)
    assert torch.allclose(native.hidden[-1], layerwise.hidden[-1], atol=1e-4)
    for a, b in zip(st_native.k + st_native.v, st_layer.k + st_layer.v):
        assert torch.allclose(a, b, atol=1e-5)

    for r in (0, 1):  # a row alone, and the same row one token at a time: bit for bit
        assert torch.equal(step(True, rows=(r,))[0].logits[0], native.logits[r])
        assert torch.equal(step(True, rows=(r,), T=1)[0][0], native.logits[r])


@needs_kernel
def test_native_decoder_layers_hand_out_intermediate_layers_bit_for_bit(monkeypatch):
    """Hidden states inside the stack keep a step on the native layers (one call per span,
    ``DecodeLayers(span=...)``): logits bit for bit the no-hidden step's, each hidden state bit
    for bit what a runtime of only the layers up to it ends with, close to the layer-by-layer path."""
    model = tiny_llama(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, seed=6)
    weights = LlamaWeights.from_hf(model, torch.bfloat16, compute=torch.float32)
    rt = LlamaRuntime(weights)
    g = torch.Generator().manual_seed(1)
    prompts, new = torch.randint(0, 256, (2, 10), generator=g), torch.randint(0, 256, (2, 3), generator=g)
    pos = torch.stack([torch.arange(10, 13), torch.arange(7, 10)])  # ragged rows

    def step(runtime, hidden, native=True):
        monkeypatch.setattr(kernels, "USE_NATIVE_LAYERS", native)
        st = runtime.new_state(2, 32)
        runtime.forward(st, prompts, torch.arange(10).expand(2, 10))
        spans.clear()  # the spans of the step below only
        return runtime.forward(st, new, pos, hidden_layers=hidden)

    spans = []
    real = kernels.DecodeLayers.__call__
    monkeypatch.setattr(
        kernels.DecodeLayers,
        "__call__",
        lambda self, *a, **kw: spans.append(kw.get("span")) or real(self, *a, **kw),
    )
    plain = step(rt, ())
    assert spans == [(0, 4)]
    out = step(rt, (-1, 0, 2))
    assert spans == [(0, 1), (1, 3), (3, 4)], "intermediate layers left the native path"
    assert torch.equal(out.logits, plain.logits)
    for li in (0, 2):
        alone = step(LlamaRuntime(weights, layer_ids=list(range(li + 1))), (li,))
        assert torch.equal(out.hidden[li], alone.hidden[li])
    slow = step(rt, (-1, 0, 2), native=False)
    for li in (-1, 0, 2):
        assert torch.allclose(out.hidden[li], slow.hidden[li], atol=1e-4)
        assert not torch.equal(out.hidden[li], out.hidden[2 if li != 2 else 0])
    # a token-tree step too (the native tree layout, spans in between)
    tree = TokenTree.from_chains([[5, 6, 7], [5, 8], [9]])
    root = [10, 7]

    def tree_step(hidden):
        monkeypatch.setattr(kernels, "USE_NATIVE_LAYERS", True)
        st = rt.new_state(2, 32)
        rt.forward(st, prompts, torch.arange(10).expand(2, 10))
        spans.clear()
        return rt.forward(
            st,
            torch.cat([new[:, :1], tree.tokens.expand(2, -1)], 1),
            torch.stack([tree.positions(r) for r in root]),
            hidden_layers=hidden,
            attn_mask=torch.stack([tree.step_mask(r, 32) for r in root]),
            slots=torch.stack([tree.slots(r) for r in root]),
        )

    assert torch.equal(tree_step((-1, 1)).logits, tree_step(()).logits)
    assert spans == [(0, 4)]
    tree_step((-1, 1))
    assert spans == [(0, 2), (2, 4)]
    with pytest.raises(SpecdraftError, match="hidden layers"):
        step(rt, (4,))
    with pytest.raises(ValueError, match="span"):
        rt._decode_layers(torch.zeros(1, 1, 64), pos[:1, :1], None, *rt._rope_tables(16), span=(2, 2))
