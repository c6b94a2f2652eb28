"""Python API: load a target and a drafter by name, generate text, stream step events.

    from specdraft import api
    pipe = api.load("smollm2-135m", draft="prune:0,1,2,29")
    result = pipe.generate("What is speculative decoding?", max_new_tokens=64, k=5)
    print(result.text); print(result.stats.summary())
    for delta in pipe.stream("Tell me a joke"):
        print(delta.text, end="")

Draft specs (``--draft`` on the CLI) are parsed by :class:`specdraft.registry.DraftSpec` and built
by the factories of :data:`specdraft.registry.DRAFTERS`:

- ``none``: plain autoregressive decoding.
- ``default`` (what leaving ``--draft`` out means): prompt lookup, the fastest drafter measured on
  this CPU (Spec-Bench, both turns, ``--k auto``: 1.20x plain decoding,
  ``results/engine-2026-12-01c/bench_engine_c_lookup_limit4_head.json``; the designed draft 0.96x,
  ``drafts/results/bench_designed_auto_curve.json``; the README's drafter table has the commands).
  ``designed:auto`` is, of the drafts designed for this target and committed under ``drafts/``,
  the one that measured fastest in the committed runs ``drafts/auto.json`` lists, else prompt lookup.
- ``prune:0,1,2,29``: the target's own layers 0, 1, 2 and 29 at full width, with its embedding and
  LM head: the untrained "shallow and wide" layer-pruned self-draft.
- ``lookup`` or ``lookup:N``: prompt lookup with n-grams up to N (default 3).
- ``self``: the target drafting for itself (every draft accepted; for testing).
- ``designed:NAME|PATH|auto``: a draft made by ``specdraft design`` (``drafts/NAME`` or a
  directory; ``auto``: the committed one for this target that measured fastest, else lookup). See
  :mod:`specdraft.design.artifact`.
- anything else: a model alias or path, loaded as an independent draft model.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specdraft import kernels, registry
from specdraft.drafters.base import Drafter
from specdraft.dtypes import AUTO_KEEPS_BF16, AUTO_QUANT_DRAFTS, DTYPES, QUANT, choices
from specdraft.engine import Engine, Request, StepEvent, decode_requests, generate
from specdraft.errors import SpecdraftError
from specdraft.kernels import cpu_has_fast_bf16
from specdraft.models.llama import LlamaWeights
from specdraft.models.loading import DEFAULT_TARGET, LoadedModel, load_model, load_tokenizer
from specdraft.models.runtime import Runtime, compact_from_files, make_runtime, runs_compact
from specdraft.policy import KPolicy, make_policy
from specdraft.stats import SpecStats
from specdraft.verify import SamplingParams

log = logging.getLogger("specdraft")


def resolve_dtype(name: str | torch.dtype, draft: bool = False, runtime: str = "compact") -> torch.dtype:
    """A precision name of :data:`specdraft.dtypes.DTYPES` (``bf16``, ``fp32``, ``int8``, ``auto``)
    as a torch dtype.

    Targets: ``auto`` is bf16 where the CPU computes it natively; elsewhere it is bf16 for the
    compact runtime when the few-row kernel (:mod:`specdraft.kernels`) is available (bf16 weights,
    fp32 arithmetic: half the memory traffic of fp32) and fp32 otherwise (``runtime="hf"``: torch
    would emulate bf16). int8 is refused for a target: its matmuls quantize activations, so the
    last-bit float differences between a (k + 1)-token verification and a 1-token step flip
    roundings and the output would not be exactly the target's. Drafts (whose precision changes
    only how often they are accepted, never the output): ``auto`` is bf16 where the CPU has it
    natively or the native kernels run it (bf16 weights, fp32 arithmetic; ``specdraft profile
    --draft-dtype bf16`` or ``int8`` compares their step times), else int8 (fbgemm).
    """
    if isinstance(name, torch.dtype):
        dt = name
    elif name == "auto":
        if cpu_has_fast_bf16() or (runtime != "hf" and kernels.available()):
            dt = torch.bfloat16
        else:
            dt = torch.qint8 if draft else torch.float32
    elif name in DTYPES and DTYPES[name].torch is not None:
        dt = DTYPES[name].torch
    else:
        names = [n for n in choices("draft" if draft else "target") if draft or n != "q"]
        raise SpecdraftError(f"unknown dtype {name!r}: use {', '.join(names)}")
    if dt == torch.qint8 and not draft:
        raise SpecdraftError(
            "int8 is a draft precision (--draft-dtype int8): an int8 target would not be lossless"
        )
    return dt


RUNS_WITHOUT_TRANSFORMERS_MODEL = (
    "none",
    "lookup",
    "lookup-tree",
    "self",
    "prune",
    "bigram",
    "suffix",
    "model",
)
"""Draft kinds whose factories never read the target's transformers model: with these (and no
``needs`` of :data:`specdraft.dtypes.AUTO_KEEPS_BF16`) a Gemma 3 target on the compact runtime is
loaded from its weight files alone (:func:`specdraft.models.runtime.compact_from_files`), without
the float32 transformers model."""


QUANT_DRAFT_KINDS = ("self", "prune", "designed", "model", "tree", "ouroboros")
"""Draft kinds with a model that ``--draft-dtype q`` runs on GGUF blocks beside a quantized target
(``prune:`` on the target's own, ``designed`` (token-level and feature drafts) on Q8_0 blocks made at
load, a model alias or path on its own GGUF; ``tree`` and ``ouroboros`` through the draft they wrap)."""

MODEL_FREE_KINDS = ("none", "lookup", "lookup-tree", "bigram", "suffix")
"""Draft kinds without a model: the draft precision changes nothing for them."""


def model_kind(spec: str | registry.DraftSpec) -> str:
    """The kind of the model a spec drafts with: a ``tree:`` spec's inner draft's, else its own."""
    spec = registry.DraftSpec.parse(spec)
    return (
        registry.DraftSpec.parse(registry.tree_parts(spec.arg)[2]).kind if spec.kind == "tree" else spec.kind
    )


def is_quantized(runtime: Runtime | None) -> bool:
    """Whether ``runtime`` runs a GGUF's own blocks (:class:`specdraft.models.quant.QuantRuntime`)."""
    from specdraft.models.quant import QuantRuntime

    return isinstance(runtime, QuantRuntime)


