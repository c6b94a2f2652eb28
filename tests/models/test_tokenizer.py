"""The cached tokenizer read with ``tokenizers`` alone (specdraft/models/tokenizer.py) gives the
same ids, text and chat-templated prompts as transformers' tokenizer over the same files, and the
quantized path's start imports no transformers (issue 15)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdraft.errors import SpecdraftError
from specdraft.models import loading
from specdraft.models.tiny import tiny_tokenizer
from specdraft.models.tokenizer import FastTokenizer, supports

# SmolLM2-135M-Instruct's template (its conversion cache's chat_template.jinja)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# transformers' sandbox additions: raise_exception, loop controls, tojson (no HTML escaping), namespace
OTHER_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('no tools') }}{% endif %}{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ bos_token }}{{ m['role'] | upper }}: {{ m['content'] | tojson }}\n"
    "{% endfor %}{{ ns.n }}{% if add_generation_prompt %}{{ eos_token }}ASSISTANT:{% endif %}"
)
STRINGS = [
    "hi",
    "Hello, world!  ",
    " leading space",
    "ünïcödé 日本語 🙂",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "a\n\n\tb  c",
    "<b>&amp;</b> \"quoted\" 'single'",
]
CHATS = [[{"role": "user", "content": s}] for s in STRINGS] + [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "skip"},
        {"role": "user", "content": "And 3 + 3?"},
    ]
]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE with merges and SmolLM2's special tokens, trained on a few lines."""
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([s * 3 for s in STRINGS] + ["speculative decoding drafts tokens"] * 4, trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    out.pad_token = "<|im_end|>"
    out.chat_template = SMOLLM2_TEMPLATE
    return out


def saved(tmp_path, kind: str, template: str | None = None):
    """The tokenizer ``kind`` saved as save_pretrained writes it; both loaders over that directory."""
    tok = tiny_tokenizer() if kind == "tiny" else bpe_tokenizer()
    if template:
        tok.chat_template = template
    d = tmp_path / kind
    tok.save_pretrained(d)
    assert supports(d)
    return FastTokenizer(d), PreTrainedTokenizerFast.from_pretrained(d, local_files_only=True)


@pytest.mark.parametrize("kind", ["tiny", "bpe"])
@pytest.mark.parametrize("template", [None, SMOLLM2_TEMPLATE, OTHER_TEMPLATE])
def test_same_ids_text_and_chat_prompts_as_transformers(tmp_path, kind, template):
    fast, hf = saved(tmp_path, kind, template)
    assert "hf" not in fast.__dict__  # nothing below needs transformers' tokenizer
    for s in STRINGS:
        for special in (True, False):
            assert (
                fast(s, add_special_tokens=special)["input_ids"]
                == hf(s, add_special_tokens=special)["input_ids"]
            )
        ids = hf(s)["input_ids"] + [hf.eos_token_id]
        assert fast.encode(s) == hf.encode(s)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert fast(STRINGS)["input_ids"] == hf(STRINGS)["input_ids"]
    for chat in CHATS:
        for gen in (True, False):
            text = fast.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            ids = fast.apply_chat_template(chat, add_generation_prompt=gen)["input_ids"]
            assert ids == hf.apply_chat_template(chat, add_generation_prompt=gen)["input_ids"]
    assert len(fast) == len(hf) and fast.get_vocab() == hf.get_vocab()
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert (fast.eos_token, fast.pad_token, fast.chat_template) == (
        hf.eos_token,
        hf.pad_token,
        hf.chat_template,
    )
    assert "hf" not in fast.__dict__


def test_what_it_does_not_reproduce_goes_to_transformers(tmp_path):
    """Messages beyond role/content strings, a template using transformers' own tags, and other
    attributes are answered by transformers' tokenizer over the same files."""
    fast, hf = saved(tmp_path, "bpe", SMOLLM2_TEMPLATE)
    chat = [{"role": "user", "content": "hi", "tool_calls": []}]
    assert fast.apply_chat_template(chat, tokenize=False) == hf.apply_chat_template(chat, tokenize=False)
    assert fast.all_special_ids == hf.all_special_ids
    kwargs, text = {"truncation": True, "max_length": 3}, "zebra quokka 42"  # not trained: many tokens
    assert fast(text, **kwargs)["input_ids"] == hf(text, **kwargs)["input_ids"]
    assert fast.encode(text, **kwargs) == hf.encode(text, **kwargs) and len(fast.encode(text)) > 3
    assert fast.decode([5, 6], clean_up_tokenization_spaces=True) == hf.decode(
        [5, 6], clean_up_tokenization_spaces=True
    )
    with pytest.raises(Exception, match="no tools"):  # raise_exception, either way
        saved(tmp_path / "o", "bpe", OTHER_TEMPLATE)[0].apply_chat_template(
            [{"role": "tool", "content": "x"}]
        )
    tagged = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    fast, hf = saved(tmp_path / "g", "bpe", tagged)
    assert fast.apply_chat_template(CHATS[-1], tokenize=False) == hf.apply_chat_template(
        CHATS[-1], tokenize=False
    )


def test_settings_it_does_not_reproduce_load_through_transformers(tmp_path):
    """A tokenizer_config.json with settings that make transformers rewrite the tokenizer (here
    add_bos_token) is loaded by transformers; a broken tokenizer.json is one error line."""
    d = tmp_path / "m"
    bpe_tokenizer().save_pretrained(d)
    (d / "config.json").write_text("{}")
    assert isinstance(loading.load_tokenizer(str(d)).tokenizer, FastTokenizer)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert not supports(d)
    hf = loading.load_tokenizer(str(d)).tokenizer
    assert isinstance(hf, PreTrainedTokenizerFast) and not isinstance(hf, FastTokenizer)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text()[:5000])
    with pytest.raises(SpecdraftError, match="cannot load the tokenizer") as e:
        loading.load_tokenizer(str(d))
    assert "\n" not in str(e.value)


