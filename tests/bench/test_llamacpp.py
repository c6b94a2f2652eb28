"""``specdraft bench --baselines llamacpp``: the error without llama-cpp-python, the JSON fields and
agreement figures (with a stand-in for llama.cpp), and a real run on the SmolLM2 GGUF when
llama-cpp-python is installed (``make peers``)."""

import importlib.util
import json
import sys

import pytest

from specdraft import api, cli
from specdraft.bench import llamacpp_baselines, runner
from specdraft.bench.harness import engine_method
from specdraft.bench.llamacpp_baselines import LLAMACPP_METHODS, agreement
from specdraft.bench.prompts import read_prompts
from specdraft.bench.runner import BenchOptions, markdown_table, run_bench
from specdraft.errors import SpecdraftError

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
FIELDS = [f"{m}_tokens_per_s" for m in LLAMACPP_METHODS] + [f"speedup_vs_{m}" for m in LLAMACPP_METHODS]


@pytest.fixture
def prompt_file(tmp_path):
    lines = [
        {"question_id": 1, "category": "writing", "turns": ["Write a poem about the sea.", "Shorter."]},
        {"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_agreement_counts_the_shared_prefix():
    assert agreement([1, 2, 3], [1, 2, 3]) == (3, None)
    assert agreement([1, 2, 3], [1, 9, 3]) == (1, 1)
    assert agreement([1, 2, 3], [1, 2]) == (2, 2)  # stopped early: differs where it stopped
    assert agreement([], []) == (0, None)


def test_without_llama_cpp_one_line_error(prompt_file, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("loaded a model before the check"))
    argv = ["bench", "--target", "tiny", "--draft", "prune:0", "--prompts", str(prompt_file)]
    assert cli.main([*argv, "--baselines", "hf,llamacpp", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "llama-cpp-python" in err and "make peers" in err


def test_unknown_baseline_names_both():
    with pytest.raises(SpecdraftError, match="hf, llamacpp"):
        BenchOptions(baselines=("vllm",), progress=False)


class FakeLlamaCpp:
    """Stands in for llama.cpp: ``llamacpp_plain`` answers with the engine's plain output,
    ``llamacpp_spec`` with it changed from its third token on."""

    methods = LLAMACPP_METHODS
    lookup_tokens = 4
    note = "fake llama.cpp"

    def __init__(self, pipe):
        self.pipe, self.n_ctx, self.calls = pipe, 0, []

    def load(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx

    def run(self, method, ids, max_new_tokens, params):
        self.calls.append(method)
        plain = engine_method("ref", self.pipe.runtime, eos_ids=self.pipe.eos_ids)
        out = plain.run(ids, max_new_tokens).tokens
        if method == "llamacpp_spec" and len(out) > 2:
            out = out[:2] + [(t + 1) % 256 for t in out[2:]]
        return out

    def forced_matches(self, ids, tokens):  # fed our output, the same model agrees everywhere
        self.calls.append("forced")
        return len(tokens)


def test_fields_and_agreement_with_a_stand_in(prompt_file, monkeypatch):
    pipe = api.load("tiny", "prune:0", dtype="fp32", draft_dtype="fp32", threads=1)
    fake = FakeLlamaCpp(pipe)
    monkeypatch.setattr(llamacpp_baselines, "require", lambda: None)
    monkeypatch.setattr(runner, "_llamacpp_baselines", lambda pipe, options: fake)
    options = BenchOptions(k=3, max_new_tokens=8, baselines=("llamacpp",), progress=False)
    result = run_bench(pipe, read_prompts(prompt_file), options, log=lambda msg: None)
    assert fake.n_ctx >= 8 + fake.lookup_tokens
    assert fake.calls.count("llamacpp_plain") == fake.calls.count("llamacpp_spec") == 1 + 3  # warm-up + turns
    assert fake.calls.count("forced") == 3  # every turn of every prompt, fed specdraft's output
    for summary in [result.overall, *result.categories.values()]:
        for key in FIELDS:
            assert summary[key] is not None and summary[key] > 0, key
    o = result.overall
    assert o["speedup_vs_llamacpp_plain"] == pytest.approx(
        o["tokens_per_s"] / o["llamacpp_plain_tokens_per_s"], rel=1e-3
    )
    assert o["llamacpp_plain_agreement"] == 1.0 and o["llamacpp_plain_identical"] == 2
    assert o["llamacpp_spec_identical"] == 0 and 0 < o["llamacpp_spec_agreement"] < 1
    assert o["llamacpp_forced_agreement"] == 1.0 and result.prompts[0]["llamacpp_forced_agreement"] == 1.0
    row = result.prompts[1]  # one turn: the spec stand-in differs from token 2 on
    assert row["llamacpp_plain_first_difference"] is None and row["llamacpp_spec_first_difference"] == 2
    assert row["llamacpp_spec_agreement"] == pytest.approx(2 / row["plain_new_tokens"])
    assert result.config["llamacpp"] == "fake llama.cpp"
    assert "llama.cpp plain tok/s" in markdown_table(result)


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (make peers)")
def test_real_llama_cpp_on_smollm2_gguf(tmp_path, prompt_file):
    out = tmp_path / "bench.json"
    with prompt_file.open("a") as f:  # past llama.cpp's 512-token batch: prefilled in two batches
        f.write(json.dumps({"prompt": "Repeat: " + "the sea is blue. " * 120, "category": "long"}) + "\n")
    argv = ["bench", "--target", "smollm2-135m", "--draft", "lookup", "--k", "3", "--dtype", "q"]
    argv += [
        "--prompts",
        str(prompt_file),
        "--categories",
        "qa,long",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
    ]
    assert cli.main([*argv, "--baselines", "llamacpp", "--no-progress", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    for summary in (d["overall"], d["categories"]["qa"]):
        for key in FIELDS:
            assert summary[key] is not None and summary[key] > 0, key
    row = d["prompts"][0]
    assert 1 <= row["llamacpp_plain_new_tokens"] <= 8 and 1 <= row["llamacpp_spec_new_tokens"] <= 8
    # the same Q4_1 blocks and the same token ids: a factual answer's first token is not a near-tie
    assert row["llamacpp_plain_shared_tokens"] >= 1
    assert 0.0 < d["overall"]["llamacpp_plain_agreement"] <= 1.0
    assert d["overall"]["llamacpp_forced_agreement"] >= 0.5  # fed our output: the same model
    assert "llama-cpp-python" in d["config"]["llamacpp"] and "SmolLM2" in d["config"]["llamacpp"]


def test_bf16_baseline_reports_agreement(prompt_file):
    """``--baselines bf16``: the target's bf16 runtime, plain, beside this one: its rate and its
    greedy agreement with this runtime's output (first difference per prompt)."""
    pipe = api.load("tiny", "lookup", dtype="fp32", threads=1)
    options = BenchOptions(k=3, max_new_tokens=8, baselines=("bf16",), progress=False)
    result = run_bench(pipe, read_prompts(prompt_file), options, log=lambda msg: None)
    o = result.overall
    assert o["bf16_plain_tokens_per_s"] > 0 and 0.0 <= o["bf16_plain_agreement"] <= 1.0
    assert o["bf16_plain_identical"] in (0, 1, 2)
    for row in result.prompts:
        first = row["bf16_plain_first_difference"]
        assert first is None or 0 <= first <= row["plain_new_tokens"]
    assert "bf16 plain tok/s" in markdown_table(result)


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (make peers)")
def test_llama_cpp_gets_our_ids_and_computes_the_same_model():
    """What the low free-running agreement is not: llama.cpp tokenizes the chat-templated text to the
    ids we feed (no BOS added, special tokens as ours), and teacher-forced, its argmax agrees with the
    quantized runtime's at most positions (both round the same Q4_1 model differently: one flipped
    near-tie and the free-running outputs part)."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    from specdraft.models.quant import gguf_path

    pipe = api.load("smollm2-135m", "none", dtype="q", threads=1)
    llm = Llama(
        model_path=str(gguf_path("smollm2-135m")), n_ctx=256, n_threads=1, logits_all=True, verbose=False
    )
    ids = pipe.encode("Who wrote Hamlet?")
    assert llm.tokenize(pipe.tokenizer.decode(ids).encode(), add_bos=False, special=True) == ids
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)]))  # (T, V)
    state = pipe.runtime.new_state(1, len(ids))
    ours = pipe.runtime.forward(state, torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0)).logits[0]
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_runtime_step_times_are_plain_greedy_decoding():
    """A runtime's prefill and one-token steps (bench_quant's decode-only rate): the tokens are plain
    greedy decoding's, one timed step per token after the first."""
    from tests.helpers import plain_greedy

    rt = api.load("tiny", "none", dtype="fp32", threads=1).runtime
    ids = [5, 6, 7, 8, 9, 10, 11]
    steps = llamacpp_baselines.runtime_step_times(rt, ids, 6)
    assert steps.tokens == plain_greedy(rt, ids, 6)
    assert steps.prompt_tokens == len(ids) and len(steps.decode_s) == 5
    assert steps.prefill_tokens_per_s > 0 and steps.decode_tokens_per_s > 0


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (make peers)")
def test_llama_cpp_step_times_are_its_greedy_decoding():
    """llama.cpp's decode-only rate is measured on its own greedy decoding of our ids: the tokens
    of the one-token ``eval`` loop are those its ``generate`` gives (same file, same ids)."""
    from specdraft.verify import SamplingParams

    pipe = api.load("smollm2-135m", "none", dtype="q", threads=1)
    lc = llamacpp_baselines.build_llamacpp_baselines("smollm2-135m", 1, (), None, "none")
    lc.load(128)
    ids = pipe.encode("Who wrote Hamlet?")
    steps = lc.step_times(ids, 8)
    assert steps.tokens == lc.run("llamacpp_plain", ids, 8, SamplingParams())
    assert steps.prompt_tokens == len(ids) and len(steps.decode_s) == 7 and steps.decode_tokens_per_s > 0
    with pytest.raises(SpecdraftError, match="n_ctx"):
        lc.step_times(ids, 128)
