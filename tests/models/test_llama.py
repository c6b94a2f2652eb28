"""The compact Llama-family forward against transformers, in float32 on tiny random models."""

import copy

import pytest
import torch

from specdraft import kernels
from specdraft.errors import SpecdraftError
from specdraft.models.hf import HFRuntime
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.tiny import tiny_llama

ATOL = 2e-5


def tiny_family(model_type: str):
    """A tiny random Llama / Qwen2 (q/k/v biases) / Mistral with 3 layers and GQA."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    extra = {"sliding_window": None} if model_type != "llama" else {}
    cfg = cls(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=model_type == "qwen2",
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random biases and norm weights, so that they matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


def hf_logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits.float()


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama(seed=0)
    return model, LlamaRuntime(LlamaWeights.from_hf(model, torch.float32))


def full_forward(rt, ids: torch.Tensor, **kw):
    B, T = ids.shape
    state = rt.new_state(B, T + 4)
    return rt.forward(state, ids, torch.arange(T).expand(B, T), **kw)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_logits_equal_transformers(model_type):
    model = tiny_family(model_type)
    rt = LlamaRuntime(LlamaWeights.from_hf(model, torch.float32))
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(full_forward(rt, ids).logits, hf_logits(model, ids), atol=ATOL, rtol=0)


def test_incremental_equals_full(llama):
    model, rt = llama
    ids = torch.randint(0, 254, (1, 14), generator=torch.Generator().manual_seed(2))
    full = full_forward(rt, ids).logits[0]
    state = rt.new_state(1, 32)
    pieces, start = [], 0
    for size in (5, 3, 1, 1, 4):  # a prefill, a (k + 1)-token verification, single steps, another chunk
        pos = torch.arange(start, start + size).unsqueeze(0)
        pieces.append(rt.forward(state, ids[:, start : start + size], pos).logits[0])
        start += size
    torch.testing.assert_close(torch.cat(pieces), full, atol=ATOL, rtol=0)
    torch.testing.assert_close(full, hf_logits(model, ids)[0], atol=ATOL, rtol=0)


def test_rollback_is_overwriting(llama):
    """Feeding different tokens at positions already written replaces them (a rejected draft)."""
    _, rt = llama
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 254, (1, 10), generator=g)
    junk = torch.randint(0, 254, (1, 4), generator=g)
    state = rt.new_state(1, 16)
    rt.forward(state, ids[:, :6], torch.arange(6).unsqueeze(0))
    rt.forward(state, junk, torch.arange(6, 10).unsqueeze(0))  # a draft, then rejected
    again = rt.forward(state, ids[:, 6:], torch.arange(6, 10).unsqueeze(0)).logits[0]
    torch.testing.assert_close(again, full_forward(rt, ids).logits[0, 6:], atol=ATOL, rtol=0)


def test_ragged_rows_equal_separate_rows(llama):
    _, rt = llama
    g = torch.Generator().manual_seed(4)
    lengths = [4, 9, 6]
    rows = [torch.randint(0, 254, (n + 3,), generator=g) for n in lengths]
    # batched: prefill with right padding (junk past each row's end), then a ragged 3-token step
    P = max(lengths)
    pad = torch.zeros(3, P, dtype=torch.int64)
    for b, r in enumerate(rows):
        pad[b, : lengths[b]] = r[: lengths[b]]
    state = rt.new_state(3, P + 8)
    rt.forward(state, pad, torch.arange(P).expand(3, P))
    step = torch.stack([r[n:] for r, n in zip(rows, lengths)])  # (3, 3)
    positions = torch.tensor(lengths).unsqueeze(1) + torch.arange(3)  # (3, 3), different per row
    batched = rt.forward(state, step, positions).logits
    for b, r in enumerate(rows):
        alone = full_forward(rt, r.unsqueeze(0)).logits[0, lengths[b] :]
        torch.testing.assert_close(batched[b], alone, atol=ATOL, rtol=0)


def test_rows_can_leave_and_join(llama):
    _, rt = llama
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(0, 254, (1, 8), generator=g) for _ in range(3))
    state = rt.new_state(2, 12)
    rt.forward(state, torch.cat([a, b])[:, :6], torch.arange(6).expand(2, 6))
    state.select_rows(torch.tensor([1]))  # a leaves
    other = rt.new_state(1, 20)  # c joins with a larger capacity
    rt.forward(other, c[:, :6], torch.arange(6).unsqueeze(0))
    state.append(other)
    out = rt.forward(state, torch.cat([b, c])[:, 6:], torch.arange(6, 8).expand(2, 2)).logits
    torch.testing.assert_close(out[0], full_forward(rt, b).logits[0, 6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], full_forward(rt, c).logits[0, 6:], atol=ATOL, rtol=0)


def test_custom_attention_mask(llama):
    model, rt = llama
    ids = torch.randint(0, 254, (1, 7), generator=torch.Generator().manual_seed(6))
    causal = torch.tril(torch.ones(7, 7, dtype=torch.bool))
    same = full_forward(rt, ids, attn_mask=causal.unsqueeze(0)).logits
    torch.testing.assert_close(same, full_forward(rt, ids).logits, atol=ATOL, rtol=0)

    tree = causal.clone()
    tree[5:, 3] = False  # queries 5 and 6 do not see key 3 (a sibling branch in a tree)
    mine = full_forward(rt, ids, attn_mask=tree.unsqueeze(0)).logits
    ref = hf_logits(model, ids, attention_mask=tree[None, None], position_ids=torch.arange(7)[None])
    torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)
    assert (mine[0, 5:] - same[0, 5:]).abs().max() > 1e-3  # the mask did change them
    torch.testing.assert_close(mine[0, :5], same[0, :5], atol=ATOL, rtol=0)


def test_hidden_layers_match_transformers(llama):
    model, rt = llama
    ids = torch.randint(0, 254, (2, 6), generator=torch.Generator().manual_seed(7))
    out = full_forward(rt, ids, hidden_layers=(0, -1))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states  # embeddings, after layer 0, final (normed)
    assert set(out.hidden) == {0, -1}
    torch.testing.assert_close(out.hidden[0], hs[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden[-1], hs[-1], atol=ATOL, rtol=0)
    assert full_forward(rt, ids).hidden == {}


def test_logits_index_selects_positions(llama):
    _, rt = llama
    ids = torch.randint(0, 254, (2, 9), generator=torch.Generator().manual_seed(8))
    full = full_forward(rt, ids).logits
    index = torch.tensor([[8, 2], [0, 5]])
    picked = full_forward(rt, ids, logits_index=index).logits
    assert picked.shape == (2, 2, full.shape[-1])
    torch.testing.assert_close(picked, full.gather(1, index.unsqueeze(-1).expand(-1, -1, full.shape[-1])))


def test_layer_subset_is_the_pruned_model(llama):
    """``LlamaRuntime(w, [1])`` is the target with only layer 1, keeping embedding, norm and head."""
    model, rt = llama
    pruned = copy.deepcopy(model)
    pruned.model.layers = pruned.model.layers[1:]
    pruned.config.num_hidden_layers = 1
    for i, layer in enumerate(pruned.model.layers):
        layer.self_attn.layer_idx = i
    ids = torch.randint(0, 254, (1, 8), generator=torch.Generator().manual_seed(9))
    sub = LlamaRuntime(rt.w, [1])
    assert sub.layers[0] is rt.w.layers[1]  # shares tensors, owns only its cache
    torch.testing.assert_close(full_forward(sub, ids).logits, hf_logits(pruned, ids), atol=ATOL, rtol=0)


def test_bad_layer_ids_and_capacity(llama):
    _, rt = llama
    for layers in ([], [2], [-1]):
        with pytest.raises(SpecdraftError):
            LlamaRuntime(rt.w, layers)
    state = rt.new_state(1, 4)
    with pytest.raises(SpecdraftError, match="capacity"):
        rt.forward(state, torch.zeros(1, 5, dtype=torch.int64), torch.arange(5).unsqueeze(0))


def test_non_llama_family_is_refused_by_the_compact_runtime():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=64))
    with pytest.raises(SpecdraftError, match="transformers adapter"):
        LlamaWeights.from_hf(model, torch.float32)


def test_hf_adapter_matches_and_rolls_back(llama):
    model, _ = llama
    rt = HFRuntime(model)
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 254, (1, 10), generator=g)
    junk = torch.randint(0, 254, (1, 3), generator=g)
    state = rt.new_state(1, 16)
    first = rt.forward(state, ids[:, :6], torch.arange(6).unsqueeze(0), hidden_layers=(0,))
    rt.forward(state, junk, torch.arange(6, 9).unsqueeze(0))  # rejected draft
    rest = rt.forward(state, ids[:, 6:], torch.arange(6, 10).unsqueeze(0)).logits  # crops back to 6
    ref = hf_logits(model, ids)
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), ref, atol=ATOL, rtol=0)
    assert first.hidden[0].shape == (1, 6, 64)
    with pytest.raises(SpecdraftError):
        rt.new_state(2, 16)


def test_hf_adapter_rolls_back_past_a_sliding_window():
    """Gemma 3 style: a sliding-window layer next to a full one, rollbacks after the window is full.

    Regression: the adapter cropped with a positive length (transformers 5.2x raises) and, once the
    window was full, sliding layers had already dropped the states a rollback needs.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    rt = HFRuntime(model)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (1, 16), generator=g)
    state = rt.new_state(1, 32)
    out, L = [], 0
    for size in (6, 3, 4, 3):  # like speculative steps: feed more than we keep, then roll back
        feed = torch.cat([ids[:, L : L + 1 + size - 1], torch.randint(0, 64, (1, 2), generator=g)], 1)
        logits = rt.forward(state, feed, torch.arange(L, L + feed.shape[1]).unsqueeze(0)).logits
        out.append(logits[:, :size])  # the first `size` fed tokens are the real sequence
        L += size
    torch.testing.assert_close(torch.cat(out, 1), hf_logits(model, ids), atol=ATOL, rtol=0)


