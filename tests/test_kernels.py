"""The native few-row kernels: correct, row-invariant, and used (or cleanly skipped) by the runtime."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specdraft import kernels
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.tiny import tiny_llama

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"native kernel: {kernels.status()}")


@needs_kernel
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9, 16])
def test_fewrows_matmul_matches_torch(M, wdtype):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 200, generator=g)
    w = torch.randn(301, 200, generator=g).to(wdtype)  # N not a multiple of the tile, K % 8 == 0
    y = kernels.fewrows_matmul(x, w)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.float32 and y.shape == (M, 301)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_bit_identical_whatever_else_is_in_the_batch(wdtype, threads):
    """The property that makes a (k+1)-token verification agree with k+1 one-token steps."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 576, generator=g)
    w = (torch.randn(1000, 576, generator=g) * 0.05).to(wdtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        singles = torch.cat([kernels.fewrows_matmul(x[i : i + 1], w) for i in range(16)])
        for M in (2, 3, 5, 8, 9, 16):
            assert torch.equal(kernels.fewrows_matmul(x[:M], w), singles[:M]), M
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_supports_only_what_the_kernel_handles():
    w = torch.randn(64, 32)
    assert kernels.supports(torch.randn(3, 32), w)
    assert kernels.supports(torch.randn(3, 32), w.bfloat16())
    assert not kernels.supports(torch.randn(3, 30), torch.randn(64, 30))  # K % 8
    assert not kernels.supports(torch.randn(kernels.MAX_ROWS + 1, 32), w)  # many rows: torch's GEMM
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
    one_by_one = torch.cat([rt.forward(b, new[:, i : i + 1], torch.tensor([[12 + i]])).logits for i in range(5)], 1)
    assert together.dtype == torch.float32
    assert torch.equal(together.argmax(-1), one_by_one.argmax(-1))
    assert torch.allclose(together, one_by_one, atol=1e-5)

    # and the model is the bf16-weight model: close to the fp32 one, not equal to it
    ref = LlamaRuntime(LlamaWeights.from_hf(model, torch.float32))
    c = ref.new_state(1, 32)
    full = ref.forward(c, torch.cat([prompt, new], 1), torch.arange(17).view(1, -1)).logits[:, 12:]
    assert not torch.equal(full, together)
    assert torch.allclose(full, together, atol=0.05)
