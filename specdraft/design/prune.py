"""Structural pruning: a draft cut out of the target.

- Depth (:func:`depth_prune`): keep a subset of the target's layers at full width: the "shallow
  and wide" draft of the study this project follows.
- Width (:func:`width_prune`): also keep only the most important key/value head groups, query heads
  and FFN channels of each kept layer, for "deep and narrow" drafts of the same parameter count.
  Importance is measured on calibration tokens (:func:`importance`): for an FFN channel the mean
  magnitude of its contribution ``|silu(gate) * up| * ||w_down[:, j]||``, for a query head the mean
  norm of its output after ``o_proj``.

Both return a transformers model of the target's family (``LlamaForCausalLM``, or
``Gemma3ForCausalLM`` for Gemma 3 text, whose layers keep their sliding-window or global kind) with
fresh copies of the kept weights (the draft's own, trainable) and the target's embedding/tied head
(shared, frozen); :func:`param_count` counts the draft's own parameters.

At run time (no training), ``--draft prune:0,1,2,29`` is the target's own layers in its compact
runtime, Llama or Gemma 3 (:func:`drafter_from_spec`), and ``prune:0,17,head=16384`` also gives the
draft a smaller LM head: the rows of the ids most frequent in the training prompts' text
(:func:`prompt_head`). Gemma 3's tied 262k-row head is ~60% of its parameters and most of a shallow
draft's step; the subset keeps the output lossless (:mod:`specdraft.models.subset_head`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from specdraft.design.artifact import build_model
from specdraft.errors import SpecdraftError
from specdraft.models.gemma3 import GEMMA3_FAMILY
from specdraft.models.llama import LLAMA_FAMILY


def _check_target(target_model) -> None:
    if target_model.config.model_type not in LLAMA_FAMILY + GEMMA3_FAMILY:
        raise SpecdraftError(
            f"pruning needs a Llama-family or Gemma 3 target, not {target_model.config.model_type!r}"
        )


def _check_layers(layer_ids: list[int], n: int) -> None:
    if not layer_ids or any(not 0 <= i < n for i in layer_ids) or len(set(layer_ids)) != len(layer_ids):
        raise SpecdraftError(
            f"layer ids {layer_ids} invalid for a {n}-layer target (distinct, in 0..{n - 1})"
        )


def draft_config(
    target_model,
    layer_ids: list[int],
    *,
    kv_heads: int | None = None,
    q_per_kv: int | None = None,
    ffn: int | None = None,
):
    """The target's config with the draft's layers ``layer_ids`` (and width when given). A Gemma 3
    draft keeps its family and each kept layer's kind (sliding-window or global); any other draft
    is a Llama."""
    cfg = copy.deepcopy(target_model.config)
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    kv = G if kv_heads is None else kv_heads
    r = H // G if q_per_kv is None else q_per_kv
    if not 1 <= kv <= G or not 1 <= r <= H // G:
        raise SpecdraftError(f"width: need 1 <= kv_heads <= {G} and 1 <= q_per_kv <= {H // G}, got {kv}, {r}")
    if ffn is not None and not 1 <= ffn <= cfg.intermediate_size:
        raise SpecdraftError(f"width: need 1 <= ffn <= {cfg.intermediate_size}, got {ffn}")
    cfg.num_hidden_layers = len(layer_ids)
    cfg.num_key_value_heads = kv
    cfg.num_attention_heads = kv * r
    cfg.intermediate_size = ffn or cfg.intermediate_size
    if cfg.model_type in GEMMA3_FAMILY:
        cfg.layer_types = [cfg.layer_types[i] for i in layer_ids]
    else:
        cfg.architectures = ["LlamaForCausalLM"]
        cfg.model_type = "llama"
    return cfg


def depth_prune(target_model, layer_ids: list[int]):
    """A draft made of the target's layers ``layer_ids`` (in that order) at full width."""
    _check_target(target_model)
    _check_layers(layer_ids, target_model.config.num_hidden_layers)
    draft = build_model(draft_config(target_model, layer_ids), target_model)
    with torch.no_grad():
        for i, li in enumerate(layer_ids):
            draft.model.layers[i].load_state_dict(target_model.model.layers[li].state_dict())
        draft.model.norm.load_state_dict(target_model.model.norm.state_dict())
    return draft


@dataclass
class Importance:
    """Per-layer importance scores from calibration tokens.

    Attributes:
        heads: ``{layer: (H,)}`` mean output norm of each query head (after ``o_proj``).
        ffn: ``{layer: (I,)}`` mean contribution magnitude of each FFN channel.
    """

    heads: dict[int, torch.Tensor]
    ffn: dict[int, torch.Tensor]


