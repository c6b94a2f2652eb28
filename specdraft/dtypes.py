"""Precision names: one table for every ``--dtype``-like option and the Python API.

Each name maps to a torch dtype (None where the name is decided later: ``auto``, ``same``, ``q``)
and lists the roles that accept it, with what it means there. A role is one option:

- ``target``: ``--dtype``, the target's precision (:func:`specdraft.api.resolve_dtype`);
- ``draft``: ``--draft-dtype``, the draft's precision (never changes the output);
- ``gen``: ``specdraft design --gen-dtype``, the target's weights when it answers training prompts;
- ``study-target`` and ``study-draft``: ``specdraft study --dtype`` and ``--draft-dtype``.

The options' ``choices`` and ``help`` come from :func:`choices` and :func:`help_text`, so a new
precision is one entry here. ``bfloat16`` and ``float32`` are accepted by the Python API only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DType:
    """One precision name.

    Attributes:
        torch: the torch dtype it stands for (``torch.qint8``: int8 weights and activations); None
            when it is decided later (``auto`` by the CPU and runtime, ``same`` by the target, ``q``
            by the GGUF file).
        roles: ``{role: what the name means there ("" for nothing to add)}`` for every role that
            accepts it.
    """

    torch: torch.dtype | None
    roles: dict[str, str] = field(default_factory=dict)


ROLES = {
    "target": "target precision",
    "draft": "draft precision (never changes the output)",
    "gen": "weights the target answers with when generating data",
    "study-target": "target dtype",
    "study-draft": "draft precision",
}
"""role -> the first words of its option's help."""

_ALL = {"target": "", "draft": "", "gen": "", "study-target": "", "study-draft": ""}

DTYPES: dict[str, DType] = {
    "auto": DType(
        None,
        {
            "target": "a quantized GGUF (Q4_0/Q4_1/Q8_0, such as smollm2-135m's) runs on its own blocks "
            "(the quantized runtime) unless the run needs the transformers model (prune: drafts "
            "at --draft-dtype bf16/fp32/int8, --baselines hf, attack); else bf16 (without native "
            "bf16: bf16 weights with fp32 arithmetic through the native kernels; fp32 without them "
            "or with --runtime hf)",
            "draft": "q for prune: drafts beside a quantized target, else bf16 where native or run "
            "by the native kernels, else int8",
            "study-target": "bf16 where native or run by the few-row kernel, else fp32",
        },
    ),
    "same": DType(
        None,
        {
            "gen": "the --dtype runtime's",
            "study-draft": "the target's; layer-pruned drafts then share its weights",
        },
    ),
    "bf16": DType(torch.bfloat16, {**_ALL, "gen": "runs the native kernels, half the weight bytes of fp32"}),
    "fp32": DType(torch.float32, dict(_ALL)),
    # int8 weights and per-row int8 activations (fbgemm), float32 elsewhere: the fast CPU runtime
    # where bf16 is not native. Compact runtime only; a draft precision (a target would not be exact).
    "int8": DType(torch.qint8, {"draft": "", "study-draft": ""}),
    "q": DType(
        None,
        {
            "target": "a GGUF target's own quantized blocks (Q4_0/Q4_1/Q8_0, the quantized runtime) "
            "whatever the run",
            "draft": "GGUF blocks beside a quantized target: prune: drafts run the target's own, "
            "designed drafts Q8_0 blocks made at load, a GGUF draft model its own",
        },
    ),
    "bfloat16": DType(torch.bfloat16),
    "float32": DType(torch.float32),
}


QUANT = "q"
"""The draft precision ``q`` as :class:`specdraft.registry.Target` carries it (it has no torch dtype):
the draft runs on GGUF blocks in :class:`specdraft.models.quant.QuantRuntime`."""

AUTO_QUANT_DRAFTS: dict[str, str] = {
    "prune": "a layer-pruned draft runs the quantized target's own layers (no bf16 copy of them)",
    "designed": "a token-level or feature designed draft runs as Q8_0 blocks made at load (dream, ctc, "
    "diffusion and flex drafts have no quantized path and keep bf16)",
}
"""Draft kinds that ``--draft-dtype auto`` runs on GGUF blocks (``q``) beside a quantized target ->
why (:func:`specdraft.api.draft_precision`). Other kinds keep the ``auto`` of
:func:`specdraft.api.resolve_dtype`. Measured on a quiet 2-core Zen 3, 2 threads, one process, in
turn (``results/quant-draft-2026-12-02/quant_draft_t2.txt``, ``benchmarks/bench_quant_draft.py``): draft
step 1.41 ms on Q8_0 blocks against 1.67 ms in bf16 for ``designed:smollm2-135m-l2``, 1.50 against
2.37 ms for ``prune:0,1,2,29,head=8192`` (target step 7.14 ms); peak RSS of ``specdraft generate``
413 against 737 MB and 382 against 1546 MB (``rss_t2.txt``). The feature draft F on Q8_0 blocks, k = 1:
1.018x and 1.044x plain decoding against 0.991x and 1.022x in bf16 (AMD EPYC Zen 2, 2 threads,
``results/feature-q8-2026-12-05/README.md``)."""

AUTO_KEEPS_BF16: dict[str, str] = {
    "prune": "a layer-pruned draft at --draft-dtype bf16, fp32 or int8 runs the target's own layers "
    "in the compact runtime",
    "hf": "the transformers baselines run the target's transformers model",
    "attack": "the attack differentiates the target's transformers model",
    "design": "designing a draft reads and trains from the target's transformers model",
}
"""What makes ``--dtype auto`` keep bf16 for a quantized GGUF (a draft kind, a bench baseline, a
command) -> the reason, logged in one line. ``prune`` counts only with a dense ``--draft-dtype``
(auto and q run the target's own blocks). Designed drafts load the transformers model on demand
(they share its embedding) and keep the quantized target; at ``--draft-dtype q`` they read the
GGUF's embedding instead."""


def choices(role: str) -> list[str]:
    """The names ``role`` accepts, in table order."""
    if role not in ROLES:
        raise ValueError(f"unknown dtype role {role!r}: one of {', '.join(ROLES)}")
    return [name for name, d in DTYPES.items() if role in d.roles]


def help_text(role: str) -> str:
    """``--help`` for the role's option: its purpose, then each name that needs a word."""
    notes = [f"{name}: {DTYPES[name].roles[role]}" for name in choices(role) if DTYPES[name].roles[role]]
    return "; ".join([ROLES[role], *notes])


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of ``name`` (None for ``auto``, ``same`` and ``q``); KeyError when unknown."""
    return DTYPES[name].torch
