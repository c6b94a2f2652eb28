"""Draft specs and the drafter registry: the one place a ``--draft`` string is parsed and built.

A draft spec is ``KIND`` or ``KIND:ARG`` (``lookup:3``, ``prune:0,1,2,29``, ``designed:NAME``); any
string that names no registered kind is a draft model (an alias or a path). :class:`DraftSpec`
parses and validates it, without loading anything, so every command can refuse a bad spec before
the target loads; :func:`build_drafter` builds the drafter through the kind's factory
(:func:`specdraft.api.make_drafter` and every command go through it).

Adding a drafter is one file under ``specdraft/drafters/`` with a ``from_spec(spec, target)``
factory, and one line in :data:`DRAFTERS` (``specdraft/drafters/bigram.py`` is the example the
README walks through). Factories are imported on first use, so parsing a spec loads no drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdraft.errors import SpecdraftError

DEFAULT_DRAFT = "lookup"  # measured fastest on this project's CPUs (README, drafter table)


def _no_arg(kind: str, arg: str) -> str:
    if arg:
        raise SpecdraftError(f"draft {kind!r} takes no argument, got {kind}:{arg}")
    return arg


def _positive_int(kind: str, arg: str) -> str:
    if arg and (not arg.isdigit() or int(arg) < 1):
        raise SpecdraftError(f"bad draft spec {kind}:{arg}: use {kind} or {kind}:N with N >= 1")
    return arg


def _layer_list(kind: str, arg: str) -> str:
    parts = [x.strip() for x in arg.split(",") if x.strip()]
    head = parts.pop() if parts and parts[-1].startswith("head=") else None  # a smaller LM head
    try:
        layers = [int(x) for x in parts]
    except ValueError:
        layers = []
    bad_head = head is not None and not (head[5:].isdigit() and int(head[5:]) >= 1)
    if bad_head or not layers or min(layers) < 0 or len(set(layers)) != len(layers):
        raise SpecdraftError(
            f"bad draft spec {kind}:{arg}: use {kind}:0,1,2,29 (distinct layer indices >= 0), "
            f"optionally ending with head=N (N >= 1)"
        )
    return ",".join([*map(str, layers), *([f"head={int(head[5:])}"] if head else [])])


def _any(kind: str, arg: str) -> str:
    return arg


def _designed_arg(kind: str, arg: str) -> str:
    name = arg.removeprefix("designed:")
    if not arg.startswith("designed:") or name in ("", "auto"):
        raise SpecdraftError(
            f"bad draft spec {kind}:{arg}: use {kind}:designed:NAME (a feature or dream draft)"
        )
    return arg


def _diffusion_arg(kind: str, arg: str) -> str:
    name, _, opt = arg.partition(",")
    if name.removeprefix("designed:") in ("", "auto") or opt not in ("", "fixed"):
        raise SpecdraftError(f"bad draft spec {kind}:{arg}: use {kind}:NAME[,fixed] (a diffusion draft)")
    return arg


def _suffix_options(kind: str, arg: str) -> str:
    opts = [o for o in arg.split(",") if o]
    if any(not (o in ("shared", "chain") or (o.isdigit() and int(o) >= 1)) for o in opts):
        raise SpecdraftError(f"bad draft spec {kind}:{arg}: use {kind}[:N][,shared][,chain] with N >= 1")
    return arg


def _has_value(option: str, prefixes: tuple[str, ...]) -> bool:
    """``option`` is ``PREFIX=VALUE`` for one of ``prefixes`` with a non-empty value."""
    return any(option.startswith(p) and len(option) > len(p) for p in prefixes)


def _ouroboros_options(kind: str, arg: str) -> str:
    opts = [o for o in arg.split(",") if o]
    valued = ("warm=", "draft=")
    if any(not (o in ("lookup", "shared", "chain") or _has_value(o, valued)) for o in opts) or (
        "lookup" in opts and any(o.startswith("draft=") for o in opts)
    ):
        raise SpecdraftError(
            f"bad draft spec {kind}:{arg}: use {kind}[:lookup|draft=NAME][,shared][,warm=PATH][,chain] "
            "(the base draft: prompt lookup, the designed draft NAME, or designed:auto)"
        )
    return arg


TREE_INNER = ("designed", "local", "prune", "self", "model")  # kinds that draft with a model or features
TREE_USAGE = "tree:[dyn[=W]|static[=BxD],]DRAFT"


def tree_parts(arg: str) -> tuple[str, tuple[int, int], str]:
    """``tree:`` spec argument -> ``(shape, numbers, inner spec)``. ``dyn=W`` (the default, W = 2):
    the W most probable nodes of each depth expanded with their top W, reranked to k nodes
    (EAGLE-2); ``static=BxD`` (default 2x2): the draft's greedy chain with its top B at each of
    the first D depths. Numbers: ``(W, W)`` or ``(B, D)``."""
    head, _, rest = arg.partition(",")
    name, _, nums = head.partition("=")
    if name not in ("dyn", "static"):
        name, nums, rest = "dyn", "", arg
    default = "2" if name == "dyn" else "2x2"
    parts = (nums or default).split("x")
    want = 1 if name == "dyn" else 2
    if len(parts) != want or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) < 2:
        raise SpecdraftError(f"bad tree shape {head!r}: use dyn=W or static=BxD (W, B >= 2, D >= 1)")
    a = int(parts[0])
    return name, (a, a if name == "dyn" else int(parts[1])), rest


def _tree_arg(kind: str, arg: str) -> str:
    shape, nums, inner = tree_parts(arg)
    spec = DraftSpec.parse(inner) if inner else None
    if spec is None or spec.kind not in TREE_INNER:
        raise SpecdraftError(
            f"bad draft spec {kind}:{arg}: use {TREE_USAGE} with a model or feature draft "
            f"({', '.join(TREE_INNER[:-1])}, or a model alias/path)"
        )
    n = f"{nums[0]}" if shape == "dyn" else f"{nums[0]}x{nums[1]}"
    return f"{shape}={n},{spec}"


def _layer_index(kind: str, arg: str) -> str:
    if arg and not arg.isdigit():
        raise SpecdraftError(f"bad draft spec {kind}:{arg}: use {kind} or {kind}:S with a layer index S >= 0")
    return arg


@dataclass(frozen=True)
class DrafterKind:
    """One registered kind of drafter.

    Attributes:
        build: ``build(spec, target) -> Drafter | None``; ``target`` is a
            :class:`~specdraft.registry.Target` (loaded model, runtime, draft dtype).
        check: ``check(kind, arg) -> arg``: validates (and normalises) the argument; raises
            :class:`SpecdraftError` with one line.
        usage: how the spec is written, for ``--help`` and error messages.
    """

    build: Callable
    check: Callable[[str, str], str]
    usage: str


@dataclass(frozen=True)
class Target:
    """What a factory may use to build a drafter for a target.

    Attributes:
        loaded: the target's :class:`~specdraft.models.loading.LoadedModel` (model, tokenizer).
        runtime: the target's runtime.
        dtype: the draft's precision (``torch.dtype``; ``torch.qint8`` for int8; the string
            :data:`specdraft.dtypes.QUANT` for GGUF blocks beside a quantized target).
    """

    loaded: object
    runtime: object
    dtype: object


@dataclass(frozen=True)
class DraftSpec:
    """A parsed ``--draft`` string.

    Attributes:
        kind: a key of :data:`DRAFTERS`, or ``"model"`` for a draft model given by alias or path.
        arg: the part after the colon (normalised by the kind's check), or the alias / path.
    """

    kind: str
    arg: str = ""

    @classmethod
    def parse(cls, text: str | DraftSpec | None) -> DraftSpec:
        """``"lookup:3"`` -> ``DraftSpec("lookup", "3")``; ``default`` or empty -> the default draft."""
        if isinstance(text, DraftSpec):
            return text
        text = (text or "default").strip()
        if text == "default":
            text = DEFAULT_DRAFT
        kind, _, arg = text.partition(":")
        if kind not in DRAFTERS or kind == "model":
            return cls("model", text)
        return cls(kind, DRAFTERS[kind].check(kind, arg))

    def __str__(self) -> str:
        if self.kind == "model":
            return self.arg
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    @property
    def layers(self) -> list[int]:
        """The layer indices of a ``prune:`` spec."""
        return [int(x) for x in self.arg.split(",") if x.isdigit()] if self.kind == "prune" else []

    @property
    def head(self) -> int | None:
        """A ``prune:...,head=N`` spec's head size N (None: the target's whole head)."""
        last = self.arg.rsplit(",", 1)[-1] if self.kind == "prune" else ""
        return int(last[5:]) if last.startswith("head=") else None


def build_drafter(spec: str | DraftSpec | None, target: Target):
    """The drafter for ``spec`` (None for plain decoding)."""
    spec = DraftSpec.parse(spec)
    return DRAFTERS[spec.kind].build(spec, target)


def usage() -> str:
    """One line listing every spec form, for ``--draft``'s help."""
    return " | ".join(["default", *(k.usage for k in DRAFTERS.values())])