@torch.no_grad()
def importance(target_model, sequences: list[torch.Tensor], layer_ids: list[int]) -> Importance:
    """Score heads and FFN channels of ``layer_ids`` on calibration ``sequences`` (token ids)."""
    cfg = target_model.config
    H = cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    heads = {li: torch.zeros(H) for li in layer_ids}
    ffn = {li: torch.zeros(cfg.intermediate_size) for li in layer_ids}
    count = [0]
    hooks = []
    for li in layer_ids:
        layer = target_model.model.layers[li]
        wo = layer.self_attn.o_proj.weight  # (C, H * D)
        wd_norm = layer.mlp.down_proj.weight.norm(dim=0)  # (I,)

        def attn_hook(mod, args, li=li, wo=wo):
            x = args[0]  # (B, T, H * D): the heads' outputs before o_proj
            per_head = x.view(*x.shape[:-1], H, D)
            # contrib: (B, T, H)
            contrib = torch.einsum("bthd,chd->bthc", per_head, wo.view(wo.shape[0], H, D)).norm(dim=-1)
            heads[li] += contrib.sum(dim=(0, 1)).float()

        def mlp_hook(mod, args, li=li, wd_norm=wd_norm):
            a = args[0]  # (B, T, I): silu(gate) * up
            ffn[li] += (a.abs().sum(dim=(0, 1)) * wd_norm).float()

        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(attn_hook))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(mlp_hook))
    try:
        for seq in sequences:
            target_model(seq.view(1, -1))
            count[0] += seq.numel()
    finally:
        for h in hooks:
            h.remove()
    n = max(count[0], 1)
    return Importance({k: v / n for k, v in heads.items()}, {k: v / n for k, v in ffn.items()})


def width_prune(
    target_model, layer_ids: list[int], scores: Importance, *, kv_heads: int, q_per_kv: int, ffn: int
):
    """A draft of the target's layers ``layer_ids``, each narrowed to its most important parts.

    Keeps, per layer, the ``kv_heads`` key/value groups with the largest summed query-head
    importance, the ``q_per_kv`` most important query heads inside each, and the ``ffn`` most
    important FFN channels (original order preserved); every other tensor of the layer (its norms,
    Gemma 3's QK-norms) is copied whole.
    """
    _check_target(target_model)
    _check_layers(layer_ids, target_model.config.num_hidden_layers)
    cfg = target_model.config
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    r_full = H // G
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    draft = build_model(
        draft_config(target_model, layer_ids, kv_heads=kv_heads, q_per_kv=q_per_kv, ffn=ffn),
        target_model,
    )

    def rows(heads: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(h * D, (h + 1) * D) for h in heads])

    with torch.no_grad():
        for i, li in enumerate(layer_ids):
            src, dst = target_model.model.layers[li], draft.model.layers[i]
            hs = scores.heads[li].view(G, r_full)  # (G, r): query heads by group
            groups = sorted(hs.sum(1).topk(kv_heads).indices.tolist())
            q_heads = [
                g * r_full + int(j) for g in groups for j in sorted(hs[g].topk(q_per_kv).indices.tolist())
            ]
            q_rows, kv_rows = rows(q_heads), rows(groups)
            sa, da = src.self_attn, dst.self_attn
            da.q_proj.weight.copy_(sa.q_proj.weight[q_rows])
            da.k_proj.weight.copy_(sa.k_proj.weight[kv_rows])
            da.v_proj.weight.copy_(sa.v_proj.weight[kv_rows])
            da.o_proj.weight.copy_(sa.o_proj.weight[:, q_rows])
            for name in ("q_proj", "k_proj", "v_proj"):
                if getattr(getattr(sa, name), "bias", None) is not None:
                    raise SpecdraftError("width pruning of attention biases (Qwen2) is not supported")
            ch = scores.ffn[li].topk(ffn).indices.sort().values
            dst.mlp.gate_proj.weight.copy_(src.mlp.gate_proj.weight[ch])
            dst.mlp.up_proj.weight.copy_(src.mlp.up_proj.weight[ch])
            dst.mlp.down_proj.weight.copy_(src.mlp.down_proj.weight[:, ch])
            whole = dict(src.named_parameters())
            for name, p in dst.named_parameters():
                if name.split(".")[1] not in _PRUNED:
                    p.copy_(whole[name])
        draft.model.norm.load_state_dict(target_model.model.norm.state_dict())
    return draft