def _auto_runs_quantized(spec: registry.DraftSpec, runtime: Runtime) -> bool:
    """Whether ``--draft-dtype auto`` runs ``spec``'s draft on GGUF blocks beside the quantized
    ``runtime``: its model kind is in :data:`specdraft.dtypes.AUTO_QUANT_DRAFTS`, and a designed
    draft is a token-level or a feature one (``designed:auto`` without a committed draft for this
    target: no)."""
    kind = model_kind(spec)
    if kind != "designed":
        return kind in AUTO_QUANT_DRAFTS
    from specdraft.design.artifact import find_draft, read_meta

    inner = registry.DraftSpec.parse(registry.tree_parts(spec.arg)[2]) if spec.kind == "tree" else spec
    path = find_draft(inner.arg, runtime.w)
    return path is not None and read_meta(path).kind in ("layers", "feature")


def draft_precision(name: str | torch.dtype, runtime: Runtime | None, spec) -> torch.dtype | str:
    """``--draft-dtype`` for a draft spec beside the target's ``runtime``: a torch dtype
    (:func:`resolve_dtype`), or :data:`specdraft.dtypes.QUANT` (GGUF blocks) for ``q``, and for
    ``auto`` when the target is quantized and the draft's model kind (:func:`model_kind`) is in
    :data:`specdraft.dtypes.AUTO_QUANT_DRAFTS`.

    Raises:
        SpecdraftError: ``q`` beside a target that is not quantized, or for a kind without a
            quantized path (:data:`QUANT_DRAFT_KINDS`).
    """
    spec = registry.DraftSpec.parse(spec)
    quant = is_quantized(runtime)
    if name == "auto" and quant and _auto_runs_quantized(spec, runtime):
        return QUANT
    if name != QUANT:
        return resolve_dtype(name, draft=True)
    if not quant:
        raise SpecdraftError(
            "--draft-dtype q runs the draft on GGUF blocks beside a quantized target: give a GGUF "
            "target with --dtype auto or q"
        )
    if spec.kind not in MODEL_FREE_KINDS + QUANT_DRAFT_KINDS:
        raise SpecdraftError(
            f"--draft-dtype q: {spec.kind} drafts do not run on GGUF blocks; use bf16, fp32 or int8"
        )
    return QUANT


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count (None: leave torch's default). More threads than usable
    CPUs are capped to that count with a warning: OpenMP threads that share a core spin at every
    barrier (999 threads on 2 cores made a 4-token generate take 4.7 s instead of 0.01 s)."""
    if threads is not None:
        if threads < 1:
            raise SpecdraftError(f"threads must be >= 1, got {threads}")
        cpus = usable_cpus()
        if threads > cpus:
            log.warning("threads %d > %d usable CPUs: using %d", threads, cpus, cpus)
            threads = cpus
        torch.set_num_threads(threads)


@dataclass
class Pipeline:
    """A loaded target, its runtime and a drafter, ready to generate.

    Attributes:
        target: the loaded target model and tokenizer.
        runtime: the target's runtime.
        drafter: the drafter, or None for plain decoding.
        draft_spec: the spec the drafter was built from.
    """

    target: LoadedModel
    runtime: Runtime
    drafter: Drafter | None
    draft_spec: str = "none"
    _weights: LlamaWeights | None = field(default=None, repr=False)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.target.eos_ids()

    def encode(self, prompt: str | list[dict], chat: bool | None = None) -> list[int]:
        """Prompt text (or chat messages) to token ids; instruct models get their chat template."""
        tok = self.tokenizer
        if isinstance(prompt, str) and not prompt.strip():
            raise SpecdraftError("empty prompt")
        use_chat = self.target.is_chat() if chat is None else chat
        if isinstance(prompt, list) or use_chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return tok(prompt, add_special_tokens=True)["input_ids"]

    def engine(self, k: int | str | KPolicy = 5, hidden_layers: tuple[int, ...] = ()) -> Engine:
        policy = k if hasattr(k, "choose") else make_policy(k)
        # () or None: the target layers a feature-conditioned drafter names (Engine's default)
        return Engine(self.runtime, self.drafter, policy, hidden_layers=hidden_layers or None)

    def stream(
        self,
        prompt: str | list[dict] | list[int],
        *,
        max_new_tokens: int = 128,
        k: int | str | KPolicy = 5,
        params: SamplingParams = SamplingParams(),
        stop: list[str] | None = None,
        chat: bool | None = None,
        engine: Engine | None = None,
    ) -> Iterator[TextDelta]:
        """Stream text deltas for one prompt (a list of ints is taken as token ids)."""
        ids = (
            prompt
            if (isinstance(prompt, list) and prompt and isinstance(prompt[0], int))
            else self.encode(prompt, chat)
        )
        engine = engine or self.engine(k)
        detok = Detokenizer(self.tokenizer, stop or [])
        request = Request(ids, max_new_tokens, params, self.eos_ids)
        events = generate(engine, [request])
        try:
            for ev in events:
                text, hit_stop = detok.push(ev.tokens, ev.finished)
                if hit_stop:
                    yield TextDelta(text, ev.tokens, ev.from_draft, True, "stop", ev.source)
                    return
                yield TextDelta(text, ev.tokens, ev.from_draft, ev.finished, ev.finish_reason, ev.source)
        finally:
            events.close()

    def generate(self, prompt, **kwargs) -> GenerationResult:
        """Generate for one prompt and return text, tokens and statistics."""
        engine = kwargs.pop("engine", None) or self.engine(kwargs.pop("k", 5))
        parts, tokens, from_draft, reason = [], [], [], None
        for d in self.stream(prompt, engine=engine, **kwargs):
            parts.append(d.text)
            tokens += d.tokens
            from_draft += d.from_draft
            reason = d.finish_reason or reason
        return GenerationResult("".join(parts), tokens, from_draft, engine.stats, reason)


@dataclass
class TextDelta:
    """A piece of streamed output: new text and the tokens behind it (``source``: where each token
    came from, :attr:`specdraft.engine.StepEvent.source`)."""

    text: str
    tokens: list[int]
    from_draft: list[bool]
    finished: bool = False
    finish_reason: str | None = None
    source: list[str] = field(default_factory=list)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    from_draft: list[bool]
    stats: SpecStats
    finish_reason: str | None


HOLD_MAX = 16  # tokens a Detokenizer holds for an undecided character before it looks closer


class Detokenizer:
    """Incremental detokenization with stop strings; the work per push is O(new tokens).

    Each push decodes a small window, not the whole output (as TGI and vLLM do): the tokens since
    the last release plus those of the release before, as context. The new text is the window's
    text minus the context's, so tokenizers whose decode treats the first token specially (a
    dropped leading space) stay consistent. Text is held back while it ends in an incomplete UTF-8
    character (``"\\ufffd"``; a run of invalid bytes, which decodes to it too, is released once it is
    held over :data:`HOLD_MAX` tokens: :meth:`_release_decided`) and while its last ``len(stop) - 1``
    characters could still begin a stop string; the concatenated releases equal
    ``tokenizer.decode(all tokens)``, cut before the earliest stop string.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) - 1 for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.prefix_offset = 0  # the window starts here: the context's first token
        self.read_offset = 0  # tokens before this have been decoded into released or pending text
        self.pending = ""  # decoded, not released: it may be the start of a stop string

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""

    def _release_decided(self, context: str, text: str) -> None:
        """Text held because it ends in "\ufffd" whose characters are decided all the same: that of
        all but the last 3 tokens, when the window's text goes on at least 3 characters past it (a
        UTF-8 character is decided within 4 bytes, and a character comes from at least one byte).
        Without this a run of invalid bytes would be held, its window growing, until a valid one."""
        cut = len(self.tokens) - 3
        decided = self._decode(self.tokens[self.prefix_offset : cut])
        if len(text) - len(decided) >= 3 and text.startswith(decided) and len(decided) > len(context):
            self.pending += decided[len(context) :]
            self.prefix_offset, self.read_offset = self.read_offset, cut

    def push(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        """Add tokens; return (new text to release, whether a stop string was hit)."""
        self.tokens += tokens
        context = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset :])
        new = text[len(context) :]
        # a stop string lies wholly in unreleased text: released text never holds the start of one
        found = [i for i in ((self.pending + new).find(s) for s in self.stop) if i != -1]
        if found:
            out = (self.pending + new)[: min(found)]
            self.pending = ""
            return out, True
        if new and (final or not new.endswith("\ufffd")):  # else: a character is half there
            self.pending += new
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        elif len(self.tokens) - self.read_offset > HOLD_MAX:  # held long: a run of invalid bytes
            self._release_decided(context, text)
        end = len(self.pending) if final else max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:end], self.pending[end:]
        return out, False


