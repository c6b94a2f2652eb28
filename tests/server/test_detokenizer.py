"""The server's detokenizer (:class:`specdraft.api.Detokenizer`): exact, and O(new tokens) per step."""

from __future__ import annotations

import random

import pytest

from specdraft.api import HOLD_MAX, Detokenizer
from specdraft.models.tiny import tiny_tokenizer

TEXT = ["Le café est très bon. 日本語のテキスト 🙂🚀 naïve façade — “quotes” αβγ"] * 20
TEXT += ["the quick brown fox jumps over the lazy dog"] * 20


def _trained(kind: str):
    """A small trained BPE: byte-level (GPT-2, SmolLM2) or metaspace (SentencePiece-like: decode
    drops the leading space of the first token), with multi-byte tokens that can split a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if kind == "byte-level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer, tok.decoder, alphabet = pre_tokenizers.Metaspace(), decoders.Metaspace(), []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], initial_alphabet=alphabet)
    tok.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


TOKENIZERS = {
    "tiny": tiny_tokenizer,
    "byte-level": lambda: _trained("byte-level"),
    "metaspace": lambda: _trained("metaspace"),
}


class CountingTokenizer:
    """Counts the tokens each ``decode`` call is given."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kw)


def _outputs(tok, n: int, seed: int) -> list[int]:
    """``n`` output tokens: real text's tokens, with random ids (special ones included) mixed in."""
    rng = random.Random(seed)
    real = tok("".join(TEXT))["input_ids"]
    return [rng.randrange(len(tok)) if rng.random() < 0.3 else real[i % len(real)] for i in range(n)]


def _steps(tokens: list[int], seed: int) -> list[list[int]]:
    """Split into steps of 1-4 tokens, as speculative steps emit."""
    rng, steps, i = random.Random(seed), [], 0
    while i < len(tokens):
        n = rng.randint(1, 4)
        steps.append(tokens[i : i + n])
        i += n
    return steps


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_equals_decoding_the_whole_output(name, seed):
    tok = TOKENIZERS[name]()
    tokens = _outputs(tok, 400, seed)
    d = Detokenizer(tok, [])
    steps = _steps(tokens, seed)
    parts = [d.push(s, i == len(steps) - 1)[0] for i, s in enumerate(steps)]
    assert "".join(parts) == tok.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_stop_strings_cut_before_the_earliest_one(name):
    tok = TOKENIZERS[name]()
    tokens = tok("the quick brown fox jumps over the lazy dog")["input_ids"]
    full = tok.decode(tokens, skip_special_tokens=True)
    for steps in ([tokens], [[t] for t in tokens]):  # both stop strings arrive in one step, or not
        # "lazy" is listed first but "jumps" comes first in the text
        d = Detokenizer(tok, ["lazy", "jumps", "never there"])
        parts, hit = [], False
        for step in steps:
            out, hit = d.push(step, False)
            parts.append(out)
            if hit:
                break
        assert hit and "".join(parts) == full[: full.find("jumps")]


def test_per_step_cost_does_not_grow_with_the_output():
    """2,000 output tokens: the last steps decode no more tokens than the first ones (decoding the
    whole output each step would decode ~20x more at the end)."""
    tok = CountingTokenizer(tiny_tokenizer())
    tokens = _outputs(tok.inner, 2000, 0)
    d = Detokenizer(tok, ["STOP!"])
    per_step, parts = [], []
    for i, t in enumerate(tokens):
        before = tok.decoded
        parts.append(d.push([t], i == len(tokens) - 1)[0])
        per_step.append(tok.decoded - before)
    assert "".join(parts) == tok.inner.decode(tokens, skip_special_tokens=True)
    first, last = sum(per_step[:100]), sum(per_step[-100:])
    assert last <= 2 * first, (first, last)
    assert max(per_step) <= 64, max(per_step)  # a window, not the output


@pytest.mark.parametrize("name", ["tiny", "byte-level"])
def test_a_run_of_invalid_bytes_is_released_as_it_goes(name):
    """A model that emits invalid UTF-8 for a while (a random one does): its text is held for at most
    HOLD_MAX tokens, not until a valid byte comes; the releases still add up exactly."""
    tok = TOKENIZERS[name]()
    text = tok("naïve café 🙂 ")["input_ids"]
    invalid = tok.convert_tokens_to_ids("À")  # byte 0xC0, never part of a UTF-8 character
    tokens = text + [invalid] * 200 + text
    d = Detokenizer(tok, [])
    parts = [d.push([t], i == len(tokens) - 1)[0] for i, t in enumerate(tokens)]
    assert "".join(parts) == tok.decode(tokens, skip_special_tokens=True)
    held = max(len(run) for run in "".join("x" if p else "." for p in parts).split("x"))
    assert held <= HOLD_MAX, held
