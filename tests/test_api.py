"""The Python API on the tiny model: load with every draft spec, generate, stream, stop strings,
detokenization, batches, and the errors a user can cause."""

import pytest
import torch

from specdraft import api
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.hf import HFRuntime
from specdraft.models.runtime import make_runtime
from specdraft.models.tiny import tiny_llama, tiny_tokenizer
from specdraft.verify import SamplingParams

PROMPT = "Speculative decoding, speculative decoding"


@pytest.fixture(scope="module")
def pipe():
    return api.load("tiny", draft="none", dtype="fp32")


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """A same-tokenizer draft (another seed) and a draft whose tokenizer has two extra tokens."""
    same = tmp_path_factory.mktemp("same-tokenizer")
    tiny_llama(seed=1).save_pretrained(same)
    tiny_tokenizer().save_pretrained(same)
    other = tmp_path_factory.mktemp("other-tokenizer")
    tok = tiny_tokenizer()
    tok.add_tokens(["<x>", "<y>"])
    tiny_llama(vocab_size=len(tok), seed=2).save_pretrained(other)
    tok.save_pretrained(other)
    return same, other


def reference(pipe, prompt=PROMPT, n=24, **kw):
    return pipe.generate(prompt, max_new_tokens=n, engine=pipe.engine(0), **kw)


@pytest.mark.parametrize(
    "spec,kind",
    [
        ("none", None),
        ("self", ModelDrafter),
        ("lookup", PromptLookupDrafter),
        ("lookup:2", PromptLookupDrafter),
        ("default", PromptLookupDrafter),
        ("prune:0", ModelDrafter),
        ("prune:1,0", ModelDrafter),
    ],
)
def test_draft_specs_build_and_stay_lossless(pipe, spec, kind):
    drafter = api.make_drafter(spec, pipe.target, pipe.runtime, torch.float32)
    assert (drafter is None) if kind is None else isinstance(drafter, kind)
    if spec == "lookup:2":
        assert drafter.max_ngram == 2
    p = api.Pipeline(pipe.target, pipe.runtime, drafter, spec)
    assert p.generate(PROMPT, max_new_tokens=24, k=3).tokens == reference(pipe).tokens


def test_independent_draft_model_from_a_directory(pipe, draft_dirs):
    same, _ = draft_dirs
    p = api.load("tiny", draft=str(same), dtype="fp32")
    assert isinstance(p.drafter, ModelDrafter) and p.drafter.name == str(same)
    res = p.generate(PROMPT, max_new_tokens=24, k=3)
    assert res.tokens == reference(pipe).tokens
    assert res.stats.drafted > 0


@pytest.mark.parametrize(
    "spec,match",
    [
        ("prune:a", "bad draft spec"),
        ("prune:7", "invalid"),
        ("lookup:0", "bad draft spec"),
        ("no-such-model", "unknown model"),
    ],
)
def test_bad_draft_specs(pipe, spec, match):
    with pytest.raises(SpecdraftError, match=match):
        api.make_drafter(spec, pipe.target, pipe.runtime, torch.float32)


def test_draft_with_another_tokenizer_is_refused(draft_dirs):
    _, other = draft_dirs
    with pytest.raises(SpecdraftError, match="different tokenizer"):
        api.load("tiny", draft=str(other), dtype="fp32")


def test_generate_result(pipe):
    spec = api.Pipeline(
        pipe.target, pipe.runtime, api.make_drafter("self", pipe.target, pipe.runtime, torch.float32)
    )
    res = spec.generate(PROMPT, max_new_tokens=20, k=4)
    ref = reference(pipe, n=20)
    assert res.tokens == ref.tokens and len(res.tokens) == 20 and res.finish_reason == "length"
    assert res.text == pipe.tokenizer.decode(res.tokens, skip_special_tokens=True)
    assert res.from_draft == [i % 5 != 4 for i in range(20)]  # 4 accepted + 1 bonus per step
    assert res.stats.mean_accepted_length == 5.0 and res.stats.generated == 20


def test_stream_pieces_add_up(pipe):
    deltas = list(pipe.stream(PROMPT, max_new_tokens=16, k=0))
    assert "".join(d.text for d in deltas) == reference(pipe, n=16).text
    assert sum(len(d.tokens) for d in deltas) == 16
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])


def test_eos_finishes_with_stop(pipe):
    tokens = reference(pipe, n=40).tokens
    eos = tokens[10]
    p = api.Pipeline(pipe.target, pipe.runtime, PromptLookupDrafter())
    p.target.model.generation_config.eos_token_id = eos  # eos_ids reads the generation config too
    try:
        assert eos in p.eos_ids
        res = p.generate(PROMPT, max_new_tokens=40, k=3)
    finally:
        p.target.model.generation_config.eos_token_id = 255
    assert res.tokens == tokens[: tokens.index(eos) + 1] and res.finish_reason == "stop"


def test_stop_string_cuts_the_text(pipe):
    ref = reference(pipe, n=40)
    text = ref.text
    # a stop string from the middle of the plain output, found at its first occurrence
    start = len(text) // 3
    stop = text[start : start + 3]
    cut = text.find(stop)
    assert cut > 0
    for k in (0, 4):
        res = pipe.generate(
            PROMPT,
            max_new_tokens=40,
            k=k,
            stop=[stop],
            engine=pipe.engine(k)
            if k == 0
            else api.Pipeline(
                pipe.target, pipe.runtime, api.make_drafter("self", pipe.target, pipe.runtime, torch.float32)
            ).engine(k),
        )
        assert res.text == text[:cut] and res.finish_reason == "stop"