def make_drafter(
    spec: str | registry.DraftSpec, target: LoadedModel, runtime: Runtime, dtype: torch.dtype | str
) -> Drafter | None:
    """The drafter for a draft spec (module docstring) over a loaded target and its runtime, at the
    draft precision ``dtype`` (a torch dtype, or a ``--draft-dtype`` name: :func:`draft_precision`);
    None for ``none``. Parsed and built by :mod:`specdraft.registry`."""
    if isinstance(dtype, str):
        dtype = draft_precision(dtype, runtime, spec)
    return registry.build_drafter(spec, registry.Target(target, runtime, dtype))


def load(
    target: str = DEFAULT_TARGET,
    draft: str = "default",
    *,
    dtype: str | torch.dtype = "auto",
    runtime: str = "auto",
    threads: int | None = None,
    draft_dtype: str | torch.dtype = "auto",
    needs: tuple[str, ...] = (),
) -> Pipeline:
    """Load a target and build a drafter for it.

    Args:
        target: model alias (``smollm2-135m``, ``gemma3-270m``), transformers directory or GGUF path.
        draft: draft spec (module docstring).
        dtype: the target's precision: ``bf16``, ``fp32`` or ``auto`` (see :func:`resolve_dtype`; for
            a quantized GGUF, :func:`auto_quant_runtime`), or ``q``: a GGUF target's own Q4_0 / Q4_1 /
            Q8_0 blocks whatever the run (:class:`specdraft.models.quant.QuantRuntime`).
        runtime: ``auto`` (compact for Llama-family and Gemma 3, else transformers), ``compact`` or ``hf``.
        threads: torch intra-op threads.
        draft_dtype: the draft's precision: ``auto``, ``bf16``, ``fp32``, ``int8`` or ``q`` (GGUF
            blocks beside a quantized target; :func:`draft_precision`).
        needs: what else the caller runs with the target's transformers model (keys of
            :data:`specdraft.dtypes.AUTO_KEEPS_BF16`, such as ``"hf"`` for the transformers
            baselines): ``auto`` then keeps bf16.
    """
    set_threads(threads)
    spec = registry.DraftSpec.parse(draft)  # a bad spec fails before the target loads
    if draft_dtype != QUANT:
        resolve_dtype(draft_dtype, draft=True)  # and so does an unknown draft precision
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rt = None
    if dtype == "q":  # the GGUF's own quantized blocks (specdraft.models.quant), whatever the run
        from specdraft.models.quant import QuantRuntime, gguf_path

        if runtime not in ("auto", "quant"):
            raise SpecdraftError(f"--dtype q runs the quantized runtime, not {runtime!r}")
        rt = QuantRuntime(gguf_path(target))
    elif dtype == "auto" and runtime in ("auto", "quant"):
        # a prune: draft on GGUF blocks (q, auto) runs the quantized target's own layers
        quant_draft = draft_dtype == QUANT or (
            draft_dtype == "auto" and model_kind(spec) in AUTO_QUANT_DRAFTS
        )
        rt = auto_quant_runtime(target, (*(() if quant_draft else (model_kind(spec),)), *needs))
    keeps_model = spec.kind not in RUNS_WITHOUT_TRANSFORMERS_MODEL or any(n in AUTO_KEEPS_BF16 for n in needs)
    if rt is None and dtype != "q" and runtime in ("auto", "compact") and not keeps_model:
        rt = compact_from_files(target, resolve_dtype(dtype, runtime="compact"))  # Gemma 3 only
    draft_dt = draft_precision(draft_dtype, rt, spec)  # q beside a target that is not quantized: refused
    if rt is not None:
        # the tokenizer only, unless the drafter may be built from the target's transformers model
        # (a designed draft shares its embedding, unless it runs on GGUF blocks; tree:designed:...
        # wraps one)
        keeps_model = keeps_model and not (draft_dt == QUANT and model_kind(spec) in QUANT_DRAFT_KINDS)
        loaded = load_model(target, torch.float32) if keeps_model else load_tokenizer(target)
        drafter = make_drafter(draft, loaded, rt, draft_dt)
        return Pipeline(loaded, rt, drafter, draft)
    if dtype == "auto" and not cpu_has_fast_bf16():
        # the runtime decides (bf16 weights for the compact one, fp32 for transformers'), so load
        # in fp32 and let the compact runtime cast its copy
        loaded = load_model(target, torch.float32)
        compact = runtime == "compact" or (runtime == "auto" and runs_compact(loaded.model.config.model_type))
        dt = resolve_dtype("auto", runtime="compact" if compact else "hf")
    else:
        dt = resolve_dtype(dtype)
        loaded = load_model(target, dt)
    rt = make_runtime(loaded, runtime, dt)
    drafter = make_drafter(draft, loaded, rt, draft_dt)
    return Pipeline(loaded, rt, drafter, draft)


