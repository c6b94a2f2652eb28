"""Tiny random models and a byte-level tokenizer, so tests and demos run without real weights.

The tokenizer has exactly 256 ids, matching :func:`tiny_llama`'s default vocabulary: ids 0-253
are the bytes 0x00-0xFD of the UTF-8 text, and the ids of 0xFE and 0xFF, two bytes that never
occur in UTF-8, carry ``<bos>`` (254) and ``<eos>`` (255). Encoding adds no special tokens, so
``tokenizer.encode("hi") == list(b"hi")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported on first use: it takes seconds
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

BOS_ID = 254
EOS_ID = 255

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_llama(
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """An untrained Llama with random weights, the same for the same arguments.

    Args:
        vocab_size: vocabulary size V; 256 matches :func:`tiny_tokenizer`.
        hidden_size: model width C.
        num_layers: decoder layers.
        num_heads: query heads H (head dim is ``hidden_size // num_heads``).
        num_kv_heads: key/value heads G (grouped-query attention when G < H).
        intermediate_size: MLP width.
        max_position_embeddings: longest sequence the RoPE config announces.
        seed: seeds the initialisation; the global RNG state is left untouched.
        dtype: parameter dtype.

    Returns:
        The model in eval mode with gradients off.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=BOS_ID if vocab_size > BOS_ID else None,
        eos_token_id=EOS_ID if vocab_size > EOS_ID else None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype).eval()
    model.requires_grad_(False)
    return model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with 256 ids, ``<bos>``/``<eos>`` and a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    # ByteLevel maps each byte to a printable character; id b stands for byte b.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(BOS_ID)}
    assert set(vocab) <= set(ByteLevel.alphabet())
    vocab["<bos>"] = BOS_ID
    vocab["<eos>"] = EOS_ID

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")
    tokenizer.pad_token = "<eos>"
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer applies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
