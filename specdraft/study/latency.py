"""Latency tables for the sweep, measured with :mod:`specdraft.bench.profile`.

The profiler measures ``T_target(b, n)`` and ``T_draft(b)`` at one context length. A sweep's rows
decode at many context lengths (a Spec-Bench ``qa`` prompt is ~40 tokens, a ``rag`` one ~800) and
at batch sizes that shrink as rows finish, so :class:`Latencies` holds profiles at a few context
lengths and interpolates linearly between them, in context (attention cost is linear in it) and in
batch size (between the measured sizes), clamped to the measured range: profile at the shortest and
longest context a sweep decodes at. In n each profile's :class:`specdraft.analytic.LatencyCurve`
reads T_target (linear beyond the measured n). A proposal of c draft forwards costs ``T_draft(b)``
plus ``(c - 1) T_next(b)``, and every step the engine's own work ``T_engine(b)`` (plain steps: the
target's profile; speculative steps: the draft's). Nothing here times anything itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

from specdraft.analytic import interp
from specdraft.bench.profile import LatencyProfile, engine_overhead, profile_latency


@dataclass
class Latencies:
    """The target's and every draft's step latencies at several context lengths.

    Attributes:
        target: ``{context: profile}`` of the target (``t_target[b][n]`` for n = 1..k_max + 1).
        drafts: ``{draft spec: {context: profile}}`` (``t_draft[b]``, and the step breakdown).
        draft_kinds: ``{draft spec: "model" | "lookup" | "block"}``: a model draft runs k forwards per
            step, a block draft (:mod:`specdraft.drafters.diffusion`) one forward per block, a lookup
            draft one search.
    """

    target: dict[int, LatencyProfile]
    drafts: dict[str, dict[int, LatencyProfile]] = field(default_factory=dict)
    draft_kinds: dict[str, str] = field(default_factory=dict)

    def target_time(self, batch: int, n: int, context: int) -> float:
        """T_target(batch, n) at ``context`` tokens, seconds."""
        return interp({c: p.curve.time(n, batch) for c, p in self.target.items()}, context)

    def draft_time(self, draft: str, batch: int, context: int, calls: int = 1) -> float:
        """Seconds of a proposal of ``calls`` draft steps of ``draft`` for ``batch`` rows at
        ``context`` tokens: T_draft(batch) for the first, and each further draft forward of a model
        drafter what its profile measured it to add (``t_draft_next``)."""

        def proposal(p: LatencyProfile) -> float:
            first = interp(p.t_draft, batch)
            return first + (calls - 1) * (interp(p.t_draft_next, batch) if p.t_draft_next else first)

        return interp({c: proposal(p) for c, p in self.drafts[draft].items()}, context) if calls else 0.0

    def engine_time(self, draft: str | None, batch: int) -> float:
        """Seconds of the engine's own work in a step of ``batch`` rows (``t_engine``): a speculative
        step with ``draft``, a plain one for None; 0 where the profiles did not measure it."""
        profiles = self.target if draft is None else self.drafts[draft]
        measured = [p.t_engine for _, p in sorted(profiles.items()) if p.t_engine]
        return interp(measured[0], batch) if measured else 0.0

    def draft_calls(self, draft: str, k: int) -> int:
        """Draft steps per speculative step: k for a model draft, one forward for a block draft, one
        search for prompt lookup."""
        return min(k, 1) if self.draft_kinds.get(draft) in ("lookup", "block") else k

    def breakdown(self, draft: str) -> dict[str, float]:
        """Where a batch-1 draft step's time goes (the profile at the shortest context that has one)."""
        for c in sorted(self.drafts.get(draft, {})):
            if self.drafts[draft][c].draft_breakdown:
                return dict(self.drafts[draft][c].draft_breakdown)
        return {}

    def as_dict(self) -> dict:
        return {
            "target": {str(c): p.as_dict() for c, p in self.target.items()},
            "drafts": {d: {str(c): p.as_dict() for c, p in ps.items()} for d, ps in self.drafts.items()},
            "draft_kinds": dict(self.draft_kinds),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Latencies:
        return cls(
            target={int(c): LatencyProfile.from_dict(p) for c, p in d["target"].items()},
            drafts={
                k: {int(c): LatencyProfile.from_dict(p) for c, p in ps.items()}
                for k, ps in d.get("drafts", {}).items()
            },
            draft_kinds=dict(d.get("draft_kinds", {})),
        )


def draft_kind(drafter) -> str:
    """``model`` (k forwards per step), ``block`` (one forward per block, ``drafts_blocks``) or
    ``lookup`` (one search)."""
    if getattr(drafter, "drafts_blocks", False):
        return "block"
    return "model" if getattr(drafter, "runtime", None) is not None else "lookup"


def draft_shape(drafter) -> dict | None:
    """A compact-runtime model draft's shape: layers, attention heads, FFN width, LM-head rows and
    parameter counts (layers' matrices; head rows x hidden size). None for other drafters (lookup,
    quantized blocks, transformers drafts), whose shapes the study does not compare."""
    from specdraft.bench.profile import compact_of
    from specdraft.models.llama import LlamaRuntime

    runtime = getattr(drafter, "runtime", None)
    rt = compact_of(runtime)
    if not isinstance(rt, LlamaRuntime) or getattr(drafter, "drafts_blocks", False):
        return None
    w = rt.w
    return {
        "layers": len(rt.layers),
        "query_heads": w.n_heads,
        "kv_heads": w.n_kv_heads,
        "ffn": int(rt.layers[0].w_down.shape[1]),
        "head_rows": rt.vocab_size,  # a designed draft's subset head: its N rows
        "layer_parameters": sum(
            t.numel() for lw in rt.layers for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)
        ),
        "head_parameters": rt.vocab_size * int(w.embed.shape[1]),
    }


