"""``--dtype auto`` picks the quantized runtime for a quantized GGUF target unless the run needs
the transformers model (then bf16, said in one line), and the commands say what they need."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specdraft import api, cli, dtypes, kernels
from specdraft.errors import SpecdraftError
from specdraft.models import quant
from specdraft.models.quant import QuantRuntime
from tests.models.test_quant import TYPES, write_tiny_gguf

pytestmark = pytest.mark.skipif(
    not kernels.available() or "avx2" not in quant.variants(),
    reason=f"native kernels unavailable ({kernels.status()})",
)


@pytest.fixture
def q41(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TYPES["Q4_1"])
    return path


def test_auto_picks_the_quantized_runtime_unless_the_run_needs_the_model(q41, capsys):
    assert isinstance(api.auto_quant_runtime(str(q41), ("lookup",)), QuantRuntime)
    assert isinstance(api.auto_quant_runtime(str(q41), ("self", "llamacpp")), QuantRuntime)
    assert capsys.readouterr().err == ""
    for needs, why in ((("prune",), "layer-pruned"), (("lookup", "hf"), "transformers baselines")):
        assert api.auto_quant_runtime(str(q41), needs) is None
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("--dtype auto: bf16") and why in line
    assert api.auto_quant_runtime("tiny") is None  # not a GGUF: bf16, nothing said
    assert capsys.readouterr().err == ""


def test_auto_keeps_bf16_for_blocks_the_kernels_do_not_take(tmp_path, monkeypatch, capsys):
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
    assert api.auto_quant_runtime(str(path)) is None
    assert "--dtype auto: bf16" in capsys.readouterr().err
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:100])  # damaged: an error, not a fallback
    with pytest.raises(SpecdraftError, match="not a complete GGUF"):
        api.auto_quant_runtime(str(tmp_path / "cut.gguf"))


def test_help_names_the_choice():
    assert "quantized runtime" in dtypes.help_text("target")
    assert set(dtypes.AUTO_KEEPS_BF16) >= {"prune", "hf", "attack"}


@pytest.mark.parametrize(
    "argv, needs",
    [
        (["bench", "--baselines", "hf,llamacpp"], ("hf", "llamacpp")),
        (["bench"], ()),
        (["demo", "--baselines"], ("hf",)),
        (["demo"], ()),
        (["attack", "--method", "lookup"], ("attack",)),
    ],
)
def test_commands_say_what_they_run_beside_the_target(monkeypatch, tmp_path, capsys, argv, needs):
    seen = {}

    def fake_load(*args, **kwargs):
        seen.update(kwargs)
        raise SpecdraftError("stop here")

    monkeypatch.setattr(api, "load", fake_load)
    monkeypatch.setattr("specdraft.bench.llamacpp_baselines.require", lambda: None, raising=False)
    extra = ["--out", str(tmp_path / "out")] if argv[0] in ("demo", "attack") else []
    assert cli.main([*argv, *extra, "--threads", "1"]) == 2
    assert "stop here" in capsys.readouterr().err
    assert tuple(seen["needs"]) == needs and seen["dtype"] == "auto"


def test_a_drafter_that_wraps_a_model_draft_gets_the_transformers_model(q41, monkeypatch):
    """``tree:self`` (not only ``designed:``) may build from the transformers model: a quantized
    target keeps its runtime and loads the model beside it; prompt lookup reads the tokenizer only."""

    class Loaded(Exception):
        pass

    def fake(what):
        def load(target, *args, **kw):
            raise Loaded(what)

        return load

    monkeypatch.setattr(api, "load_model", fake("model"))
    monkeypatch.setattr(api, "load_tokenizer", fake("tokenizer"))
    for draft, what in (("tree:self", "model"), ("designed:auto", "model"), ("lookup", "tokenizer")):
        with pytest.raises(Loaded, match=what):
            api.load(str(q41), draft, threads=1)
