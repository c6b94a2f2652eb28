"""Models: loading (aliases, transformers directories, GGUF), tiny test models, Llama-family forward."""

from specdraft.models.loading import (
    ALIASES,
    DEFAULT_TARGET,
    LoadedModel,
    ModelRef,
    cache_root,
    load_model,
    resolve_model_path,
)
from specdraft.models.tiny import tiny_llama, tiny_tokenizer

__all__ = [
    "ALIASES",
    "DEFAULT_TARGET",
    "LoadedModel",
    "ModelRef",
    "cache_root",
    "load_model",
    "resolve_model_path",
    "tiny_llama",
    "tiny_tokenizer",
]