def test_a_cached_tokenizer_damaged_behind_its_marker_is_one_error_line(tmp_path, monkeypatch):
    """A conversion cache entry whose tokenizer.json no longer parses although its marker says it
    is intact (size and mtime as recorded): one SpecdraftError line, no traceback, no conversion."""
    from tests.models.test_quant import TYPES, fake_conversion_cache, write_tiny_gguf

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TYPES["Q8_0"])
    cache = fake_conversion_cache(path)
    f = cache / "tokenizer.json"
    st = f.stat()
    f.write_bytes(b"{" + f.read_bytes()[1:-1] + b"{")  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(loading, "load_model", lambda *a: pytest.fail("load_model called"))
    with pytest.raises(SpecdraftError, match="cannot load the tokenizer") as e:
        loading.load_tokenizer(str(path))
    assert "\n" not in str(e.value)


QUANT_START = r"""
import sys
from specdraft import api
pipe = api.load(sys.argv[1], "lookup", dtype="q", threads=1)
out = pipe.generate([5, 6, 7, 8, 5, 6, 7], max_new_tokens=4, k=2)  # ids: the tiny GGUF has 96
print(type(pipe.tokenizer).__name__, len(out.tokens), pipe.encode("hi"), repr(out.text))
heavy = sorted(m for m in ("transformers", "huggingface_hub", "safetensors") if m in sys.modules)
print("imported:", heavy)
"""


def test_quantized_start_imports_no_transformers(tmp_path, monkeypatch):
    """``api.load(..., dtype="q")`` and a generation from a warm cache: the tokenizer comes from
    the cached files through ``tokenizers``, and transformers is never imported (about a second
    of start time)."""
    from tests.models.test_quant import TYPES, fake_conversion_cache, write_tiny_gguf

    kernels = loading.cache_root() / "kernels"  # built already: not again in the child (a minute)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TYPES["Q4_1"])
    fake_conversion_cache(path)
    out = subprocess.run(
        [sys.executable, "-c", QUANT_START, str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    name, n, rest = out.stdout.splitlines()[0].split(maxsplit=2)
    assert name == "FastTokenizer" and int(n) == 4
    chat = [{"role": "user", "content": "hi"}]
    ids = tiny_tokenizer().apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert rest.startswith(str(ids) + " ")
    assert out.stdout.splitlines()[1] == "imported: []"
