"""The designed-draft directory: what ``specdraft design`` writes and ``--draft designed:...`` loads.

A directory holds::

    config.json          transformers config of the draft: a Llama, or a Gemma 3 text model for a
                         Gemma 3 target (its own depth / heads / FFN width; the target's vocabulary,
                         hidden size, RoPE and head tying)
    model.safetensors    the draft's tensors in transformers' names (model.layers.*, model.norm.*)
    specdraft.json       kind, head subset, target fingerprint, recipe (see :class:`DraftMeta`)

The *compact* form (what ``drafts/`` commits) leaves out ``model.embed_tokens.weight`` (and
``lm_head.weight``): the draft shares the target's embedding and LM head (they stay frozen in
training), so loading restores them from the target and checks first that the target is the one
the draft was designed for (vocabulary, hidden size and an embedding fingerprint). The *full* form
(``--full``) also writes the embedding: plain ``transformers.AutoModelForCausalLM.from_pretrained(dir)``
loads it, and it
works as ``assistant_model`` in transformers or as a draft model in other engines. Other engines
use the full head; the head subset in ``specdraft.json`` is a specdraft inference option.

Feature-conditioned drafts (``kind = "feature"``) add ``fc.weight`` (C x 2C) and read the
target's final hidden state; they need specdraft's drafter (:mod:`specdraft.drafters.feature`).
DREAM-style drafts (``kind = "dream"``) add ``fc.weight`` and the cross-attention's ``cross.*``
tensors, record the target layers they read and the heads in ``arch`` of ``specdraft.json``, and
carry ``speculators_config.json`` (:func:`speculators_config`); they need
:mod:`specdraft.drafters.dream`. CTC drafts (``kind = "ctc"``) add ``fc.weight`` and ``ctc.*``
(slot embeddings, blank logit; ``arch``: slots and CTC labels); they need
:mod:`specdraft.drafters.ctc`. FlexDraft drafts (``kind = "flex"``) have no Llama of their own (no
``config.json``): ``model.safetensors`` holds the ``flex.*`` tensors (mask embedding, attention
projectors from the split layer, calibration; ``arch``: split, block, rank), and they draft inside
the target's forward (:mod:`specdraft.drafters.flex`, compact runtime only).

Finding and building a designed draft (``--draft designed[:NAME|PATH|auto]``):

- ``designed:PATH``: a draft directory (``specdraft design ... --out PATH``);
- ``designed:NAME``: ``drafts/NAME`` of this repository;
- ``designed:auto`` (and plain ``designed``): of the committed drafts designed for this target,
  the one with the best speedup in the committed measurements ``drafts/auto.json`` lists
  (:func:`find_default`), else prompt lookup (so it works with every target).

:func:`drafter_from_spec` is the ``designed`` kind's factory in :data:`specdraft.registry.DRAFTERS`:
a layers draft becomes a :class:`~specdraft.drafters.gated.GatedDrafter`, a feature draft a
:class:`~specdraft.drafters.feature.FeatureDrafter`, both over a
:class:`~specdraft.models.subset_head.SubsetHeadRuntime` when the head is a vocabulary subset.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdraft import durable
from specdraft.drafters.ctc import CTC_KEYS, CTCDrafter
from specdraft.drafters.dream import CROSS_KEYS, DreamDrafter
from specdraft.drafters.feature import FeatureDrafter
from specdraft.drafters.gated import GatedDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.dtypes import QUANT
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime
from specdraft.models.quant import QuantRuntime, QuantWeights, quantize_matrix
from specdraft.models.runtime import compact_runtime
from specdraft.models.subset_head import SubsetHeadRuntime, draft_weights

FORMAT = 1
META_FILE = "specdraft.json"
WEIGHTS_FILE = "model.safetensors"
EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"
SHARED_KEYS = (EMBED_KEY, HEAD_KEY)
KINDS = ("layers", "feature", "dream", "diffusion", "ctc", "flex")
DRAFTS_DIR = Path(__file__).resolve().parents[2] / "drafts"  # the designed drafts this repository commits
AUTO_FILE = DRAFTS_DIR / "auto.json"  # the measurements designed:auto ranks the drafts by (find_default)


@dataclass
class DraftMeta:
    """What ``specdraft.json`` records about a designed draft.

    Attributes:
        kind: ``layers`` (a small Llama reading tokens) or ``feature`` (also reads the target's
            final hidden state, EAGLE-style).
        target: the target's name as it was given when designing.
        vocab_size: the target's vocabulary size.
        hidden_size: the target's hidden size.
        embed_fingerprint: a few statistics of the target's embedding (see :func:`fingerprint`).
        head_tokens: ids the draft's head predicts (None: the full vocabulary).
        head_coverage: share of the target's counted output tokens inside ``head_tokens``.
        init_layers: target layers the draft's layers were initialised from.
        width: ``{"kv_heads", "q_per_kv", "ffn"}`` when width-pruned, else None.
        arch: what a kind adds to the Llama config (``dream``: ``{"layers": [...], "heads": H}``,
            the target layers it cross-attends to and the cross-attention's heads; ``feature``:
            ``{"prompt_pairs": N}`` when trained to read the prompt's pairs).
        recipe: how it was made: command, seed, data, steps, time taken, validation acceptance.
        format: directory format version.
    """

    kind: str
    target: str
    vocab_size: int
    hidden_size: int
    embed_fingerprint: list[float]
    head_tokens: list[int] | None = None
    head_coverage: float | None = None
    init_layers: list[int] = field(default_factory=list)
    width: dict | None = None
    arch: dict = field(default_factory=dict)
    recipe: dict = field(default_factory=dict)
    format: int = FORMAT

    @classmethod
    def for_target(cls, target_model, target_name: str, kind: str = "layers", head=None, **kw) -> DraftMeta:
        """Meta for a draft of ``target_model``; ``head`` is a
        :class:`~specdraft.design.vocab.VocabSubset` or None."""
        cfg = target_model.config
        return cls(
            kind=kind,
            target=target_name,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            embed_fingerprint=fingerprint(target_model.get_input_embeddings().weight),
            head_tokens=head.token_ids.tolist() if head is not None else None,
            head_coverage=round(head.coverage, 5) if head is not None else None,
            **kw,
        )

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecdraftError(f"unknown draft kind {self.kind!r}: expected one of {', '.join(KINDS)}")


def fingerprint(embed: torch.Tensor) -> list[float]:
    """Mean, std and the sums of 8 fixed rows of an embedding: tells targets apart, dtype-robust."""
    e = embed.detach().float()
    rows = torch.linspace(0, e.shape[0] - 1, 8).long()
    return [float(e.mean()), float(e.std())] + [float(e[r].sum()) for r in rows]


def _embedding_facts(target) -> tuple[int, int, Callable[[], list[float]]]:
    """Vocabulary, hidden size and the embedding's fingerprint (computed on call) of a
    transformers model or of a GGUF's :class:`~specdraft.models.quant.QuantWeights`."""
    if hasattr(target, "embedding_fingerprint"):  # QuantWeights: the GGUF's own embedding blocks
        return target.embed.rows, target.hidden, target.embedding_fingerprint
    cfg = target.config
    return cfg.vocab_size, cfg.hidden_size, lambda: fingerprint(target.get_input_embeddings().weight)


def check_compatible(meta: DraftMeta, target_model, where: str) -> None:
    """Raise a clear error when ``target_model`` (a transformers model, or the quantized
    runtime's weights) is not the target this draft was designed for."""
    vocab, hidden, embedding_fingerprint = _embedding_facts(target_model)
    if vocab != meta.vocab_size or hidden != meta.hidden_size:
        raise SpecdraftError(
            f"draft {where} was designed for a target with vocabulary {meta.vocab_size} and hidden size "
            f"{meta.hidden_size} ({meta.target}); this target has {vocab} and {hidden}"
        )
    got = embedding_fingerprint()
    scale = max(abs(x) for x in meta.embed_fingerprint) + 1e-6
    if any(
        not math.isclose(a, b, rel_tol=2e-2, abs_tol=2e-2 * scale)
        for a, b in zip(got, meta.embed_fingerprint)
    ):
        raise SpecdraftError(
            f"draft {where} shares its embedding with {meta.target}, and this target's embedding differs: "
            "use the target it was designed for"
        )


def save_draft(
    path: str | Path,
    draft,
    meta: DraftMeta,
    *,
    full: bool = False,
    dtype: torch.dtype | None = None,
    extra: dict[str, torch.Tensor] | None = None,
    add_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write a draft directory (compact, or ``full`` with the shared embedding too), atomically.

    The whole directory is written under a temporary name beside ``path``, fsynced and renamed into
    place (:func:`specdraft.durable.replace_dir`): a kill while overwriting a draft leaves the old
    draft or the new one, never old metadata beside new weights.

    Args:
        path: the directory; an existing draft directory (or an empty one) there is replaced as a
            whole. Any other existing path is refused.
        draft: a transformers ``LlamaForCausalLM`` (its embedding is the target's), or None for a
            draft made of ``extra`` tensors only (``flex``: no ``config.json``).
        meta: recorded in ``specdraft.json``.
        full: also write the embedding, so plain transformers can load the directory.
        dtype: storage dtype (default: the draft's).
        extra: tensors outside the Llama (``fc.weight`` of a feature-conditioned draft).
        add_files: called with the temporary directory to write more files that belong with the
            draft (``RECIPE.md``, a tokenizer) before it is moved into place.

    Raises:
        SpecdraftError: ``path`` exists and is neither a draft directory nor an empty directory.
    """
    from safetensors.torch import save_file

    d = Path(path)
    if d.exists() and not (d.is_dir() and ((d / META_FILE).is_file() or not any(d.iterdir()))):
        raise SpecdraftError(f"{d} exists and is not a draft directory: choose another output path")
    state = {}
    own = {} if draft is None else draft.state_dict()  # None: a draft of extra tensors only (flex)
    tied = draft is not None and bool(draft.config.tie_word_embeddings)
    for name, t in own.items():
        if name in SHARED_KEYS and not full or (name == HEAD_KEY and tied):
            continue  # shared with the target (a tied head is the embedding)
        state[name] = t.detach().to(dtype or t.dtype).contiguous().clone()
    for name, t in (extra or {}).items():
        state[name] = t.detach().to(dtype or t.dtype).contiguous().clone()
    cfg = draft.config if draft is not None else None
    if dtype is not None and cfg is not None:
        cfg.dtype = str(dtype).removeprefix("torch.")
    real = d.resolve()  # (a name to put the temporary directory beside, even for ".")
    real.parent.mkdir(parents=True, exist_ok=True)
    tmp = real.with_name(f".{real.name}.new")
    if tmp.exists():
        shutil.rmtree(tmp)  # what a killed save left
    tmp.mkdir()
    try:
        if cfg is not None:
            cfg.to_json_file(str(tmp / "config.json"))
        kind = "full" if full else "compact"
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "specdraft": kind})
        (tmp / META_FILE).write_text(json.dumps(asdict(meta), indent=1))
        if add_files is not None:
            add_files(tmp)
        durable.replace_dir(tmp, real)
    except BaseException:  # an error or Ctrl-C: the old draft stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return d


def read_meta(path: str | Path) -> DraftMeta:
    """Read ``specdraft.json``; a clear error when the directory is not a designed draft."""
    d = Path(path)
    f = d / META_FILE
    if not f.is_file():
        raise SpecdraftError(f"{d} is not a designed draft: no {META_FILE}")
    try:
        raw = json.loads(f.read_text())
        if raw.get("format") != FORMAT:
            raise SpecdraftError(
                f"{f}: draft format {raw.get('format')} is not supported (expected {FORMAT})"
            )
        return DraftMeta(**raw)
    except (json.JSONDecodeError, TypeError) as e:
        raise SpecdraftError(f"{f} is corrupted ({e})") from None


def load_draft(path: str | Path, target_model, dtype: torch.dtype = torch.float32):
    """Load a draft directory as a transformers model that shares the target's embedding.

    Returns:
        ``(draft, meta, extra)``: the ``LlamaForCausalLM`` (eval mode, frozen), its
        :class:`DraftMeta`, and tensors that are not part of the Llama (``fc.weight`` for
        feature-conditioned drafts).

    Raises:
        SpecdraftError: not a draft directory, an incompatible target, or corrupted weights.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoConfig

    d = Path(path)
    meta = read_meta(d)
    check_compatible(meta, target_model, str(d))
    try:
        cfg = AutoConfig.from_pretrained(str(d), local_files_only=True)
        state = load_file(str(d / WEIGHTS_FILE))
    except (OSError, SafetensorError, ValueError, json.JSONDecodeError) as e:
        raise SpecdraftError(f"draft {d} is corrupted or incomplete ({type(e).__name__}: {e})") from None
    extra = {k: state.pop(k) for k in list(state) if not k.startswith("model.")}
    for k in SHARED_KEYS:
        state.pop(k, None)  # a full export's copies; the target's own are used
    draft = build_model(cfg, target_model)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in SHARED_KEYS]
    if missing or unexpected:
        raise SpecdraftError(
            f"draft {d} has the wrong tensors (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    bad = [k for k, t in state.items() if not torch.isfinite(t).all()]
    if bad:
        raise SpecdraftError(f"draft {d} is corrupted: non-finite values in {bad[0]}")
    draft.model.embed_tokens.weight = draft.lm_head.weight = None  # the target's: .to must not convert them
    draft.to(dtype)
    draft.model.embed_tokens.weight = target_model.get_input_embeddings().weight
    if cfg.tie_word_embeddings:
        draft.tie_weights()
    else:
        draft.lm_head.weight = target_model.get_output_embeddings().weight
    draft.eval().requires_grad_(False)
    return draft, meta, {k: v.to(dtype) if v.is_floating_point() else v for k, v in extra.items()}


def build_model(cfg, target_model):
    """An (untrained) transformers model for ``cfg`` (``LlamaForCausalLM``, ``Gemma3ForCausalLM``)
    whose embedding and LM head are the target's tensors (tied or not, as the target has them)."""
    from transformers import AutoModelForCausalLM

    cfg.tie_word_embeddings = bool(target_model.config.tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; keep the caller's RNG
        draft = AutoModelForCausalLM.from_config(cfg)
    draft.model.embed_tokens.weight = target_model.get_input_embeddings().weight
    if cfg.tie_word_embeddings:
        draft.tie_weights()
    else:
        draft.lm_head.weight = target_model.get_output_embeddings().weight
    return draft


# ------------------------------------------------------------------------------------ lookups
def resolve_draft_dir(name: str) -> Path:
    """``designed:`` argument -> directory: an existing path, else ``drafts/<name>``."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    q = DRAFTS_DIR / name
    if q.is_dir():
        return q
    drafts = DRAFTS_DIR.iterdir() if DRAFTS_DIR.is_dir() else []
    have = sorted(x.name for x in drafts if (x / META_FILE).is_file())
    committed = ", ".join(have) or "(none committed)"
    raise SpecdraftError(f"designed draft {name!r} not found: give a draft directory or one of {committed}")


def measured_speedups(auto_file: Path = AUTO_FILE) -> dict[str, float]:
    """Committed draft name -> its best overall speedup over plain decoding in the measurements
    ``auto_file`` lists (``{"measurements": [paths relative to the file, ...]}``, each written by
    ``benchmarks/bench_drafters.py --json``: rows ``designed:NAME@k``); {} without the file."""
    if not auto_file.is_file():
        return {}
    best: dict[str, float] = {}
    for rel in json.loads(auto_file.read_text())["measurements"]:
        for item, row in json.loads((auto_file.parent / rel).read_text())["drafters"].items():
            kind, _, name = (item.rpartition("@")[0] or item).partition(":")  # spec@k, or spec
            if kind == "designed" and (DRAFTS_DIR / name / META_FILE).is_file():
                best[name] = max(best.get(name, 0.0), row["all"]["speedup"])
    return best


def find_default(target_model) -> Path | None:
    """The committed draft (``drafts/*``) for this target that measured fastest
    (:func:`measured_speedups`), or None when none measured fits the target."""
    speedups = measured_speedups()
    for name in sorted(speedups, key=speedups.__getitem__, reverse=True):
        d = DRAFTS_DIR / name
        try:
            check_compatible(read_meta(d), target_model, str(d))
        except SpecdraftError:
            continue
        return d
    return None


def find_draft(name: str, target_model) -> Path | None:
    """A ``designed:`` argument's directory: ``auto`` (or empty) is :func:`find_default` (None when
    there is none), anything else :func:`resolve_draft_dir`."""
    return find_default(target_model) if name in ("", "auto") else resolve_draft_dir(name)


def drafter_from_spec(spec, target):
    """The drafter for a ``designed[:NAME|PATH|auto]`` spec (module docstring).

    Args:
        spec: a :class:`~specdraft.registry.DraftSpec` of kind ``designed``.
        target: a :class:`~specdraft.registry.Target`: the loaded target (its embedding is shared),
            its runtime (its tensors are shared when it is a compact runtime) and the draft dtype.
    """
    quant = target.dtype == QUANT  # GGUF blocks: the quantized target's embedding, no transformers model
    path = find_draft(spec.arg, target.runtime.w if quant else _target_model(target))
    if path is None:
        return PromptLookupDrafter()
    if quant:
        return quant_drafter(path, target)
    if read_meta(path).kind == "flex":
        return flex_drafter(path, target)
    dtype = target.dtype
    dense = torch.float32 if dtype == torch.qint8 else dtype  # int8 packs the weights after loading
    draft, meta, extra = load_draft(path, _target_model(target), dense)
    head = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
    if meta.kind == "diffusion":
        return diffusion_drafter(draft, meta, extra, head, path)
    tw = target.runtime.w if isinstance(target.runtime, LlamaRuntime) else None
    w = draft_weights(draft, tw, head, dtype)
    rt = compact_runtime(w)
    if head is not None:
        rt = SubsetHeadRuntime(rt, head, meta.vocab_size)
    if meta.kind in ("feature", "dream", "ctc"):
        return _feature_drafter(meta, extra, rt, w, path)
    return GatedDrafter(rt, f"designed:{path.name}", target_runtime=target.runtime)


def _target_model(target):
    """The target's transformers model, loaded now when the target runs from its files alone
    (:meth:`specdraft.models.loading.LoadedModel.transformers_model`)."""
    loaded = target.loaded
    return loaded.model if loaded.model is not None else loaded.transformers_model()


def quant_drafter(path: Path, target):
    """A token-level (``layers``) or ``feature`` designed draft beside a quantized target
    (``--draft-dtype q``): its matrices (a feature draft's input projection included) as Q8_0
    blocks made at load, the target GGUF's embedding rows and head rows
    (:meth:`specdraft.models.quant.QuantWeights.from_llama`); no transformers model is built.

    Raises:
        SpecdraftError: another kind of draft, an incompatible target, or corrupted weights.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta = read_meta(path)
    if meta.kind not in ("layers", "feature"):
        raise SpecdraftError(
            f"--draft-dtype q runs token-level and feature designed drafts, not {meta.kind} ones: use bf16"
        )
    check_compatible(meta, target.runtime.w, str(path))
    try:
        config = json.loads((path / "config.json").read_text())
        state = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError, ValueError) as e:
        raise SpecdraftError(f"draft {path} is corrupted or incomplete ({type(e).__name__}: {e})") from None
    bad = [k for k, t in state.items() if not torch.isfinite(t).all()]
    if bad:
        raise SpecdraftError(f"draft {path} is corrupted: non-finite values in {bad[0]}")
    head = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
    rt = QuantRuntime(QuantWeights.from_llama(state, config, target.runtime.w, head), target.runtime.variant)
    if head is not None:
        rt = SubsetHeadRuntime(rt, head, meta.vocab_size)
    if meta.kind == "feature":
        extra = {k: t for k, t in state.items() if not k.startswith("model.")}
        return _feature_drafter(meta, extra, rt, target.runtime.w, path)
    return GatedDrafter(rt, f"designed:{path.name}", target_runtime=target.runtime)


def _feature_drafter(meta: DraftMeta, extra: dict, rt, w, path: Path):
    """The engine-side drafter of a ``feature``, ``dream`` or ``ctc`` draft."""
    own = {"dream": [f"cross.{k}" for k in CROSS_KEYS], "ctc": [f"ctc.{k}" for k in CTC_KEYS]}
    need = ["fc.weight"] + own.get(meta.kind, [])
    lacking = [k for k in need if k not in extra]
    if lacking:
        raise SpecdraftError(f"{meta.kind} draft {path} lacks {lacking[0]}: corrupted")
    fc, name = extra["fc.weight"], f"designed:{path.name}"
    if meta.kind == "feature":  # its fc runs as the layers' matmuls do: bf16 weights stay bf16, and
        # beside a quantized target (w: its QuantWeights) it is Q8_0 blocks as the layers are
        if isinstance(w, QuantWeights):
            fc = quantize_matrix(fc).repacked()
        else:
            fc = fc.to(w.dtype if w.dtype.is_floating_point else w.compute_dtype)
        return FeatureDrafter(rt, fc, w.embed, name, prompt_pairs=meta.arch.get("prompt_pairs", 0))
    fc = fc.to(w.compute_dtype)  # ctc and dream run theirs in torch, on the activations' dtype
    if meta.kind == "ctc":
        return CTCDrafter(rt, fc, {k: extra[f"ctc.{k}"] for k in CTC_KEYS}, w.embed, name)
    cross = {k: extra[f"cross.{k}"] for k in CROSS_KEYS}
    return DreamDrafter(rt, fc, cross, w.embed, name, meta.arch["layers"], meta.arch["heads"])


def flex_drafter(path: Path, target):
    """The engine-side drafter of a ``flex`` draft: it drafts inside ``target.runtime``'s forward."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specdraft.drafters.flex import FlexDrafter, FlexWeights

    meta = read_meta(path)
    check_compatible(meta, target.loaded.model, str(path))
    if not isinstance(target.runtime, LlamaRuntime):
        raise SpecdraftError(
            f"flex draft {path.name} drafts inside the compact runtime's forward: --dtype bf16 or fp32"
        )
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise SpecdraftError(f"draft {path} is corrupted or incomplete ({type(e).__name__}: {e})") from None
    rw = target.runtime.w  # projectors stored like the target's weights (bf16: half the traffic)
    proj = ("flex.wqkv.", "flex.wo.")
    tensors = {k: v.to(rw.dtype if k.startswith(proj) else rw.compute_dtype) for k, v in tensors.items()}
    w = FlexWeights.from_tensors(tensors, meta.arch["split"], len(target.runtime.layers))
    head = torch.tensor(meta.head_tokens, dtype=torch.int64) if meta.head_tokens else None
    return FlexDrafter(target.runtime, w, f"designed:{path.name}", block=meta.arch["block"], head_tokens=head)


def diffusion_drafter(draft, meta: DraftMeta, extra: dict, head, path: Path, adaptive: bool = True):
    """The engine-side drafter of a ``diffusion`` draft (:mod:`specdraft.drafters.diffusion`)."""
    from specdraft.drafters.diffusion import PREFIX, BlockArch, BlockDiffusion, DiffusionDrafter

    tensors = {k.removeprefix(PREFIX): v for k, v in extra.items() if k.startswith(PREFIX)}
    draft.model.layers.float()  # a small draft: fp32 on CPUs without native bf16 matmuls (the
    draft.model.norm.float()  # shared embedding stays the target's)
    try:
        model = BlockDiffusion(draft, head, tensors, BlockArch(**meta.arch))
    except (SpecdraftError, TypeError) as e:
        raise SpecdraftError(f"diffusion draft {path} is corrupted ({e})") from None
    return DiffusionDrafter(model, f"designed:{path.name}", adaptive=adaptive)


LAYER_CONFIG_KEYS = (  # the decoder layer's fields in a speculators transformer_layer_config
    "attention_bias",
    "attention_dropout",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "max_position_embeddings",
    "mlp_bias",
    "model_type",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "pretraining_tp",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "tie_word_embeddings",
    "vocab_size",
)


def speculators_config(draft, meta: DraftMeta, target_model) -> dict:
    """An EAGLE-3 / ``speculators``-style description of a DREAM draft (``speculators_config.json``).

    The layout follows the speculators library's ``config.json`` (``speculators_model_type``,
    ``transformer_layer_config``, ``draft_vocab_size``, ``speculators_config`` with the proposal
    methods and the verifier) so that a GPU engine's loader finds the decoder layer, the auxiliary
    target layers it reads (``aux_hidden_state_layer_ids``: transformers ``hidden_states`` indices)
    and the vocabulary mapping (``d2t``/``t2d`` tensors, written when the head is a subset). No
    engine implements DREAM's cross-attention block today: ``speculators_model_type`` says
    ``dream``, and an engine needs that block (``cross.*``, :func:`specdraft.drafters.dream.cross_attend`)
    before it can load the draft.
    """
    full = draft.config.to_dict()
    layer_cfg = {k: full[k] for k in LAYER_CONFIG_KEYS if k in full}
    tcfg = target_model.config
    return {
        "architectures": ["DreamSpeculator"],
        "speculators_model_type": "dream",
        "speculators_version": "specdraft-1",
        "draft_vocab_size": len(meta.head_tokens) if meta.head_tokens else meta.vocab_size,
        "norm_before_residual": True,
        "target_hidden_size": meta.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in meta.arch["layers"]],
        "cross_attention_heads": meta.arch["heads"],
        "transformer_layer_config": layer_cfg,
        "speculators_config": {
            "algorithm": "dream",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 4,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": meta.target, "architectures": list(tcfg.architectures or [])},
        },
    }


def vocab_maps(head_tokens: list[int], vocab_size: int) -> dict[str, torch.Tensor]:
    """EAGLE-3's vocabulary maps for a head subset: ``d2t`` (draft row -> target id offset, so that
    ``target_id = row + d2t[row]``) and ``t2d`` (which target ids the draft has)."""
    ids = torch.tensor(head_tokens, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def local_drafter_from_spec(spec, target):
    """``local:designed:NAME``: the designed feature/DREAM draft NAME with its local head fused in."""
    from specdraft.drafters.feature_base import FeatureDrafterBase
    from specdraft.drafters.local import load_local
    from specdraft.registry import DraftSpec, build_drafter

    inner = DraftSpec.parse(spec.arg)  # designed:NAME (the registry's check)
    drafter = build_drafter(inner, target)
    if not isinstance(drafter, FeatureDrafterBase) or getattr(drafter, "proposes_trees", False):
        raise SpecdraftError(f"local:{spec.arg}: a local head fuses into feature or dream drafts only")
    drafter.local = load_local(find_draft(inner.arg, target.loaded.model), drafter.embed)
    if drafter.local.vocab_size != drafter.vocab_size:
        raise SpecdraftError(f"local:{spec.arg}: the local head's vocabulary is not the draft's")
    head = getattr(drafter.runtime, "token_ids", None)  # a head subset: score only its tokens
    if head is not None and hasattr(drafter.local, "restrict"):
        drafter.local.restrict(head)
    drafter.name = f"local:{drafter.name}"
    return drafter