def _lazy(module: str, name: str = "from_spec") -> Callable:
    """A factory imported on first use, so that parsing a spec loads no drafter code."""

    def build(spec, target):
        import importlib

        return getattr(importlib.import_module(module), name)(spec, target)

    return build


# kind -> factory, argument check, usage. A new drafter adds one line here.
DRAFTERS: dict[str, DrafterKind] = {
    "none": DrafterKind(lambda spec, target: None, _no_arg, "none"),
    "lookup": DrafterKind(_lazy("specdraft.drafters.prompt_lookup"), _positive_int, "lookup[:N]"),
    "lookup-tree": DrafterKind(_lazy("specdraft.drafters.lookup_tree"), _positive_int, "lookup-tree[:N]"),
    "self": DrafterKind(_lazy("specdraft.drafters.model", "self_from_spec"), _no_arg, "self"),
    "prune": DrafterKind(
        _lazy("specdraft.design.prune", "drafter_from_spec"), _layer_list, "prune:0,1,2,29[,head=N]"
    ),
    "designed": DrafterKind(
        _lazy("specdraft.design.artifact", "drafter_from_spec"), _any, "designed[:NAME|PATH|auto]"
    ),
    "bigram": DrafterKind(_lazy("specdraft.drafters.bigram"), _no_arg, "bigram"),
    "local": DrafterKind(
        _lazy("specdraft.design.artifact", "local_drafter_from_spec"), _designed_arg, "local:designed:NAME"
    ),
    "diffusion": DrafterKind(
        _lazy("specdraft.design.diffusion", "drafter_from_spec"), _diffusion_arg, "diffusion:NAME[,fixed]"
    ),
    "suffix": DrafterKind(_lazy("specdraft.drafters.suffix"), _suffix_options, "suffix[:N][,shared][,chain]"),
    "ouroboros": DrafterKind(
        _lazy("specdraft.drafters.ouroboros"),
        _ouroboros_options,
        "ouroboros[:lookup|draft=NAME][,shared][,warm=PATH][,chain]",
    ),
    "tree": DrafterKind(_lazy("specdraft.drafters.topk_tree"), _tree_arg, TREE_USAGE),
    "flex": DrafterKind(_lazy("specdraft.drafters.flex"), _layer_index, "flex[:SPLIT]"),  # untrained
    "model": DrafterKind(_lazy("specdraft.drafters.model", "model_from_spec"), _any, "MODEL_ALIAS|PATH"),
}