_PRUNED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def param_count(draft) -> int:
    """The draft's own parameters (shared embedding / head excluded)."""
    shared = {draft.get_input_embeddings().weight.data_ptr(), draft.get_output_embeddings().weight.data_ptr()}
    return sum(p.numel() for p in draft.parameters() if p.data_ptr() not in shared)


def layer_params(hidden: int, q_heads: int, kv_heads: int, head_dim: int, ffn: int) -> int:
    """Parameters of one decoder layer: q/o, k/v projections, gate/up/down, two norms."""
    return 2 * hidden * q_heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * ffn + 2 * hidden


def ffn_for_budget(target_model, depth: int, budget: int, *, kv_heads: int, q_per_kv: int) -> int:
    """The FFN width that makes a ``depth``-layer draft with these heads have about ``budget`` parameters."""
    cfg = target_model.config
    C = cfg.hidden_size
    D = getattr(cfg, "head_dim", None) or C // cfg.num_attention_heads
    per_layer = budget / depth - C  # minus the final norm, spread
    attn = layer_params(C, kv_heads * q_per_kv, kv_heads, D, 0)
    ffn = round((per_layer - attn) / (3 * C))
    if ffn < 1:
        raise SpecdraftError(
            f"a {depth}-layer draft with these heads exceeds {budget} parameters before any FFN"
        )
    return min(ffn, cfg.intermediate_size)


HEAD_PROMPTS = 4096
"""Training prompts whose tokens :func:`prompt_head` counts."""


def prompt_head(tokenizer, n: int, vocab_size: int, always: tuple[int, ...] = ()):
    """The ``n`` ids most frequent in the text of :data:`HEAD_PROMPTS` training prompts (GSM8K
    questions and HellaSwag contexts, the train split of :func:`specdraft.design.data.training_prompts`;
    Spec-Bench is never read), plus ``always`` (end-of-sequence ids): a head chosen without running
    the target. A designed draft counts the target's own answers instead (:mod:`specdraft.design.vocab`).
    Ids never seen fill the rest, lowest id first (Gemma 3's tokenizer: 13,894 distinct ids in
    those prompts, so ``head=16384`` holds all of them).

    Returns:
        A :class:`specdraft.design.vocab.VocabSubset` (coverage measured on those prompts).
    """
    from specdraft.design.data import training_prompts
    from specdraft.design.vocab import token_counts, top_tokens

    texts = training_prompts(HEAD_PROMPTS, "train", sources=("gsm8k", "hellaswag"))
    ids = [t for seq in tokenizer(texts, add_special_tokens=False)["input_ids"] for t in seq]
    return top_tokens(token_counts(torch.tensor(ids, dtype=torch.int64), vocab_size), n, always)


def drafter_from_spec(spec, target):
    """``prune:LAYERS[,head=N]``: the target's layers ``LAYERS`` at full width in its compact
    runtime (:func:`specdraft.drafters.model.pruned_from_spec`), with the head cut to the
    :func:`prompt_head` subset of N ids when ``head=N`` is given (:func:`with_head`)."""
    from specdraft.drafters.model import pruned_from_spec

    drafter = pruned_from_spec(spec, target)
    V = drafter.runtime.vocab_size
    if spec.head is None or spec.head >= V:
        return drafter
    head = prompt_head(target.loaded.tokenizer, spec.head, V, target.loaded.eos_ids())
    return with_head(drafter, head.token_ids)


def with_head(drafter, token_ids: torch.Tensor):
    """A layer-pruned ``drafter`` whose LM head scores only ``token_ids`` (``(N,)`` ids): new
    weights sharing every tensor but the head's N rows, the target's weights unchanged (on the
    quantized runtime: the head's N rows of blocks)."""
    from specdraft.drafters.model import ModelDrafter
    from specdraft.models.llama import pack_int8
    from specdraft.models.quant import QuantRuntime
    from specdraft.models.runtime import compact_runtime
    from specdraft.models.subset_head import SubsetHeadRuntime

    rt = drafter.runtime
    if isinstance(rt, QuantRuntime):
        w = replace(rt.w, head=rt.w.head.take_rows(token_ids))
        return ModelDrafter(
            SubsetHeadRuntime(QuantRuntime(w, rt.variant), token_ids, rt.vocab_size), drafter.name
        )
    head = rt.w.lm_head[token_ids].contiguous()  # (N, C)
    w = replace(rt.w, lm_head=head, q_head=None if rt.w.q_head is None else pack_int8(head))
    sub = SubsetHeadRuntime(compact_runtime(w, rt.layer_ids), token_ids, rt.vocab_size)
    return ModelDrafter(sub, drafter.name)
