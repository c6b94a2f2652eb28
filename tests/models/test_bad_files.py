"""Damaged model files: a truncated or corrupt GGUF, a truncated safetensors file, a cache entry
whose files changed after it was written. Each is one SpecdraftError line (exit 2 from the CLI)
or, for the cache, a rebuild; never a traceback."""

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from specdraft import cli
from specdraft.errors import SpecdraftError
from specdraft.models import load_model, loading
from specdraft.models.tiny import tiny_llama, tiny_tokenizer


def write_tiny_gguf(path, drop: str | None = None) -> None:
    """A one-layer Llama GGUF (float32 tensors, a byte-level BPE tokenizer of 259 tokens) that
    transformers converts in about a second; ``drop`` leaves that tensor out."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", *(bytes_to_unicode()[b] for b in range(256)), "Ġt", "he"]
    V, C, F, H, G = len(tokens), 16, 32, 2, 1
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(C)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(C // H)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (V - 1))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    shapes = {
        "token_embd.weight": (V, C),
        "output_norm.weight": (C,),
        "output.weight": (V, C),
        "blk.0.attn_norm.weight": (C,),
        "blk.0.attn_q.weight": (C, C),
        "blk.0.attn_k.weight": (C // H * G, C),
        "blk.0.attn_v.weight": (C // H * G, C),
        "blk.0.attn_output.weight": (C, C),
        "blk.0.ffn_norm.weight": (C,),
        "blk.0.ffn_gate.weight": (F, C),
        "blk.0.ffn_up.weight": (F, C),
        "blk.0.ffn_down.weight": (C, F),
    }
    for name, shape in shapes.items():
        if name != drop:
            w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _data_offset(path) -> int:
    from gguf import GGUFReader

    return GGUFReader(path).data_offset


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_a_truncated_gguf_is_refused_at_every_cut(tiny_gguf, tmp_path):
    """Every cut in the first 64 bytes (magic, version, counts, first key), a stride through the
    metadata and tensor table that lands at every position within their fields, and a spread of
    cuts in the tensor data."""
    data = tiny_gguf.read_bytes()
    header = _data_offset(tiny_gguf)
    loading.check_gguf(tiny_gguf)  # the whole file passes
    cut = tmp_path / "cut.gguf"
    for n in [*range(64), *range(64, header, 41), *range(header, len(data), 509), len(data) - 1]:
        cut.write_bytes(data[:n])
        with pytest.raises(SpecdraftError) as e:
            loading.check_gguf(cut)
        assert _one_line(e).startswith(
            f"cut.gguf is not a complete GGUF file: truncated or corrupt ({n} bytes;"
        ), n


@pytest.mark.parametrize("n", [3, 24, 700, 2500, -5])
def test_a_truncated_gguf_is_one_line_and_exit_2_from_the_cli(tiny_gguf, tmp_path, cache, capsys, n):
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf.read_bytes()[:n])
    rc = cli.main(
        ["generate", "--target", str(tmp_path / "cut.gguf"), "--draft", "none", "--threads", "1", "hi"]
    )
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("specdraft generate: error: cut.gguf is not a complete GGUF file"), err
    assert not (cache / "models").exists() or not any(
        p.name.startswith("cut-") for p in (cache / "models").iterdir()
    )


def test_random_bytes_in_the_header_load_or_give_one_line(tiny_gguf, tmp_path, cache):
    """A header byte changed at random either still loads (a name, a token's spelling) or is one
    SpecdraftError line; seeded, so a failure reproduces."""
    data = tiny_gguf.read_bytes()
    header = _data_offset(tiny_gguf)
    rng = random.Random(0)
    refused = 0
    for i in range(40):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(header)] = rng.randrange(256)
        bad = tmp_path / f"bad{i}.gguf"
        bad.write_bytes(bytes(b))
        try:
            load_model(str(bad), dtype=torch.float32)
        except SpecdraftError as e:
            assert str(e) and "\n" not in str(e)
            refused += 1
    assert refused >= 20  # most such changes break the file


def test_a_gguf_without_a_tensor_is_refused_not_filled_with_random_weights(tmp_path, cache):
    write_tiny_gguf(tmp_path / "partial.gguf", drop="blk.0.attn_q.weight")
    with pytest.raises(SpecdraftError) as e:
        load_model(str(tmp_path / "partial.gguf"))
    assert (
        "partial.gguf is corrupt or incomplete: no weights for model.layers.0.self_attn.q_proj"
        in _one_line(e)
    )


@pytest.mark.parametrize("cut", [0, 8, 1000, 0.5])
def test_a_truncated_safetensors_directory_is_one_line(tmp_path, cut):
    tiny_llama(seed=3).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(cut * len(data)) if isinstance(cut, float) else cut])
    with pytest.raises(SpecdraftError) as e:
        load_model(str(tmp_path))
    assert _one_line(e).startswith(f"cannot load {tmp_path}: SafetensorError")


def _entry(cache):
    (entry,) = (cache / "models").iterdir()
    return entry


def _truncate(f):
    f.write_bytes(f.read_bytes()[:-100])


def _flip_a_byte(f):
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))


def _drop_the_file_record(marker):
    record = json.loads(marker.read_text())
    del record["files"]
    marker.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda e: _truncate(e / "model.safetensors"), id="truncated-weights"),
        pytest.param(lambda e: _flip_a_byte(e / "model.safetensors"), id="flipped-weight-byte"),
        pytest.param(lambda e: _flip_a_byte(e / "tokenizer.json"), id="flipped-tokenizer-byte"),
        pytest.param(lambda e: (e / "config.json").unlink(), id="missing-config"),
        pytest.param(lambda e: _drop_the_file_record(e / loading._CACHE_MARKER), id="marker-without-record"),
    ],
)
def test_a_damaged_cache_entry_is_converted_again(tiny_gguf, cache, monkeypatch, caplog, damage):
    first = load_model(str(tiny_gguf), dtype=torch.float32)
    assert "converted now" in first.source
    entry = _entry(cache)
    record = json.loads((entry / loading._CACHE_MARKER).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(record)
    assert "cached at" in load_model(str(tiny_gguf), dtype=torch.float32).source  # intact: no conversion

    damage(entry)
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        again = load_model(str(tiny_gguf), dtype=torch.float32)
    assert again.source == f"GGUF {tiny_gguf} (converted now, cached at {entry})"
    assert "is damaged" in caplog.text and str(entry) in caplog.text
    assert _entry(cache) == entry  # rebuilt in place, nothing left beside it
    for name, tensor in again.model.state_dict().items():
        assert torch.equal(tensor, first.model.state_dict()[name]), name
    assert "cached at" in load_model(str(tiny_gguf), dtype=torch.float32).source


def test_an_unchanged_entry_is_not_hashed_again(tiny_gguf, cache, monkeypatch):
    """A file whose size and mtime are as recorded is not read; one written since is hashed, and
    the marker takes its new mtime when the hash still matches (a record without mtimes too)."""
    load_model(str(tiny_gguf), dtype=torch.float32)
    entry = _entry(cache)
    hashed = []
    real = loading.hashlib.file_digest
    monkeypatch.setattr(
        loading.hashlib, "file_digest", lambda fh, algo: hashed.append(fh.name) or real(fh, algo)
    )
    assert "cached at" in load_model(str(tiny_gguf), dtype=torch.float32).source
    assert hashed == []
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # same bytes, new mtime
    marker = entry / loading._CACHE_MARKER
    record = json.loads(marker.read_text())
    del record["files"]["config.json"]["mtime_ns"]  # a marker written before mtimes were recorded
    marker.write_text(json.dumps(record))
    assert "cached at" in load_model(str(tiny_gguf), dtype=torch.float32).source
    assert sorted(Path(n).name for n in hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    assert "cached at" in load_model(str(tiny_gguf), dtype=torch.float32).source
    assert hashed == []
