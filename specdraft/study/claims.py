"""The seed study's claims beside this study's figures: the "Seed claims" section of REPORT.md.

The seed is Yan, Agarwal and Venkataraman, "Decoding Speculative Decoding" (NAACL 2025, arXiv
2402.01528): over 350 experiments with LLaMA-65B and OPT-66B on GPUs. :data:`PAPER` quotes its
claims (the abstract's words; the +111% is its one headline number). Each row of the table computes
this study's figure for one claim from the study's rows, with a verdict.

Drafts are grouped by how they were made (:func:`origin`):

* ``trained``: ``designed:`` drafts, distilled from the target by ``specdraft design build``;
* ``existing``: what a user has without training: the target's layers pruned (``prune:``) or
  another model given by name or path. SmolLM2-135M and Gemma-3-270M are the smallest models of
  their families, so no smaller sibling with the same tokenizer exists: the pruned drafts stand in
  for the paper's off-the-shelf drafts (which were trained language models; ours are not);
* ``model-free``: lookup and its kin, which have no latency or quality to compare.

Rank correlations carry 95% percentile-bootstrap intervals (drafts resampled with replacement,
2000 resamples, fixed seed): with ten drafts the intervals are wide, and the table says so.
Speedups are the study's predictions at each draft's best fixed k (the cost-aware policy off).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from specdraft.errors import SpecdraftError
from specdraft.registry import DraftSpec
from specdraft.study.report import _fmt, _plt, _table, short_name, spearman

PAPER = {
    "latency": "speculative decoding's performance depends heavily on the draft's latency "
    "(LLaMA-65B, OPT-66B, GPUs)",
    "quality": "the draft's language-modelling capability does not correlate strongly with its "
    "speculative-decoding performance",
    "depth": "draft latency is bottlenecked by depth: a wider, shallower pruned draft (NoFT-Wide-796M) "
    "is faster at similar size",
    "designed": "the designed draft gives 111% higher throughput (2.11x) than existing drafts (LLaMA-65B)",
    "generalises": "the design generalises to the LLaMA-2 family and to supervised fine-tuned models",
}
SEED_GAIN = 2.11  # the paper's designed / existing throughput
BOOTSTRAP_REPS = 2000


def origin(spec: str) -> str:
    """``trained``, ``existing`` or ``model-free`` (module docstring)."""
    try:
        kind = DraftSpec.parse(spec).kind
    except SpecdraftError:
        return "existing"
    if kind == "designed":
        return "trained"
    return "existing" if kind in ("prune", "model") else "model-free"


def bootstrap_spearman(
    x: list[float], y: list[float], reps: int = BOOTSTRAP_REPS, seed: int = 0
) -> tuple[float, float] | None:
    """95% percentile-bootstrap interval of Spearman's rho over the (x, y) pairs; None below 4
    pairs. Resamples whose x or y ranks are all tied have no rho and are skipped."""
    if len(x) != len(y) or len(x) < 4:
        return None
    rng = np.random.default_rng(seed)
    rhos = []
    for _ in range(reps):
        idx = rng.integers(0, len(x), len(x))
        xs, ys = [x[i] for i in idx], [y[i] for i in idx]
        if len(set(xs)) > 1 and len(set(ys)) > 1:
            rhos.append(spearman(xs, ys))
    if len(rhos) < reps // 2:
        return None
    lo, hi = np.percentile(rhos, [2.5, 97.5])
    return float(lo), float(hi)


def shapes(st) -> dict[str, dict]:
    """``{draft spec: shape}`` from the study's latency rows (``draft_shape``, model drafts only)."""
    return {r["draft"]: r["draft_shape"] for r in st.latency if r.get("draft") and r.get("draft_shape")}


def _rho(x: list[float], y: list[float]) -> tuple[float | None, tuple[float, float] | None, str]:
    """Spearman's rho, its bootstrap interval, and both as table text."""
    rho, ci = spearman(x, y), bootstrap_spearman(x, y)
    interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else " (no interval: fewer than 4 drafts)"
    return rho, ci, f"{_fmt(rho)}{interval}"