def auto_quant_runtime(target: str, needs: tuple[str, ...] = ()):
    """The quantized runtime ``--dtype auto`` picks for ``target``, or None for bf16.

    A GGUF target whose matrices the quantized kernels take (Q4_0 / Q4_1 / Q8_0, Llama family) on
    a CPU that runs them (AVX2) gets :class:`specdraft.models.quant.QuantRuntime`, unless one of
    ``needs`` (the draft kind, bench baselines, the command) needs the target's transformers model
    (:data:`specdraft.dtypes.AUTO_KEEPS_BF16`). Keeping bf16 for a GGUF is said in one line on
    stderr, with why; a target that is not a GGUF file gets bf16 silently.

    Raises:
        SpecdraftError: the GGUF is truncated or corrupt.
    """
    from specdraft.models import quant

    try:
        path = quant.gguf_path(target)
    except SpecdraftError:
        return None  # a transformers directory, tiny, or a GGUF shipped in chunks
    quant.gguf_index(path)  # a truncated or corrupt file: one error line, whatever the runtime
    why = next((AUTO_KEEPS_BF16[n] for n in needs if n in AUTO_KEEPS_BF16), None)
    if why is None and "avx2" not in quant.variants():
        why = "this CPU has no AVX2 for the quantized kernels"
    if why is None:
        try:
            return quant.QuantRuntime(path)
        except SpecdraftError as e:  # K-quants, F16 matrices, another architecture, no gcc
            why = str(e)
    print(f"--dtype auto: bf16, not the GGUF's quantized blocks: {why}", file=sys.stderr)
    return None


def run_batch(
    pipe: Pipeline, prompts: list[list[int]], *, max_new_tokens: int, k=5, params=SamplingParams()
) -> tuple[list[list[int]], SpecStats]:
    """Decode several prompts together (ragged batch); returns tokens per prompt and the stats."""
    engine = pipe.engine(k)
    reqs = [Request(p, max_new_tokens, params, pipe.eos_ids) for p in prompts]
    return decode_requests(engine, reqs), engine.stats


__all__ = ["Pipeline", "SamplingParams", "StepEvent", "load", "make_drafter", "run_batch"]
