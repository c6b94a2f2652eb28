"""The model runtime protocol: the only thing the decoding loop knows about a model.

A runtime owns weights; a :class:`KVState` owns one batch's cache. The loop calls

    out = runtime.forward(state, tokens, positions)        # tokens, positions: (B, T)

which writes the new keys/values at ``positions`` and returns logits for every input position.
Rollback is free: a cache entry at position p is only ever read by queries at positions >= p, and
every position a later query can see is rewritten before it is read. So the loop never copies the
cache; it simply feeds the next tokens at the positions it wants to (re)write.

Two implementations live in this package: :class:`specdraft.models.llama.LlamaRuntime`, a compact
Llama-family forward with a preallocated position-indexed cache (batch >= 1, ragged rows), and
:class:`specdraft.models.hf.HFRuntime`, an adapter over any transformers causal LM (batch 1,
cache cropping). :class:`specdraft.models.gemma3.Gemma3Runtime` is the compact runtime with Gemma 3's
layer. :class:`specdraft.models.quant.QuantRuntime` runs a GGUF's quantized blocks.
:func:`make_runtime` picks the runtime for a loaded model, :func:`compact_runtime` the compact
runtime's class for a model's (or a layer subset's) weights, and :func:`compact_from_files` reads
a Gemma 3 model's compact weights from its files without a transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specdraft.errors import SpecdraftError


@dataclass
class ForwardOutput:
    """What a forward returns.

    Attributes:
        logits: ``(B, T, V)`` float logits, one row per input position (or per ``logits_index``).
        hidden: requested hidden states, ``{layer: (B, T, C)}``; layer ``i`` is the residual
            stream after decoder layer ``i`` (``-1``: after the final norm).
    """

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class KVState(Protocol):
    """One batch's cache. ``batch_size`` rows; rows can be selected (compacted) or appended."""

    batch_size: int

    def select_rows(self, rows: torch.Tensor) -> None: ...

    def append(self, other: KVState) -> None: ...


@runtime_checkable
class Runtime(Protocol):
    """A causal LM that the loop can drive.

    Attributes:
        vocab_size: number of logits per position.
        max_context: the largest position + 1 this model supports.
        dtype: compute dtype.
    """

    vocab_size: int
    max_context: int
    dtype: torch.dtype

    def new_state(self, batch_size: int, capacity: int) -> KVState:
        """A cache for ``batch_size`` rows that can hold positions ``< capacity``."""
        ...

    def forward(
        self,
        state: KVState,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        hidden_layers: tuple[int, ...] = (),
        attn_mask: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run the model over new tokens.

        Args:
            state: the batch's cache; keys/values of the new tokens are written at ``positions``.
            tokens: ``(B, T)`` token ids.
            positions: ``(B, T)`` absolute positions (RoPE and cache slot). Rows may differ
                (ragged batches); padding is right-padding at positions past the row's real tokens.
            hidden_layers: which layers' hidden states to return.
            attn_mask: optional ``(B, T, S)`` bool mask (True = may attend) over cache slots
                ``0..S-1``, replacing the default causal rule ``key_pos <= query_pos`` (tree
                verification).
            logits_index: optional ``(B, n)`` indices into T: compute logits only there.

        A runtime whose forward also takes ``lengths`` ``(B,)`` runs ragged steps (row b feeds only
        its first ``lengths[b]`` tokens; :class:`specdraft.models.quant.QuantRuntime`): the engine
        then feeds each row only its own draft tokens (:attr:`specdraft.engine.Engine.ragged`).
        """
        ...


def runs_compact(model_type: str) -> bool:
    """Whether the compact runtime serves this transformers ``model_type`` (the Llama family, in
    :mod:`specdraft.models.llama`, and Gemma 3 text, in :mod:`specdraft.models.gemma3`)."""
    from specdraft.models.gemma3 import GEMMA3_FAMILY
    from specdraft.models.llama import LLAMA_FAMILY

    return model_type in LLAMA_FAMILY or model_type in GEMMA3_FAMILY


def make_runtime(loaded, kind: str = "auto", dtype: torch.dtype | None = None) -> Runtime:
    """The compact runtime for the models it serves (:func:`runs_compact`), the transformers
    adapter otherwise.

    Args:
        loaded: a :class:`~specdraft.models.loading.LoadedModel`.
        kind: ``auto`` (compact where :func:`runs_compact`, else transformers), ``compact`` or ``hf``.
        dtype: overrides the loaded model's dtype for the compact runtime (``torch.qint8``: int8).
    """
    from specdraft.models.hf import HFRuntime  # imported here: it imports this module (ForwardOutput)

    model_type = loaded.model.config.model_type
    if kind == "compact" or (kind == "auto" and runs_compact(model_type)):
        return compact_runtime(compact_weights(loaded.model, dtype or next(loaded.model.parameters()).dtype))
    if dtype == torch.qint8:
        raise SpecdraftError(f"int8 needs the compact runtime (Llama family, Gemma 3), not {model_type!r}")
    if kind in ("auto", "hf"):
        return HFRuntime(loaded.model)
    raise SpecdraftError(f"unknown runtime {kind!r}: use auto, compact or hf")


def compact_weights(model, dtype: torch.dtype):
    """The compact-runtime weights of a transformers model: :class:`~specdraft.models.gemma3.Gemma3Weights`
    for Gemma 3 text, else :class:`~specdraft.models.llama.LlamaWeights` (``from_hf`` of either)."""
    # imported here: both runtimes import this module (ForwardOutput)
    from specdraft.models.gemma3 import GEMMA3_FAMILY, Gemma3Weights
    from specdraft.models.llama import LlamaWeights

    family = Gemma3Weights if model.config.model_type in GEMMA3_FAMILY else LlamaWeights
    return family.from_hf(model, dtype)


def compact_runtime(weights, layer_ids: list[int] | None = None) -> Runtime:
    """The compact runtime for ``weights`` over the layers ``layer_ids`` (all when None):
    :class:`~specdraft.models.gemma3.Gemma3Runtime` for :class:`~specdraft.models.gemma3.Gemma3Weights`,
    else :class:`~specdraft.models.llama.LlamaRuntime`. Every caller that builds a compact runtime
    from weights (a target, a layer-pruned draft, a profiling stand-in) goes through here."""
    from specdraft.models.gemma3 import Gemma3Runtime, Gemma3Weights
    from specdraft.models.llama import LlamaRuntime

    return (Gemma3Runtime if isinstance(weights, Gemma3Weights) else LlamaRuntime)(weights, layer_ids)


def compact_from_files(name_or_path: str, dtype: torch.dtype) -> Runtime | None:
    """A Gemma 3 target's compact runtime read straight from its weight files
    (:meth:`~specdraft.models.gemma3.Gemma3Weights.from_safetensors`): no transformers model and no
    float32 copy of the weights is built. None when the model is not Gemma 3 or its files are not
    there yet (a GGUF not converted: :func:`~specdraft.models.loading.load_model` converts it).

    Raises:
        SpecdraftError: the name resolves to nothing, or the files cannot be read.
    """
    import json

    from specdraft.models.gemma3 import GEMMA3_FAMILY, Gemma3Weights
    from specdraft.models.loading import weights_dir

    directory = weights_dir(name_or_path)
    if directory is None or not (directory / "model.safetensors").is_file():
        return None
    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise SpecdraftError(f"cannot read {directory / 'config.json'}: {e}") from None
    if model_type not in GEMMA3_FAMILY:
        return None
    return compact_runtime(Gemma3Weights.from_safetensors(directory, dtype))