def _latency_row(st, trained: list) -> list[str]:

    b1 = min(st.batches)
    lat = [d.t_draft_ms for d in trained]
    sp = [d.best_speedup[b1] for d in trained]
    ppl = [math.log(d.perplexity) for d in trained if d.perplexity]
    rho_lat, ci, text = _rho(lat, sp)
    rho_ppl = spearman(ppl, sp) if len(ppl) == len(trained) else None
    all_lat, all_sp = [d.t_draft_ms for d in st.drafts], [d.best_speedup[b1] for d in st.drafts]
    if rho_lat is None:
        verdict = "cannot be judged (fewer than 3 trained drafts)"
    else:
        stronger = rho_ppl is None or abs(rho_lat) > abs(rho_ppl)
        sure = ci is not None and (ci[1] < 0 or ci[0] > 0)
        verdict = (
            "holds" if stronger and sure else ("weakly: interval spans 0" if stronger else "does not hold")
        )
    here = (
        f"Spearman(T_draft, speedup) = {text} over {len(trained)} trained drafts, batch {b1}; "
        f"over all {len(st.drafts)} drafts {_rho(all_lat, all_sp)[2]}"
    )
    return [
        "Throughput depends mainly on draft latency",
        PAPER["latency"],
        here,
        verdict,
        "speedup_vs_latency.png",
    ]


def _quality_row(st, trained: list) -> list[str]:

    b1 = min(st.batches)
    rated = [d for d in trained if d.perplexity]
    ppl = [math.log(d.perplexity) for d in rated]
    sp = [d.best_speedup[b1] for d in rated]
    top1 = [d.top1 or 0.0 for d in rated]
    rho, ci, text = _rho(ppl, sp)
    if rho is None:
        verdict = "cannot be judged (fewer than 3 trained drafts with a perplexity)"
    else:
        weak = abs(rho) < 0.5 or (ci is not None and ci[0] < 0 < ci[1])
        verdict = "holds" if weak else "does not hold: perplexity tracks speedup here"
    here = (
        f"Spearman(log perplexity, speedup) = {text} over {len(rated)} trained drafts; "
        f"top-1 agreement vs log perplexity: Spearman {_rho(ppl, top1)[2]}"
    )
    return [
        "Draft quality barely predicts throughput",
        PAPER["quality"],
        here,
        verdict,
        "acceptance_vs_perplexity.png",
    ]


def equal_parameter_groups(st) -> list[list[tuple[dict, object]]]:
    """Trained model drafts grouped by head rows and layer parameters (a group spans at most 10%
    above its smallest draft), each group sorted by depth; only groups with at least two depths
    (the shallow-and-wide vs deep-and-narrow comparison)."""
    shape_of = shapes(st)
    by_head: dict[int, list] = defaultdict(list)
    for d in st.drafts:
        s = shape_of.get(d.draft)
        if s and origin(d.draft) == "trained":
            by_head[s["head_rows"]].append((s, d))
    groups = []
    for drafts in by_head.values():
        drafts.sort(key=lambda sd: sd[0]["layer_parameters"])
        for sd in drafts:
            if (
                groups
                and groups[-1][0][0]["head_rows"] == sd[0]["head_rows"]
                and (sd[0]["layer_parameters"] <= 1.1 * groups[-1][0][0]["layer_parameters"])
            ):
                groups[-1].append(sd)
            else:
                groups.append([sd])
    out = [sorted(g, key=lambda sd: sd[0]["layers"]) for g in groups]
    return [g for g in out if len({s["layers"] for s, _ in g}) > 1]


def _depth_row(st) -> list[str]:
    b1 = min(st.batches)
    groups = equal_parameter_groups(st)
    if not groups:
        return [
            "Depth dominates draft latency",
            PAPER["depth"],
            "no trained drafts of equal size and different depth",
            "cannot be judged",
            "",
        ]
    parts, rising = [], []
    for g in groups:
        s0 = g[0][0]
        cells = ", ".join(
            f"{s['layers']} layers x {s['query_heads']} heads/FFN {s['ffn']}: {d.t_draft_ms:.2f} ms, "
            f"{d.best_speedup[b1]:.2f}x"
            for s, d in g
        )
        parts.append(f"{s0['layer_parameters'] / 1e6:.1f} M, head {s0['head_rows']}: {cells}")
        times = [d.t_draft_ms for _, d in g]
        rising.append(all(a < b for a, b in itertools.pairwise(times)))
    verdict = "holds" if all(rising) else ("partly" if any(rising) else "does not hold")
    return [
        "Depth dominates draft latency (equal parameters)",
        PAPER["depth"],
        "; ".join(parts),
        verdict,
        "depth_vs_width.png",
    ]


