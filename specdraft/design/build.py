"""The recipe behind ``specdraft design build``: data -> prune -> smaller head -> distil -> save.

:func:`build_draft` is what the command runs and what ``drafts/<name>/RECIPE.md`` records: the
command line, seed, data (sources, prompts, tokens), steps, and the time each phase took.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from specdraft import dtypes
from specdraft.bench import prompts as bench_prompts
from specdraft.bench.prompts import REPO_ROOT, data_file, is_shipped_slice
from specdraft.design.artifact import DraftMeta, save_draft, speculators_config, vocab_maps
from specdraft.design.data import SOURCE_FILES, SOURCES, TargetData, target_data, training_prompts
from specdraft.design.prune import depth_prune, importance, param_count, width_prune
from specdraft.design.train import (
    DraftLM,
    OnPolicyConfig,
    TrainConfig,
    train_offline,
    train_on_policy,
    validate,
)
from specdraft.design.vocab import VocabSubset, token_counts, top_tokens
from specdraft.errors import SpecdraftError
from specdraft.models.gemma3 import GEMMA3_FAMILY
from specdraft.models.llama import LLAMA_FAMILY


@dataclass
class BuildConfig:
    """What to build.

    Attributes:
        layers: target layers the draft starts from (its depth).
        head: head size N (0 = the full vocabulary).
        kv_heads / q_per_kv / ffn: width pruning (None = full width).
        prompts: training prompts answered by the target (data for distillation and head counts).
        val_prompts: held-out prompts for validation acceptance.
        max_new_tokens: answer length cap when generating data.
        gen_batch: rows decoded together when generating data.
        sources: prompt sources (:func:`~specdraft.design.data.training_prompts`).
        gen_dtype: ``same`` (the pipeline's runtime), ``bf16`` or ``fp32``: the target's weights when
            answering.
        train: offline distillation settings (``steps = 0``: no training, an untrained pruned draft).
        on_policy: on-policy settings (``rounds = 0``: none).
        dtype: storage dtype of the saved draft (``fp32`` or ``bf16``).
        kind: ``layers`` (token-level), ``feature`` (EAGLE-style, reads the target's hidden state) or
            ``dream`` (DREAM-style: also cross-attends to intermediate target layers,
            :mod:`specdraft.design.dream`), ``ctc`` (feature pairs plus slots decoded by CTC
            collapse, :mod:`specdraft.design.ctc`).
        feature_layers: the target layers a ``dream`` draft reads (None: low / mid / high,
            :func:`specdraft.design.dream.default_layers`).
        block: a ``diffusion`` draft's block size (the anchor included,
            :mod:`specdraft.design.diffusion`).
        window: the target features a ``diffusion`` block reads as context.
        init_from: a ``ctc``, ``dream`` or ``feature`` draft starts from this designed ``feature``
            draft (directory or name under ``drafts/``): its layers, ``fc`` and head subset (a ctc
            draft's slots and blank start new; a dream draft's cross-attention starts as the
            identity, so it starts as that feature draft); None: from the target's ``layers``.
        prompt_pairs: a ``feature`` draft reads this many prompt pairs before the answer's
            (:mod:`specdraft.design.feature`); its data then keeps the prompt's hidden states.
        second_weight: a ``feature`` draft also trains its second draft position, which reads its
            own predicted feature, with this weight (``FeatureDraftLM.second_weight``).
    """

    layers: list[int]
    head: int = 8192
    kv_heads: int | None = None
    q_per_kv: int | None = None
    ffn: int | None = None
    prompts: int = 512
    val_prompts: int = 48
    max_new_tokens: int = 160
    gen_batch: int = 32
    sources: tuple[str, ...] = SOURCES
    gen_dtype: str = "same"
    train: TrainConfig = field(default_factory=TrainConfig)
    on_policy: OnPolicyConfig = field(default_factory=lambda: OnPolicyConfig(rounds=0))
    dtype: str = "fp32"
    kind: str = "layers"
    feature_layers: list[int] | None = None
    block: int = 16
    window: int = 8
    init_from: str | None = None
    prompt_pairs: int = 0
    second_weight: float = 0.0


SELF_SOURCE = "requests the target wrote itself (Magpie-style, sampled from its chat template's user turn)"
TASKS_SOURCE = (
    "task instructions (summarize, translate, rewrite, list, read and answer; specdraft.design.data.TASKS) "
    "over the GSM8K and HellaSwag training texts"
)


def source_name(source: str) -> str:
    """What a recipe records for a prompt source: the file read, relative to the repository when
    it lies in it or in ``../shared/data`` (``../shared/data/gsm8k/train.jsonl``, as the committed
    drafts' recipes name it), marked when it is a shipped slice; or what ``self`` is."""
    if source == "self":
        return SELF_SOURCE
    if source == "tasks":
        return TASKS_SOURCE
    path = data_file(SOURCE_FILES[source]).absolute()  # not resolved: ../shared may be a link
    if path.is_relative_to(REPO_ROOT) or path.is_relative_to(bench_prompts.SHARED_DATA.absolute()):
        name = os.path.relpath(path, REPO_ROOT)
    else:
        name = str(path)
    if is_shipped_slice(path):
        name += " (the slice shipped with specdraft, specdraft/data/README.md)"
    return name


def head_subset(
    data: TargetData, n: int, vocab_size: int, eos_ids, prompt_counts: torch.Tensor | None = None
) -> VocabSubset | None:
    """The ``n`` tokens the target emits most often in ``data`` (EOS always in), ties broken by
    ``prompt_counts``; None for n = 0 (the full vocabulary)."""
    if n <= 0 or n >= vocab_size:
        return None
    return top_tokens(
        token_counts(data.response_tokens(), vocab_size), n, always=tuple(eos_ids), secondary=prompt_counts
    )


def prompt_token_counts(pipe, n_prompts: int = 4000) -> torch.Tensor:
    """``(V,)`` token counts over the first ``n_prompts`` training prompts (cheap: tokenizing only)."""
    texts = training_prompts(n_prompts)
    ids = pipe.tokenizer(texts, add_special_tokens=False)["input_ids"]
    return token_counts(torch.tensor([t for x in ids for t in x], dtype=torch.int64), pipe.runtime.vocab_size)


def make_draft(pipe, cfg: BuildConfig, calib: TargetData):
    """The untrained draft: depth-pruned, or width-pruned by importance on ``calib``."""
    model = pipe.target.model
    if cfg.kv_heads is None and cfg.q_per_kv is None and cfg.ffn is None:
        return depth_prune(model, cfg.layers)
    c = model.config
    scores = importance(model, calib.tokens[:8], cfg.layers)
    return width_prune(
        model,
        cfg.layers,
        scores,
        kv_heads=cfg.kv_heads or c.num_key_value_heads,
        q_per_kv=cfg.q_per_kv or c.num_attention_heads // c.num_key_value_heads,
        ffn=cfg.ffn or c.intermediate_size,
    )


def build_draft(
    pipe,
    cfg: BuildConfig,
    out: str | Path,
    *,
    work: str | Path | None = None,
    command: str | None = None,
    progress: bool = True,
    log=print,
) -> dict:
    """Build, train and save a designed draft; returns the recipe (also in ``specdraft.json``).

    Args:
        pipe: a pipeline holding the target.
        cfg: what to build.
        out: the draft directory to write.
        work: checkpoints (default ``<out>.work``); a rerun resumes from them.
        command: the command line to record (default ``sys.argv``).
    """
    model_type = pipe.target.model.config.model_type
    if model_type not in LLAMA_FAMILY and (model_type not in GEMMA3_FAMILY or cfg.kind != "layers"):
        raise SpecdraftError(
            f"--kind {cfg.kind} needs a Llama-family target (a Gemma 3 target takes --kind layers)"
        )
    if cfg.prompt_pairs < 0 or (cfg.prompt_pairs and cfg.kind != "feature"):
        raise SpecdraftError(f"--prompt-pairs {cfg.prompt_pairs}: a count >= 0, for --kind feature only")
    if cfg.second_weight < 0 or (cfg.second_weight and cfg.kind != "feature"):
        raise SpecdraftError(f"--second-weight {cfg.second_weight}: a weight >= 0, for --kind feature only")
    out = Path(out)
    work = Path(work) if work else out.with_name(out.name + ".work")
    times = {}
    t = time.perf_counter()
    data, val = _target_data(pipe, cfg, progress)
    times["data_s"] = round(time.perf_counter() - t, 1)
    log(
        f"data: {len(data)} answers, {data.num_response_tokens} tokens (validation {len(val)}, "
        f"{val.num_response_tokens}) in {times['data_s']:.0f} s"
    )

    V = pipe.runtime.vocab_size
    if cfg.init_from:
        model, head, draft = _warm_start(cfg, pipe)
    else:
        head = head_subset(data, cfg.head, V, pipe.eos_ids, prompt_token_counts(pipe))
        draft = None if cfg.kind == "flex" else make_draft(pipe, cfg, val)  # flex: the target's layers
        model = _draft_model(draft, cfg, head, pipe.target.model)
    if head:
        log(f"head: {len(head)} tokens cover {head.coverage:.1%} of the target's answer tokens")
    before = validate(model, val, cfg.train.max_len)
    start = f"from {cfg.init_from}" if cfg.init_from else "untrained"
    log(f"{start}: validation acceptance {before['alpha']:.3f}")

    result = _train(model, pipe, cfg, data, val, work, progress, times)
    after = validate(model, val, cfg.train.max_len)
    second = f", second position {after['alpha_2']:.3f}" if "alpha_2" in after else ""
    log(f"trained: validation acceptance {after['alpha']:.3f}{second}")
    if cfg.kind == "diffusion":
        from specdraft.design.diffusion import block_report

        after["blocks"] = block_report(model, val)
        log(f"trained: {after['blocks']['tokens_per_block']:.2f} tokens per block (teacher-forced)")
    if cfg.kind == "ctc":
        from specdraft.design.ctc import tree_report

        after["trees"] = tree_report(model, val)
        log(f"trained: {after['trees']['accepted_per_tree']:.2f} tokens per CTC tree (teacher-forced)")

    import transformers

    recipe = {
        "command": command or "specdraft " + " ".join(sys.argv[1:]),
        "seed": cfg.train.seed,
        "config": asdict(cfg),
        "data": {
            "sources": [source_name(s) for s in cfg.sources],
            "train_prompts": len(data),
            "train_tokens": data.num_response_tokens,
            "val_prompts": len(val),
            "val_tokens": val.num_response_tokens,
            "generation": f"target greedy, {_prompt_form(pipe)}, max {cfg.max_new_tokens} new tokens"
            + ("" if cfg.gen_dtype == "same" else f", {cfg.gen_dtype} weights"),
        },
        "time_s": {**times, "total_s": round(sum(times.values()), 1)},
        "threads": torch.get_num_threads(),
        "validation": {"untrained": before, "trained": after},
        "params": (param_count(draft) if draft is not None else 0)
        + sum(t.numel() for t in _extra_tensors(model, cfg.kind).values()),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        **result,
    }
    meta = DraftMeta.for_target(
        pipe.target.model,
        pipe.target.name,
        kind=cfg.kind,
        head=head,
        init_layers=list(cfg.layers),
        width=_width(cfg, draft),
        recipe=recipe,
        arch=_arch(model, cfg.kind),
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    extra = _extra_tensors(model, cfg.kind)
    if cfg.kind == "dream" and head:
        extra.update(vocab_maps(meta.head_tokens, meta.vocab_size))

    def add_files(d: Path) -> None:
        (d / "RECIPE.md").write_text(recipe_markdown(out.name, meta))
        if cfg.kind == "dream":
            spec = speculators_config(draft, meta, pipe.target.model)
            (d / "speculators_config.json").write_text(json.dumps(spec, indent=1))

    save_draft(out, draft, meta, dtype=dtype, extra=extra or None, add_files=add_files)
    log(f"saved {out} ({recipe['params'] / 1e6:.2f} M own parameters)")
    return recipe


def _prompt_form(pipe) -> str:
    """How the target read its training prompts: an instruct model through its chat template."""
    return "chat template" if pipe.target.is_chat() else "raw prompt text"


def _target_data(pipe, cfg: BuildConfig, progress: bool) -> tuple[TargetData, TargetData]:
    """The target's answers to the training and to the validation prompts (cached)."""
    kw = {
        "max_new_tokens": cfg.max_new_tokens,
        "batch_size": cfg.gen_batch,
        "hidden": True,
        "prompt_hidden": cfg.prompt_pairs > 0,
        "progress": progress,
        "sources": cfg.sources,
        "gen_dtype": dtypes.torch_dtype(cfg.gen_dtype),
    }
    data = target_data(pipe, n_prompts=cfg.prompts, **kw)
    val = target_data(pipe, n_prompts=cfg.val_prompts, split="val", **kw)
    return data, val


def _arch(model, kind: str) -> dict:
    """What a kind records beside the Llama config (``DraftMeta.arch``)."""
    if kind == "dream":
        return {"layers": model.layers, "heads": model.heads}
    if kind == "diffusion":
        return {"block": model.arch.block, "window": model.arch.window}
    if kind == "ctc":
        return {"slots": model.num_slots, "labels": model.labels}
    if kind == "flex":
        return model.arch
    if kind == "feature" and model.prompt_pairs:
        return {"prompt_pairs": model.prompt_pairs}
    return {}


def _warm_start(cfg: BuildConfig, pipe):
    """``(model, head, draft)`` of a ``ctc``, ``dream`` or ``feature`` draft started from the feature
    draft ``cfg.init_from``."""
    from specdraft.design.artifact import load_draft, resolve_draft_dir
    from specdraft.design.ctc import CTCDraftLM
    from specdraft.design.dream import DreamDraftLM
    from specdraft.design.feature import FeatureDraftLM

    if cfg.kind not in ("ctc", "dream", "feature"):
        raise SpecdraftError(
            "--init-from starts a ctc, dream or feature draft from a feature draft (give --kind)"
        )
    draft, meta, extra = load_draft(resolve_draft_dir(cfg.init_from), pipe.target.model)
    if meta.kind != "feature":
        raise SpecdraftError(f"--init-from {cfg.init_from}: a {meta.kind} draft, not a feature draft")
    draft.model.layers.requires_grad_(True)  # load_draft freezes it
    draft.model.norm.requires_grad_(True)
    ids = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
    head = VocabSubset(ids, meta.head_coverage or 0.0) if ids is not None else None
    if cfg.kind == "ctc":
        return CTCDraftLM(draft, ids, fc=extra["fc.weight"]), head, draft
    if cfg.kind == "dream":
        target = pipe.target.model
        return DreamDraftLM(draft, ids, target, cfg.feature_layers, fc=extra["fc.weight"]), head, draft
    model = FeatureDraftLM(
        draft, ids, fc=extra["fc.weight"], prompt_pairs=cfg.prompt_pairs, second_weight=cfg.second_weight
    )
    return model, head, draft


def _draft_model(draft, cfg: BuildConfig, head, target):
    """The trainable module around the draft: token-level, or conditioned on target features."""
    if cfg.kind == "diffusion":
        from specdraft.design.diffusion import DiffusionDraftLM
        from specdraft.drafters.diffusion import BlockArch

        return DiffusionDraftLM(draft, head.token_ids if head else None, BlockArch(cfg.block, cfg.window))
    if cfg.kind == "dream":
        from specdraft.design.dream import DreamDraftLM

        return DreamDraftLM(draft, head.token_ids if head else None, target, cfg.feature_layers)
    if cfg.kind == "ctc":
        from specdraft.design.ctc import CTCDraftLM

        return CTCDraftLM(draft, head.token_ids if head else None)
    if cfg.kind == "flex":  # split at the first of --layers, --block mask tokens per group
        from specdraft.design.flex import FlexDraftLM

        return FlexDraftLM(target, cfg.layers[0], cfg.block, head_tokens=head.token_ids if head else None)
    if cfg.kind == "feature":
        from specdraft.design.feature import FeatureDraftLM

        ids = head.token_ids if head else None
        return FeatureDraftLM(draft, ids, prompt_pairs=cfg.prompt_pairs, second_weight=cfg.second_weight)
    return DraftLM(draft, head.token_ids if head else None)


def _train(model, pipe, cfg: BuildConfig, data, val, work: Path, progress: bool, times: dict) -> dict:
    """Offline distillation, then on-policy rounds, as ``cfg`` asks; their results by stage. Their
    durations go to ``times`` (``train_s``, ``on_policy_s``)."""
    result = {}
    t = time.perf_counter()
    if cfg.train.steps > 0:
        res = train_offline(model, data, val, cfg.train, work, progress=progress)
        result["offline"] = {"steps": res.steps, "val": res.val, "history": res.history}
    times["train_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    if cfg.on_policy.rounds > 0 and cfg.kind != "layers":
        raise SpecdraftError("on-policy training is implemented for token-level drafts (kind layers) only")
    if cfg.on_policy.rounds > 0:
        texts = training_prompts(
            cfg.on_policy.first_prompt + cfg.on_policy.rounds * cfg.on_policy.prompts_per_round
        )
        prompts = [pipe.encode(x) for x in texts[cfg.on_policy.first_prompt :]]
        res = train_on_policy(
            model, pipe.runtime, prompts, cfg.on_policy, work, eos_ids=pipe.eos_ids, progress=progress
        )
        result["on_policy"] = {"rounds": res.steps, "history": res.history}
    times["on_policy_s"] = round(time.perf_counter() - t, 1)
    return result


def _extra_tensors(model, kind: str) -> dict:
    """The trained tensors outside the Llama: ``fc.weight`` (feature, dream), ``cross.*`` (dream),
    ``diffusion.*`` (diffusion), ``ctc.*`` (ctc) and ``flex.*`` (flex)."""
    if kind == "layers":
        return {}
    own = ("fc.weight", "cross.", "diffusion.", "ctc.", "flex.")
    return {k: v for k, v in model.own_state().items() if k.startswith(own)}


def _width(cfg: BuildConfig, draft) -> dict | None:
    """The draft's own widths when ``cfg`` narrows any (None: the target's)."""
    return (
        None
        if cfg.ffn is None and cfg.kv_heads is None and cfg.q_per_kv is None
        else {
            "kv_heads": draft.config.num_key_value_heads,
            "q_per_kv": draft.config.num_attention_heads // draft.config.num_key_value_heads,
            "ffn": draft.config.intermediate_size,
        }
    )


def _layers_text(meta: DraftMeta) -> str:
    if meta.kind == "flex":  # no layers of its own: attention projectors over the target's layers
        return (
            f"a FlexDraft split at target layer {meta.init_layers[0]} (its mask tokens run the target's "
            "layers from there on, with the draft's own attention projectors)"
        )
    return f"{len(meta.init_layers)} layer(s) initialised from target layer(s) {meta.init_layers}"


def recipe_markdown(name: str, meta: DraftMeta) -> str:
    """RECIPE.md: how the draft was made, for people."""
    r = meta.recipe
    val = r.get("validation", {})
    lines = [
        f"# {name}",
        "",
        f"A designed draft for `{meta.target}`: {_layers_text(meta)}, "
        f"{r.get('params', 0) / 1e6:.2f} M own parameters, "
        + (
            f"head over the {len(meta.head_tokens)} most frequent answer tokens "
            f"({meta.head_coverage:.1%} coverage)."
            if meta.head_tokens
            else "full-vocabulary head."
        ),
        (
            "The embedding and (tied) LM head are the target's and are not stored here; loading restores "
            "them from the target."
        ),
        "",
        "## Reproduce",
        "",
        "```",
        r.get("command", "?"),
        "```",
        "",
        f"- seed: {r.get('seed')}; torch threads: {r.get('threads')}",
        (
            "- data: the target's own greedy answers to training prompts from "
            f"{', '.join(r.get('data', {}).get('sources', []))} "
            f"({r.get('data', {}).get('train_prompts')} prompts, {r.get('data', {}).get('train_tokens')} "
            f"answer tokens; validation: {r.get('data', {}).get('val_prompts')} held-out prompts). "
            "Spec-Bench is never used."
        ),
        f"- time: {r.get('time_s')} (seconds; data generation is cached, so a rerun spends it once)",
        (
            "- validation acceptance (teacher-forced, greedy): "
            + (
                f"before training ({init}, --init-from) "
                if (init := r.get("config", {}).get("init_from"))
                else "untrained "
            )
            + f"{val.get('untrained', {}).get('alpha', float('nan')):.3f}, trained "
            f"{val.get('trained', {}).get('alpha', float('nan')):.3f}"
            + (
                f"; second draft position, reading the draft's own feature, given the first accepted: "
                f"{val['untrained']['alpha_2']:.3f} -> {val['trained']['alpha_2']:.3f}"
                if all("alpha_2" in val.get(x, {}) for x in ("untrained", "trained"))
                else ""
            )
        ),
        f"- made {r.get('date')} with {r.get('versions')}",
        "",
        (
            "Re-running the command with the cached data repeats the training run exactly (seeded data "
            "order; same thread count"
        ),
        (
            "and kind of CPU; `tests/commands/test_design.py` checks it). From an empty cache the data is "
            "generated again: the"
        ),
        "same greedy answers, up to rare near-ties where another batch composition rounds differently.",
        "",
        "## Use",
        "",
        "```",
        f"specdraft generate 'Hello' --draft designed:{name}"
        + (" --dtype bf16" if meta.kind == "flex" else ""),  # (it drafts inside the dense runtime's forward)
        *(  # only a token-level draft leaves specdraft (transformers' assistant_model)
            [f"specdraft design export drafts/{name} --out /tmp/{name}-hf   # a transformers directory"]
            if meta.kind == "layers"
            else []
        ),
        "```",
        "",
    ]
    return "\n".join(lines)
