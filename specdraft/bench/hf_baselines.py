"""transformers ``generate`` baselines for ``specdraft bench --baselines hf``.

Three ways transformers decodes the same target, on the same prompts, dtype and thread count:

- ``hf_plain``: ``model.generate`` greedy (or sampling), no assistant.
- ``hf_assisted``: assisted generation with the same draft as ``assistant_model``. A draft that is
  a standalone model is passed as is; a ``prune:...`` self-draft is rebuilt as a transformers
  ``LlamaForCausalLM`` holding only those layers (plus the target's embedding, final norm and LM
  head), since transformers cannot run a subset of a model's layers; a ``designed:`` draft is
  loaded as the ``LlamaForCausalLM`` it is (with the full LM head); ``self`` passes the target.
  Drafts without a model (``lookup``, ``none``) and feature-conditioned designed drafts (they read
  the target's hidden state) have no assisted baseline. The assistant runs in the target's
  dtype: an int8 specdraft draft is compared with its float transformers counterpart.
- ``hf_prompt_lookup``: transformers' prompt lookup decoding (``prompt_lookup_num_tokens``).

With a fixed k, the assistant drafts exactly k tokens per step (schedule ``constant``, no
confidence early stop) and prompt lookup proposes up to k; with ``--k auto``/``heuristic``
transformers keeps its own defaults (heuristic schedule starting at 20 tokens, confidence
threshold 0.4; 10 lookup tokens).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from specdraft.api import Pipeline
from specdraft.errors import SpecdraftError
from specdraft.models.loading import load_model
from specdraft.registry import DraftSpec
from specdraft.verify import SamplingParams

HF_METHODS = ("hf_plain", "hf_assisted", "hf_prompt_lookup")


def pruned_hf_model(model, layers: list[int]):
    """A transformers Llama with only ``layers`` of ``model`` (copied), for assisted generation.

    Args:
        model: a transformers Llama-family causal LM (the target).
        layers: the target's layer indices to keep, in order (repeats allowed).

    Returns:
        A model of the same class and dtype with ``num_hidden_layers = len(layers)``; layer j is a
        copy of the target's layer ``layers[j]``; embedding, final norm and LM head are copied too.
    """
    n = model.config.num_hidden_layers
    if not layers or any(not 0 <= i < n for i in layers):
        raise SpecdraftError(f"layer ids {layers} invalid for a {n}-layer model")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    dtype = next(model.parameters()).dtype
    small = type(model)(cfg).to(dtype).eval()
    small.requires_grad_(False)
    source = model.state_dict()
    state = {}
    for name in small.state_dict():
        if name.startswith("model.layers."):
            j, rest = name[len("model.layers.") :].split(".", 1)
            state[name] = source[f"model.layers.{layers[int(j)]}.{rest}"]
        else:
            state[name] = source[name]
    small.load_state_dict(state)
    small.generation_config = copy.deepcopy(model.generation_config)
    return small


def _designed_assistant(spec: DraftSpec, pipe: Pipeline):
    """A designed draft as a transformers model (full LM head), or None with the reason."""
    from specdraft.design.artifact import find_draft, load_draft, read_meta

    path = find_draft(spec.arg, pipe.target.model)
    if path is None:
        return (
            None,
            (
                f"{spec}: no designed draft for this target (prompt lookup is used; transformers' prompt "
                "lookup is the matching baseline)"
            ),
        )
    meta = read_meta(path)
    if meta.kind != "layers":
        return (
            None,
            (
                f"{spec} is a {meta.kind}-conditioned draft: transformers' assisted generation cannot feed "
                "it the target's hidden state"
            ),
        )
    dtype = next(pipe.target.model.parameters()).dtype
    model, _, _ = load_draft(path, pipe.target.model, dtype)
    head = " with its full LM head (the head subset is a specdraft option)" if meta.head_tokens else ""
    return (
        model,
        f"designed draft {path.name} as a LlamaForCausalLM{head}, {str(dtype).replace('torch.', '')}",
    )


@dataclass
class HFBaselines:
    """The transformers models and settings for the three baselines of one target.

    Attributes:
        model: the target as a transformers model (the same weights the engine runs).
        eos_ids: stop tokens, the engine's.
        k: draft length for assisted generation and prompt lookup; None keeps transformers' defaults.
        assistant: the assistant model, or None when the draft has none.
        assistant_note: how the assistant was built, or why there is none.
        lookup_ngram: ``max_matching_ngram_size`` for prompt lookup.
    """

    model: object
    eos_ids: tuple[int, ...]
    k: int | None
    assistant: object | None
    assistant_note: str
    lookup_ngram: int = 3
    methods: tuple[str, ...] = field(default=HF_METHODS)

    def _generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams, **extra) -> list[int]:
        input_ids = torch.tensor([ids])
        kwargs = {
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": max_new_tokens,
            "eos_token_id": list(self.eos_ids) or None,
            "pad_token_id": self.eos_ids[0] if self.eos_ids else None,
        }
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            kwargs.update(
                do_sample=True, temperature=params.temperature, top_k=params.top_k or 0, top_p=params.top_p
            )
            if params.seed is not None:
                torch.manual_seed(params.seed)
        with torch.inference_mode():
            out = self.model.generate(input_ids, **kwargs, **extra)
        return out[0, len(ids) :].tolist()

    def run(self, method: str, ids: list[int], max_new_tokens: int, params: SamplingParams) -> list[int]:
        """Decode one prompt with ``method`` (one of :data:`HF_METHODS`); returns the new tokens."""
        if method == "hf_plain":
            return self._generate(ids, max_new_tokens, params)
        if method == "hf_assisted":
            if self.assistant is None:
                raise SpecdraftError(f"no assisted baseline: {self.assistant_note}")
            return self._generate(ids, max_new_tokens, params, assistant_model=self.assistant)
        if method == "hf_prompt_lookup":
            return self._generate(
                ids,
                max_new_tokens,
                params,
                prompt_lookup_num_tokens=self.k or 10,
                max_matching_ngram_size=self.lookup_ngram,
            )
        raise ValueError(f"unknown baseline {method!r}")


def build_hf_baselines(pipe: Pipeline, k: int | None) -> HFBaselines:
    """Prepare the transformers baselines for a pipeline's target and draft (module docstring).

    Args:
        pipe: the loaded pipeline; its draft spec decides the assistant.
        k: fixed draft length, or None for transformers' adaptive defaults.
    """
    model = pipe.target.model
    spec = DraftSpec.parse(pipe.draft_spec)
    lookup_ngram = 3
    assistant, note = None, ""
    if spec.kind == "none":
        note = "no draft (--draft none)"
    elif spec.kind == "lookup":
        note = f"draft {spec} is not a model (transformers' prompt lookup is the matching baseline)"
        lookup_ngram = int(spec.arg or lookup_ngram)
    elif spec.kind == "self":
        assistant, note = model, "the target itself"
    elif spec.kind == "designed":
        assistant, note = _designed_assistant(spec, pipe)
    elif spec.kind == "prune":
        layers = spec.layers
        assistant = pruned_hf_model(model, layers)
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        note = (
            f"a LlamaForCausalLM with the target's layers {layers} (num_hidden_layers={len(layers)}), "
            f"weights copied, {dtype}"
        )
    else:
        dtype = next(model.parameters()).dtype
        assistant, note = load_model(spec.arg, dtype).model, f"draft model {spec}"
    methods = tuple(m for m in HF_METHODS if m != "hf_assisted" or assistant is not None)
    if assistant is not None and k is not None:
        if assistant is model:  # do not change the target's own config: use a shallow copy
            assistant = copy.copy(model)
            assistant.generation_config = copy.deepcopy(model.generation_config)
        gc = assistant.generation_config
        gc.num_assistant_tokens = k
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0
    return HFBaselines(model, pipe.eos_ids, k, assistant, note, lookup_ngram, methods)