def test_encode(pipe):
    assert pipe.encode("hi", chat=False) == list(b"hi")
    chat = pipe.encode("hi")
    assert pipe.tokenizer.decode(chat) == "<|user|>hi\n<|assistant|>"  # instruct models get the template
    assert pipe.encode([{"role": "user", "content": "hi"}]) == chat
    with pytest.raises(SpecdraftError, match="empty prompt"):
        pipe.encode("   ")
    assert pipe.eos_ids == (255,)


def test_run_batch_matches_single_prompts(pipe):
    prompts = [pipe.encode(t, chat=False) for t in ("a", "a longer prompt than the first", "middle one")]
    p = api.Pipeline(
        pipe.target, pipe.runtime, api.make_drafter("prune:0", pipe.target, pipe.runtime, torch.float32)
    )
    outs, stats = api.run_batch(p, prompts, max_new_tokens=12, k=3)
    assert outs == [reference(pipe, ids, 12).tokens for ids in prompts]
    assert stats.generated == 36


def test_seeded_generation_is_reproducible(pipe):
    p = api.Pipeline(
        pipe.target, pipe.runtime, api.make_drafter("prune:0", pipe.target, pipe.runtime, torch.float32)
    )
    params = SamplingParams(temperature=0.9, top_k=50, seed=3)
    a = p.generate(PROMPT, max_new_tokens=16, k=3, params=params).tokens
    assert p.generate(PROMPT, max_new_tokens=16, k=3, params=params).tokens == a
    assert (
        p.generate(
            PROMPT, max_new_tokens=16, k=3, params=SamplingParams(temperature=0.9, top_k=50, seed=4)
        ).tokens
        != a
    )


def test_detokenizer_holds_partial_characters_and_stop_prefixes():
    tok = tiny_tokenizer()
    d = api.Detokenizer(tok, [])
    e_acute = list("é".encode())  # two bytes, two tokens
    assert d.push(list(b"caf") + e_acute[:1], False) == ("", False)  # held while a character is half there
    assert d.push(e_acute[1:], False) == ("café", False)

    d = api.Detokenizer(tok, ["STOP"])
    assert d.push(list(b"abc S"), False) == ("ab", False)  # the last len("STOP") - 1 characters wait
    assert d.push(list(b"T"), False) == ("c", False)
    assert d.push(list(b"OP and more"), False) == (" ", True)  # stop string found across pushes

    d = api.Detokenizer(tok, ["zz"])
    assert d.push(list(b"xyz"), True) == ("xyz", False)  # final: nothing held back


def test_load_options(pipe):
    assert api.resolve_dtype("fp32") == torch.float32 and api.resolve_dtype("bf16") == torch.bfloat16
    assert api.resolve_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(SpecdraftError, match="unknown dtype"):
        api.resolve_dtype("fp8")
    with pytest.raises(SpecdraftError, match="threads"):
        api.set_threads(0)
    before = torch.get_num_threads()
    try:  # more threads than CPUs: capped (oversubscribed OpenMP threads spin at barriers)
        api.set_threads(api.usable_cpus() + 7)
        assert torch.get_num_threads() == api.usable_cpus()
    finally:
        torch.set_num_threads(before)
    hf = api.load("tiny", draft="lookup", dtype="fp32", runtime="hf")
    assert isinstance(hf.runtime, HFRuntime)
    assert hf.generate(PROMPT, max_new_tokens=12, k=3).tokens == reference(pipe, n=12).tokens
    with pytest.raises(SpecdraftError, match="Llama-family"):
        api.load("tiny", draft="prune:0", dtype="fp32", runtime="hf")
    with pytest.raises(SpecdraftError, match="unknown runtime"):
        make_runtime(pipe.target, "fast")


def test_int8_is_a_draft_precision_only(pipe):
    with pytest.raises(SpecdraftError, match="draft precision"):
        api.load("tiny", draft="none", dtype="int8")
    assert api.resolve_dtype("int8", draft=True) == torch.qint8
    assert api.resolve_dtype("auto", draft=True) in (torch.qint8, torch.bfloat16)


def test_auto_precision_follows_what_the_cpu_and_kernels_run_fast(monkeypatch):
    monkeypatch.setattr(api, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(api.kernels, "available", lambda: True)  # bf16 weights through the kernels
    assert api.resolve_dtype("auto") == api.resolve_dtype("auto", draft=True) == torch.bfloat16
    assert api.resolve_dtype("auto", runtime="hf") == torch.float32  # torch would emulate bf16
    monkeypatch.setattr(api.kernels, "available", lambda: False)
    assert api.resolve_dtype("auto") == torch.float32
    assert api.resolve_dtype("auto", draft=True) == torch.qint8
    monkeypatch.setattr(api, "cpu_has_fast_bf16", lambda: True)
    assert api.resolve_dtype("auto") == api.resolve_dtype("auto", draft=True) == torch.bfloat16


@pytest.mark.parametrize("spec", ["self", "prune:0", "prune:1,0"])
def test_int8_drafts_stay_lossless_and_do_not_touch_the_target(pipe, spec):
    drafter = api.make_drafter(spec, pipe.target, pipe.runtime, torch.qint8)
    assert drafter.runtime.w.precision == "int8" and pipe.runtime.w.precision == "fp32"
    p = api.Pipeline(pipe.target, pipe.runtime, drafter, spec)
    res = p.generate(PROMPT, max_new_tokens=24, k=3)
    assert res.tokens == reference(pipe).tokens
    if spec == "self":  # an int8 copy of the target still agrees with it most of the time
        assert res.stats.mean_accepted_length > 2.0