def measure_target(
    runtime, *, batch_sizes, k_max: int, contexts, repeats: int = 7, warmup: int = 2, name: str = "target"
) -> dict[int, LatencyProfile]:
    """Profile T_target(b, n), n = 1..k_max + 1, at each context length."""
    out = {
        c: profile_latency(
            runtime,
            None,
            batch_sizes=batch_sizes,
            new_tokens=range(1, k_max + 2),
            context=c,
            repeats=repeats,
            warmup=warmup,
            breakdown=False,
            target_name=name,
        )
        for c in contexts
    }
    out[min(out)].t_engine = engine_overhead(runtime, batch_sizes=batch_sizes, context=min(out))
    return out


@contextlib.contextmanager
def _quiet_stderr_fd():
    """Silence file descriptor 2 (torch.profiler's C++ side prints a line per profiled step)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _stand_in(runtime, drafter):
    """A cheap runtime for the profiler's target slot while it times a draft.

    The profiler always times target forwards too (it prefills ``b x context`` tokens for each
    batch size first); a draft's profile only needs ``t_draft``, so the slot gets the target's
    first layer alone (a compact target, through :func:`specdraft.models.runtime.compact_runtime`:
    a Gemma 3 layer for a Gemma 3 target), which costs a thirtieth of the target's prefill.
    """
    from specdraft.models.llama import LlamaRuntime
    from specdraft.models.runtime import compact_runtime

    if isinstance(runtime, LlamaRuntime):
        return compact_runtime(runtime.w, runtime.layer_ids[:1])
    return getattr(drafter, "runtime", None) or runtime


def measure_draft(
    runtime,
    drafter,
    spec: str,
    *,
    batch_sizes,
    contexts,
    repeats: int = 7,
    warmup: int = 2,
    name: str = "target",
) -> dict[int, LatencyProfile]:
    """Profile T_draft(b) at each context length (the step breakdown at the first one).

    Only ``t_draft`` of these profiles is used (see :func:`_stand_in`)."""
    contexts = sorted(contexts)
    runtime = _stand_in(runtime, drafter)
    out = {}
    for c in contexts:
        quiet = _quiet_stderr_fd() if c == contexts[0] else contextlib.nullcontext()
        with quiet:
            out[c] = profile_latency(
                runtime,
                drafter,
                batch_sizes=batch_sizes,
                new_tokens=(1,),
                context=c,
                repeats=repeats,
                warmup=warmup,
                breakdown=c == contexts[0],
                target_name=name,
                draft_name=spec,
            )
    first = out[contexts[0]]
    first.t_engine = engine_overhead(runtime, drafter, batch_sizes=batch_sizes, context=contexts[0])
    return out
