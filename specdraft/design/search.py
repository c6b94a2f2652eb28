"""Which layers to keep: a search that maximises the analytic model's predicted throughput.

For a candidate layer subset the search needs two numbers:

- ``alpha``, the per-token acceptance. With greedy decoding a draft token is accepted iff it equals
  the target's argmax given the target's own prefix, so alpha is the draft's teacher-forced
  agreement with the target's answers on calibration prompts (training prompts, never Spec-Bench).
- latencies: ``T_draft`` (one draft token at depth d; it depends on the depth, not on which
  layers) and ``T_target(n)`` (the target scoring n tokens), measured together by
  :func:`specdraft.bench.profile.measure_latency`.

:func:`specdraft.analytic.throughput` combines them (E[tokens | k] / (k T_draft + T_target(k + 1)),
maximised over k). The subset search is a beam search: the best ``beam`` subsets of depth d are
extended by every unused layer (kept in the target's order) to depth d + 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from specdraft import analytic
from specdraft.bench.profile import DraftLatencies, measure_latency
from specdraft.design.data import TargetData
from specdraft.models.llama import LlamaWeights
from specdraft.models.runtime import compact_runtime


@torch.inference_mode()
def agreement(runtime, data: TargetData, head: torch.Tensor | None = None) -> float:
    """Teacher-forced agreement of ``runtime`` with the target's answers in ``data`` (0..1).

    Args:
        runtime: a compact runtime (e.g. ``compact_runtime(w, layer_ids)``).
        data: calibration sequences (prompt + the target's answer).
        head: if given, the draft may only predict these ids (argmax over the subset).
    """
    hit = total = 0
    for tokens, P in zip(data.tokens, data.prompt_lens):
        S = tokens.shape[0]
        state = runtime.new_state(1, S)
        idx = torch.arange(P - 1, S - 1).unsqueeze(0)  # (1, R) positions that predict the answer
        positions = torch.arange(S - 1).unsqueeze(0)
        logits = runtime.forward(state, tokens[:-1].unsqueeze(0), positions, logits_index=idx).logits[0]
        pred = logits[:, head].argmax(-1) if head is not None else logits.argmax(-1)
        pred = head[pred] if head is not None else pred
        hit += int((pred == tokens[P:]).sum())
        total += S - P
    return hit / total if total else 0.0


def predict(alpha: float, t_draft: float, t_target, k_max: int = 8) -> dict:
    """Best k and predicted throughput / speedup for one draft."""
    k = analytic.best_k(alpha, t_draft, t_target, k_max)
    return {
        "k": k,
        "tokens_per_s": analytic.throughput(alpha, k, t_draft, t_target),
        "speedup": analytic.speedup(alpha, k, t_draft, t_target),
        "mean_accepted_length": analytic.expected_tokens(alpha, k),
    }


@dataclass
class Candidate:
    """One evaluated layer subset."""

    layers: list[int]
    alpha: float
    t_draft: float
    k: int
    tokens_per_s: float
    speedup: float
    mean_accepted_length: float

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def search_layers(
    weights: LlamaWeights,
    calib: TargetData,
    *,
    max_depth: int = 4,
    beam: int = 1,
    k_max: int = 8,
    latency: DraftLatencies | None = None,
    extra: list[list[int]] | None = None,
    log=None,
) -> list[Candidate]:
    """Beam search over layer subsets of depth 1..max_depth, scored by predicted throughput.

    Args:
        weights: the target's weights (drafts share them; nothing is copied).
        calib: the target's answers to calibration (training) prompts.
        max_depth: deepest subset considered.
        beam: subsets kept per depth and extended.
        k_max: largest draft length the prediction considers.
        latency: measured latencies; measured here when None.
        extra: subsets evaluated as well (default: the first d - 1 layers plus the last, for each d,
            the shape a greedy search misses: the last layer alone hurts, with a few early ones it helps).
            With ``beam = 0`` only these are evaluated.
        log: called with a line per evaluated candidate.

    Returns:
        Every evaluated candidate, best predicted throughput first.
    """
    n = len(weights.layers)
    if extra is None:
        extra = [list(range(d - 1)) + [n - 1] for d in range(2, max_depth + 1)]
    depths = sorted({len(x) for x in extra} | (set(range(1, max_depth + 1)) if beam else set()))
    target = compact_runtime(weights)  # Llama or Gemma 3 layers, by the weights' family
    if latency is None:
        drafts = {f"depth{d}": compact_runtime(weights, list(range(d))) for d in depths}
        latency = measure_latency(target, drafts)
    t_target = latency.curve().time
    evaluated: dict[tuple, Candidate] = {}

    def score(layers: tuple[int, ...]) -> Candidate:
        if layers not in evaluated:
            t_draft = latency.draft[f"depth{len(layers)}"]
            alpha = agreement(compact_runtime(weights, list(layers)), calib)
            c = Candidate(list(layers), alpha, t_draft, **predict(alpha, t_draft, t_target, k_max))
            evaluated[layers] = c
            if log:
                log(f"layers {list(layers)}: alpha {alpha:.3f}, predicted {c.speedup:.2f}x at k={c.k}")
        return evaluated[layers]

    for layers in extra:
        score(tuple(layers))
    frontier: list[tuple[int, ...]] = [()]
    for depth in range(1, max_depth + 1) if beam else ():
        cands = {tuple(sorted(f + (i,))) for f in frontier for i in range(n) if i not in f}
        scored = sorted((score(c) for c in sorted(cands)), key=lambda c: -c.alpha)
        frontier = [tuple(c.layers) for c in scored[:beam]]
    return sorted(evaluated.values(), key=lambda c: -c.tokens_per_s)
