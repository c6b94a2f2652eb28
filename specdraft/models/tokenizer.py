"""A saved tokenizer read with the ``tokenizers`` library alone, for a fast start.

``transformers`` takes about a second to import and half a second to build a
``PreTrainedTokenizerFast`` from a saved ``tokenizer.json``; the quantized runtime
(:mod:`specdraft.models.quant`) needs nothing else from it. :class:`FastTokenizer` reads the same
files (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) with ``tokenizers``
and renders chat templates with ``jinja2`` in the sandbox transformers uses, and gives the same
ids and text as ``PreTrainedTokenizerFast.from_pretrained`` on that directory for what specdraft
calls: ``tok(text)``, ``encode``, ``decode``, ``apply_chat_template`` over plain
``{"role", "content"}`` messages, ``len``, ``get_vocab`` and the special tokens
(``tests/models/test_tokenizer.py`` compares them). Anything else (``save_pretrained``, messages
with tool calls or reasoning fields, ...) goes to that transformers tokenizer, built on first use.

:func:`supports` says whether a directory's settings are ones this class reproduces; the loader
(:func:`specdraft.models.loading.load_tokenizer`) uses transformers for the others.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from specdraft.errors import SpecdraftError

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing PreTrainedTokenizerFast does with tokenizer.json
# for the calls above (others, such as add_bos_token or add_prefix_space, make it rewrite the
# post-processor or pre-tokenizer: those directories load through transformers)
_NEUTRAL = {
    *SPECIAL,
    "backend",
    "tokenizer_class",
    "is_local",
    "local_files_only",
    "model_max_length",
    "added_tokens_decoder",
    "chat_template",
    "padding_side",
    "truncation_side",
    "model_input_names",
    "extra_special_tokens",
    "additional_special_tokens",
    "clean_up_tokenization_spaces",  # only when false (supports checks)
}
_PLAIN_MESSAGE = {"role", "content", "name"}


def _config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def supports(directory: str | Path) -> bool:
    """Whether ``directory`` holds a ``tokenizer.json`` whose settings :class:`FastTokenizer`
    reproduces exactly (else the caller loads it with transformers)."""
    directory = Path(directory)
    try:
        config = _config(directory)
    except (OSError, ValueError):
        return False
    return (
        (directory / "tokenizer.json").is_file()
        and isinstance(config, dict)
        and set(config) <= _NEUTRAL
        and not config.get("clean_up_tokenization_spaces", False)
    )


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class FastTokenizer:
    """A saved fast tokenizer read with ``tokenizers`` (see the module docstring).

    Args:
        directory: a directory as ``save_pretrained`` writes it, with ``tokenizer.json``.

    Raises:
        SpecdraftError: ``tokenizer.json`` or ``tokenizer_config.json`` cannot be read.
    """

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        try:
            self._tok = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
            config = _config(self.directory)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SpecdraftError(f"cannot load the tokenizer in {self.directory}: {why}") from None
        self._tok.no_truncation()  # as PreTrainedTokenizerFast without truncation / padding asked
        self._tok.no_padding()
        self.special_tokens_map = {k: _token_text(config[k]) for k in SPECIAL if config.get(k) is not None}
        template = self.directory / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else config.get("chat_template")

    def __getattr__(self, name: str):
        # only reached for names this class does not define: transformers' tokenizer answers
        if name.startswith("_") or name == "hf":
            raise AttributeError(name)
        return getattr(self.hf, name)

    @cached_property
    def hf(self):
        """The transformers tokenizer over the same files (imports transformers: about a second)."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(self.directory, local_files_only=True)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    # Each call below takes the options specdraft uses; any other option (truncation, tensors,
    # ...) is transformers' to interpret.

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs:
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs) -> dict:
        """``{"input_ids": ids}`` for a string, or a list of id lists for a list of strings."""
        if kwargs:
            return self.hf(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        encodings = self._tok.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]  # ints, tensors, arrays
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True, **kwargs
    ):
        """The chat template over ``messages``: text, or ``{"input_ids": ids}`` (``tokenize``) as
        transformers returns; messages other than plain role/content strings and any other option
        go to transformers."""
        plain = all(
            isinstance(m, dict) and set(m) <= _PLAIN_MESSAGE and all(isinstance(v, str) for v in m.values())
            for m in messages
        )
        compiled = _compiled(self.chat_template) if plain and messages and not kwargs else None
        if compiled is None:  # no template (transformers says so), or one using its extensions
            return self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
            )
        text = compiled.render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )
        return {"input_ids": self.encode(text, add_special_tokens=False)} if tokenize else text


_TEMPLATES: dict = {}


def _compiled(template: str | None):
    """``template`` compiled in a sandbox set up as transformers sets up its own
    (``transformers.utils.chat_template_utils``): trim and lstrip blocks, loop controls, a
    ``tojson`` that does not escape HTML, ``raise_exception`` and ``strftime_now``. None for no
    template, or one that needs transformers' own extensions (``{% generation %}``)."""
    if template and template not in _TEMPLATES:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            _TEMPLATES[template] = env.from_string(template)
        except jinja2.TemplateSyntaxError:
            _TEMPLATES[template] = None
    return _TEMPLATES.get(template)