def test_one_row_linear_uses_a_transposed_copy_that_follows_in_place_changes():
    from specdraft.models.llama import linear, transposed

    torch.manual_seed(3)
    w, b = torch.randn(48, 32), torch.randn(48)
    x1, x4 = torch.randn(1, 1, 32), torch.randn(1, 4, 32)
    torch.testing.assert_close(linear(x1, w, b, None), torch.nn.functional.linear(x1, w, b))
    torch.testing.assert_close(linear(x4, w, b, None), torch.nn.functional.linear(x4, w, b))
    assert transposed(w) is transposed(w)  # made once per weight
    w.mul_(2)  # an in-place update (training) must not leave a stale copy behind
    torch.testing.assert_close(linear(x1, w, None, None), torch.nn.functional.linear(x1, w))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9])
def test_linear_matches_f_linear_for_every_row_count(rows):
    from specdraft.models.llama import linear

    torch.manual_seed(rows)
    w, b = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(1, rows, 24)
    torch.testing.assert_close(linear(x, w, b, None), torch.nn.functional.linear(x, w, b))
    torch.testing.assert_close(
        linear(x.view(rows, 1, 24), w, None, None), torch.nn.functional.linear(x.view(rows, 1, 24), w)
    )


def _prefilled_rows(rt, prompts: torch.Tensor, capacity: int):
    """A batch state whose rows were each prefilled on their own and then appended (how requests
    join a batch), so that every row's cache is bit for bit what that row alone would have."""
    B, P = prompts.shape
    rows = []
    for b in range(B):
        rows.append(rt.new_state(1, capacity))
        last = torch.tensor([[P - 1]])
        rt.forward(rows[-1], prompts[b : b + 1], torch.arange(P).unsqueeze(0), logits_index=last)
    for one in rows[1:]:
        rows[0].append(one)
    return rows[0]


@pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.status()}")
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "B,T",
    [(3, 20), (6, 4), (20, 1), (1, 17), (17, 16)],
    ids=["rows-and-tokens", "rows", "plain-batch", "tokens", "beyond-256-rows"],
)
def test_scoring_steps_beyond_the_kernels_limits_equal_one_token_steps(weights, B, T):
    """A step of T new tokens for B rows, with B x T rows beyond the kernels' 16 (fp32 weights) or
    256 (bf16 weights) or T beyond the fused attention's 16, gives each row's logits and cache
    entries bit for bit what that row alone gets from T one-token steps."""
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    rt = LlamaRuntime(LlamaWeights.from_hf(tiny_llama(seed=0), dtype, compute=torch.float32))
    g = torch.Generator().manual_seed(B * 100 + T)
    P, cap = 9, 9 + T + 1
    prompts, new = torch.randint(0, 254, (B, P), generator=g), torch.randint(0, 254, (B, T), generator=g)

    state = _prefilled_rows(rt, prompts, cap)
    step = rt.forward(state, new, (P + torch.arange(T)).expand(B, T)).logits  # (B, T, V)
    for b in range(B):
        one = _prefilled_rows(rt, prompts[b : b + 1], cap)
        # singles: (1, T, V)
        singles = torch.cat(
            [rt.forward(one, new[b : b + 1, t : t + 1], torch.tensor([[P + t]])).logits for t in range(T)], 1
        )
        assert torch.equal(step[b], singles[0]), f"row {b}: {float((step[b] - singles[0]).abs().max())}"
        for big, small in zip(state.k + state.v, one.k + one.v):
            assert torch.equal(big[b], small[0])


@pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.status()}")
def test_prefill_keeps_torch_for_many_rows_and_tokens(monkeypatch):
    """A prefill (logits_index given) of many tokens stays on torch's matmuls and attention, which
    are faster there; only scoring steps need the kernels beyond their limits."""
    rt = LlamaRuntime(LlamaWeights.from_hf(tiny_llama(seed=0), torch.float32))
    calls = []
    real = kernels.fewrows_matmul
    monkeypatch.setattr(kernels, "fewrows_matmul", lambda x, w: calls.append(x.shape) or real(x, w))
    monkeypatch.setattr(kernels, "RopeAttention", lambda *a: pytest.fail("fused attention in a prefill"))
    ids = torch.randint(0, 254, (2, 40), generator=torch.Generator().manual_seed(0))
    last = torch.tensor([[39], [39]])
    rt.forward(rt.new_state(2, 48), ids, torch.arange(40).expand(2, 40), logits_index=last)
    assert calls == [(2, 1, 64)]  # only the LM head over the two selected positions