def designed_vs_existing(st, batch: int) -> dict | None:
    """The best trained and the best existing draft at ``batch`` (each at its best fixed k) and the
    ratio of their predicted throughputs; None when either group is empty."""
    best = {}
    for group in ("trained", "existing"):
        ds = [d for d in st.drafts if origin(d.draft) == group]
        if not ds:
            return None
        best[group] = max(ds, key=lambda d: d.best_tps[batch])
    t, e = best["trained"], best["existing"]
    return {"trained": t, "existing": e, "ratio": t.best_tps[batch] / e.best_tps[batch]}


def _designed_row(st) -> list[str]:

    cells, ratios = [], []
    for b in st.batches:
        c = designed_vs_existing(st, b)
        if c is None:
            return [
                "Designed draft +111% over existing",
                PAPER["designed"],
                "needs trained and existing drafts",
                "cannot be judged",
                "",
            ]
        t, e = c["trained"], c["existing"]
        ratios.append(c["ratio"])
        cells.append(
            f"b={b}: `{short_name(t.draft)}` k={t.best_k[b]} {t.best_tps[b]:.1f} tok/s vs "
            f"`{short_name(e.draft)}` k={e.best_k[b]} {e.best_tps[b]:.1f} tok/s = {c['ratio']:.2f}x "
            f"(plain {_fmt(st.plain_tps(b), '{:.1f}')} tok/s)"
        )
    top = max(ratios)
    verdict = f"holds ({top:.2f}x >= {SEED_GAIN}x)" if top >= SEED_GAIN else f"not reached: best {top:.2f}x"
    return [
        "Designed draft +111% over existing (fixed k)",
        PAPER["designed"],
        "; ".join(cells),
        verdict,
        "best_per_batch.png",
    ]


def _generalises_row(st) -> list[str]:
    targets = sorted({r["target"] for r in st.rows})
    return [
        "Generalises across families and to instruction-tuned models",
        PAPER["generalises"],
        f"this study: {', '.join(targets)}; compare the rows above with the other family's REPORT.md",
        "see both reports",
        "",
    ]


def plot_depth_vs_width(st, path: Path) -> bool:
    """T_draft(1) against depth, one line per equal-parameter group; False when there is none."""
    groups = equal_parameter_groups(st)
    if not groups:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    b1 = min(st.batches)
    for g in groups:
        s0 = g[0][0]
        xs = [s["layers"] for s, _ in g]
        ys = [d.t_draft_ms for _, d in g]
        ax.plot(
            xs, ys, "o-", label=f"{s0['layer_parameters'] / 1e6:.1f} M layer params, head {s0['head_rows']}"
        )
        for (s, d), x, y in zip(g, xs, ys):
            ax.annotate(
                f"{d.best_speedup[b1]:.2f}x", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft depth (layers; width shrinks as depth grows)")
    ax.set_ylabel("T_draft(1) ms")
    ax.set_title(f"Equal parameters, different depth (labels: predicted speedup, batch {b1})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def section(st, out_dir: Path) -> str:
    """The "Seed claims" section: the table and the depth-vs-width plot (written to ``out_dir``)."""
    trained = [d for d in st.drafts if origin(d.draft) == "trained"]
    rows = [
        _latency_row(st, trained),
        _quality_row(st, trained),
        _depth_row(st),
        _designed_row(st),
        _generalises_row(st),
    ]
    plotted = plot_depth_vs_width(st, out_dir / "depth_vs_width.png")
    return (
        "## Seed claims\n\n"
        'Each claim of Yan et al., "Decoding Speculative Decoding" (NAACL 2025), beside this study\'s '
        'figure (module `specdraft.study.claims`: how drafts are grouped, what "existing" means here). '
        "Brackets: 95% bootstrap intervals over drafts.\n\n"
        + _table(
            ["claim", "paper", "here", "verdict", "plot"],
            [[c, p, h, v, f"[{f}]({f})" if f else ""] for c, p, h, v, f in rows],
        )
        + ("\n\n![depth vs width](depth_vs_width.png)" if plotted else "")
    )


def verdicts(report_text: str) -> list[tuple[str, str]]:
    """``(claim, verdict)`` per row of a REPORT.md's "Seed claims" table (empty when it has none)."""
    _, found, rest = report_text.partition("## Seed claims\n")
    rows = []
    for line in rest.split("\n## ", 1)[0].splitlines() if found else []:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "claim":
            rows.append((cells[0], cells[3]))
    return rows
