"""``specdraft report``: REPORT.md with PNG plots from study results, bench JSON and profiles.

Inputs (any mix, recognised by content):

- study results (``results.jsonl`` from ``specdraft study``): ``config``, ``quality``,
  ``latency`` and ``online`` rows (:mod:`specdraft.study.sweep`);
- bench JSON (``specdraft bench --json``): ``overall``, ``categories``, ``prompts``;
- latency profiles (``specdraft profile`` JSON, :class:`specdraft.bench.profile.LatencyProfile`);
- attack results (``attack.json`` from ``specdraft attack``, :mod:`specdraft.attack.report`).

The report has one section per kind of evidence present, and a *Findings* section whose every
sentence is computed from the data: which claims of the original study (Yan et al., "Decoding
Speculative Decoding", NAACL 2025) hold on this hardware, with the numbers behind each verdict.

Aggregates over datasets are plain means of per-dataset figures (each dataset weighs the same).
Correlations are Pearson (linear) and Spearman (rank; average ranks for ties), computed with
scipy when it is installed and numpy otherwise.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdraft.attack import report as attack_report
from specdraft.durable import read_rows
from specdraft.errors import SpecdraftError
from specdraft.registry import DraftSpec

REPORT = "REPORT.md"


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """Everything the report reads, sorted by kind."""

    config: list[dict] = field(default_factory=list)
    quality: list[dict] = field(default_factory=list)
    latency: list[dict] = field(default_factory=list)
    online: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    bench: list[tuple[Path, dict]] = field(default_factory=list)
    profiles: list[tuple[Path, dict]] = field(default_factory=list)
    attacks: list[tuple[Path, dict]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


def _last_per_config(rows: list[dict], fields: tuple[str, ...]) -> list[dict]:
    """Keep the last row per configuration (a later run of the same configuration wins)."""
    out: dict = {}
    for r in rows:
        out[tuple(r.get(f) for f in fields)] = r
    return list(out.values())


def load_inputs(paths: list[Path]) -> Inputs:
    """Read and classify every input file.

    Raises:
        SpecdraftError: a missing or unrecognised file, a malformed JSONL line (file and line named).
    """
    if not paths:
        raise SpecdraftError(
            "report needs at least one input (study results JSONL, bench JSON or profile JSON)"
        )
    inp = Inputs()
    for path in map(Path, paths):
        if not path.is_file():
            raise SpecdraftError(f"report input not found: {path}")
        inp.files.append(path)
        doc = None
        if path.suffix != ".jsonl":
            try:
                doc = json.loads(path.read_text())
            except json.JSONDecodeError:
                doc = None  # maybe JSON lines under another name
        if isinstance(doc, dict):
            if attack_report.is_attack(doc):
                inp.attacks.append((path, doc))
            elif {"overall", "categories"} <= doc.keys():
                inp.bench.append((path, doc))
            elif "t_target" in doc:
                inp.profiles.append((path, doc))
            elif "kind" in doc:
                _add_rows(inp, [doc])
            else:
                raise SpecdraftError(
                    f"{path}: not a study results file, bench JSON, latency profile or attack.json"
                )
            continue
        _add_rows(inp, read_rows(path))
    inp.config = _last_per_config(inp.config, ("target", "draft", "dataset", "k", "batch"))
    inp.quality = _last_per_config(inp.quality, ("target", "draft", "dataset"))
    inp.online = _last_per_config(inp.online, ("target", "draft", "dataset", "k", "batch"))
    if not (inp.config or inp.bench or inp.profiles or inp.online or inp.attacks):
        raise SpecdraftError("no results in " + ", ".join(map(str, paths)))
    return inp


def _add_rows(inp: Inputs, rows: list[dict]) -> None:
    for r in rows:
        bucket = {
            "config": inp.config,
            "quality": inp.quality,
            "latency": inp.latency,
            "online": inp.online,
            "run": inp.runs,
        }.get(r.get("kind"))
        if bucket is not None:
            bucket.append(r)


# ------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------


def _ranks(x: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their average rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for m in range(i, j + 1):
            ranks[order[m]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson's r; None with fewer than 3 points or a constant variable."""
    if len(x) != len(y) or len(x) < 3:
        return None
    a, b = np.asarray(x, float), np.asarray(y, float)
    if a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho: Pearson's r of the ranks (ties share their average rank)."""
    if len(x) != len(y) or len(x) < 3:
        return None
    return pearson(_ranks(x), _ranks(y))


def short_name(spec: str) -> str:
    """``prune:0,1,2,3,29`` -> ``prune:0-3,29`` (runs of three or more layers as ranges; a
    ``head=N`` option is kept); ``designed:FOLDER/NAME`` -> ``designed:NAME`` (a family's draft)."""
    try:
        parsed = DraftSpec.parse(spec)
    except SpecdraftError:
        return spec
    if parsed.kind == "designed":
        return "designed:" + parsed.arg.rstrip("/").rsplit("/", 1)[-1]
    layers = parsed.layers
    if not layers:
        return spec
    parts, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts += [f"{layers[i]}-{layers[j]}"] if j - i >= 2 else [str(x) for x in layers[i : j + 1]]
        i = j + 1
    return "prune:" + ",".join(parts + ([f"head={parsed.head}"] if parsed.head else []))


def _fmt(x, spec="{:.2f}", none="n/a") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Study aggregates
# ------------------------------------------------------------------------------------------------


@dataclass
class DraftSummary:
    """One draft across datasets.

    Attributes:
        draft: spec.
        kind: ``model`` or ``lookup``.
        t_draft_ms: T_draft(1), milliseconds (median over datasets' contexts).
        t_target_ms: T_target(1, 1), milliseconds (same contexts).
        perplexity / top1: held-out draft quality (None for lookup).
        accepted: mean accepted length at ``k_ref`` (mean over datasets).
        best_k: k with the highest mean predicted throughput, per batch size.
        best_speedup: predicted speedup at that k, per batch size.
        best_tps: predicted tokens/s at that k, per batch size.
    """

    draft: str
    kind: str
    t_draft_ms: float
    t_target_ms: float
    perplexity: float | None
    top1: float | None
    accepted: float
    best_k: dict[int, int]
    best_speedup: dict[int, float]
    best_tps: dict[int, float]


class Study:
    """Config rows indexed for the plots and findings."""

    def __init__(self, inp: Inputs):
        self.rows = inp.config
        self.quality = {q["draft"]: q for q in inp.quality}
        self.online = inp.online
        self.latency = inp.latency
        self.ks = sorted({r["k"] for r in self.rows})
        self.batches = sorted({r["batch"] for r in self.rows})
        self.datasets = sorted({r["dataset"] for r in self.rows})
        self.k_ref = 4 if 4 in self.ks else (self.ks[len(self.ks) // 2] if self.ks else 0)
        self.cells: dict[tuple, list[dict]] = defaultdict(list)  # (draft, k, batch) -> rows over datasets
        for r in self.rows:
            self.cells[(r["draft"], r["k"], r["batch"])].append(r)
        self.drafts = self._summaries()

    def mean(self, draft: str, k: int, batch: int, field_: str) -> float | None:
        vals = [r[field_] for r in self.cells.get((draft, k, batch), []) if r.get(field_) is not None]
        return statistics.mean(vals) if vals else None

    def plain_tps(self, batch: int) -> float | None:
        """Predicted plain-decoding tokens/s at ``batch`` (mean over datasets; the same for every draft)."""
        vals = defaultdict(list)
        for r in self.rows:
            if r["batch"] == batch and r.get("predicted_plain_tokens_per_s"):
                vals[r["dataset"]].append(r["predicted_plain_tokens_per_s"])
        per_ds = [statistics.median(v) for v in vals.values()]
        return statistics.mean(per_ds) if per_ds else None

    def _summaries(self) -> list[DraftSummary]:
        out = []
        for draft in sorted({r["draft"] for r in self.rows}):
            rows1 = [r for r in self.rows if r["draft"] == draft and r["batch"] == min(self.batches)]
            best_k, best_sp, best_tps = {}, {}, {}
            for b in self.batches:
                scored = [(self.mean(draft, k, b, "predicted_tokens_per_s") or 0.0, k) for k in self.ks]
                tps, k = max(scored)
                best_k[b], best_tps[b] = k, tps
                best_sp[b] = self.mean(draft, k, b, "predicted_speedup") or 0.0
            q = self.quality.get(draft, {})
            out.append(
                DraftSummary(
                    draft=draft,
                    kind=rows1[0].get("draft_kind", "model") if rows1 else "model",
                    t_draft_ms=1e3 * statistics.median(r["t_draft_s"] for r in rows1)
                    if rows1
                    else float("nan"),
                    t_target_ms=1e3 * statistics.median(r["t_target_plain_s"] for r in rows1)
                    if rows1
                    else float("nan"),
                    perplexity=q.get("perplexity"),
                    top1=q.get("top1_agreement"),
                    accepted=self.mean(draft, self.k_ref, min(self.batches), "mean_accepted_length") or 0.0,
                    best_k=best_k,
                    best_speedup=best_sp,
                    best_tps=best_tps,
                )
            )
        return sorted(out, key=lambda d: d.t_draft_ms)


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9})
    return plt


def _colors(names: list[str]) -> dict[str, tuple]:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def _styles(names: list[str]) -> dict[str, dict]:
    """A distinct (color, line style, marker) per name: ten colors, then the next style."""
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    lines, markers = ["-", "--", ":"], ["o", "s", "^"]
    return {
        n: {"color": cmap(i % 10), "ls": lines[(i // 10) % 3], "marker": markers[(i // 10) % 3]}
        for i, n in enumerate(names)
    }


def _label_points(ax, xs: list[float], ys: list[float], labels: list[str], fontsize: int = 7) -> None:
    """Annotate points; a label that would overlap one placed before it (or leave the axes) tries
    the next position above, below, then left of its point, with a thin leader line."""
    ax.autoscale_view()
    px = ax.figure.dpi / 72  # pixels per point
    frame = ax.get_window_extent()
    pts = ax.transData.transform(list(zip(xs, ys)))
    placed: list[tuple[float, float, float, float]] = []
    for i in sorted(range(len(xs)), key=lambda i: (-pts[i][1], pts[i][0])):
        w, h = 0.55 * fontsize * len(labels[i]) * px, 1.25 * fontsize * px
        candidates = [(3 * px, 3 * px)]
        for step in range(1, 8):
            candidates += [(3 * px, 3 * px + step * h), (3 * px, 3 * px - step * h)]
        candidates += [(-w - 3 * px, 3 * px - step * h) for step in range(-3, 4)]
        best = candidates[0]
        for dx, dy in candidates:
            box = (pts[i][0] + dx, pts[i][1] + dy, pts[i][0] + dx + w, pts[i][1] + dy + h)
            inside = frame.x0 <= box[0] and box[2] <= frame.x1 and frame.y0 <= box[1] and box[3] <= frame.y1
            if inside and not any(
                box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed
            ):
                best = (dx, dy)
                break
        dx, dy = best
        placed.append((pts[i][0] + dx, pts[i][1] + dy, pts[i][0] + dx + w, pts[i][1] + dy + h))
        far = abs(dy) > 4 * px or dx < 0
        ax.annotate(
            labels[i],
            (xs[i], ys[i]),
            xytext=(dx / px, dy / px),
            textcoords="offset points",
            fontsize=fontsize,
            arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "gray", "shrinkA": 0, "shrinkB": 2}
            if far
            else None,
        )


def plot_throughput_vs_k(st: Study, path: Path) -> None:
    plt = _plt()
    n = len(st.batches)
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows + 1.2), squeeze=False)
    styles = _styles([d.draft for d in st.drafts])
    for ax, b in zip(axes.flat, st.batches):
        for d in st.drafts:
            ys = [st.mean(d.draft, k, b, "predicted_tokens_per_s") for k in st.ks]
            ax.plot(st.ks, ys, ms=3, label=short_name(d.draft), **styles[d.draft])
        plain = st.plain_tps(b)
        if plain:
            ax.axhline(plain, color="black", ls="--", lw=1.2, label="plain decoding")
        ax.set_title(f"batch {b}")
        ax.set_xlabel("draft length k")
        ax.set_ylabel("predicted tokens/s")
        ax.set_xticks(st.ks)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 4
    fig.legend(handles, labels, loc="lower center", fontsize=8, frameon=False, ncol=ncol)
    legend_h = 0.22 * ((len(labels) + ncol - 1) // ncol) / (3.4 * rows + 1.2)
    fig.suptitle("Throughput vs draft length, per draft and batch size (mean over datasets)")
    fig.tight_layout(rect=(0, legend_h + 0.02, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def plot_speedup_vs_latency(st: Study, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.6, 4.8))
    colors = _colors([str(b) for b in st.batches])
    for b in st.batches:
        xs = [d.t_draft_ms / d.t_target_ms for d in st.drafts]
        ys = [d.best_speedup[b] for d in st.drafts]
        ax.scatter(xs, ys, color=colors[str(b)], label=f"batch {b}", s=22)
    _label_points(
        ax,
        [d.t_draft_ms / d.t_target_ms for d in st.drafts],
        [d.best_speedup[min(st.batches)] for d in st.drafts],
        [short_name(d.draft) for d in st.drafts],
    )
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.set_xlabel("draft step latency / target step latency  (T_draft(1) / T_target(1, 1))")
    ax.set_ylabel("predicted speedup at the best k")
    ax.set_title("Speedup vs draft latency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _scale_for(ax, values: list[float]) -> str:
    """Log x axis when the values span more than a factor of 20 (perplexities of untrained drafts
    run from ~10 to astronomically large), linear otherwise; returns the label suffix."""
    vals = [v for v in values if v and v > 0]
    if vals and max(vals) / min(vals) > 20:
        ax.set_xscale("log")
        return " (log)"
    return ""


def plot_acceptance_vs_perplexity(st: Study, path: Path, corr: dict) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    models = [d for d in st.drafts if d.perplexity is not None]
    a1.scatter([d.perplexity for d in models], [d.accepted for d in models], color="tab:blue", s=26)
    a1.set_xlabel("draft perplexity on held-out target text" + _scale_for(a1, [d.perplexity for d in models]))
    _label_points(
        a1,
        [d.perplexity for d in models],
        [d.accepted for d in models],
        [short_name(d.draft) for d in models],
    )
    a1.set_ylabel(f"mean accepted length, k={st.k_ref}, batch {min(st.batches)}")
    a1.set_title(
        f"per draft: Pearson {_fmt(corr.get('ppl_acc_pearson'))}, Spearman "
        f"{_fmt(corr.get('ppl_acc_spearman'))}"
    )
    pts = _dataset_points(st)
    colors = _colors(st.datasets)
    for ds in st.datasets:
        p = [x for x in pts if x[2] == ds]
        a2.scatter([x[0] for x in p], [x[1] for x in p], s=14, color=colors[ds], label=ds)
    a2.set_xlabel(
        "draft perplexity on the dataset's target continuations" + _scale_for(a2, [x[0] for x in pts])
    )
    a2.set_title(f"per (draft, dataset): Spearman {_fmt(corr.get('ppl_acc_ds_spearman'))}")
    a2.legend(fontsize=6, ncol=2)
    fig.suptitle("Acceptance vs draft language-modelling quality")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _dataset_points(st: Study) -> list[tuple[float, float, str, str]]:
    """(per-dataset perplexity, mean accepted length at k_ref, dataset, draft) for model drafts."""
    out = []
    for r in st.rows:
        if r["k"] == st.k_ref and r["batch"] == min(st.batches) and r.get("draft_perplexity_dataset"):
            out.append((r["draft_perplexity_dataset"], r["mean_accepted_length"], r["dataset"], r["draft"]))
    return out


def plot_breakdown(breakdowns: dict[str, dict[str, float]], path: Path) -> None:
    from specdraft.bench.profile import BUCKETS

    plt = _plt()
    names = list(breakdowns)
    seen = list(dict.fromkeys(b for bd in breakdowns.values() for b in bd))
    buckets = [b for b in BUCKETS if b in seen] + [b for b in seen if b not in BUCKETS]
    colors = _colors(buckets)
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(names) + 1.9))
    left = [0.0] * len(names)
    for bucket in buckets:
        vals = [1e3 * breakdowns[n].get(bucket, 0.0) for n in names]
        ax.barh(names, vals, left=left, color=colors[bucket], label=bucket)
        left = [x + v for x, v in zip(left, vals)]
    for i, total in enumerate(left):
        ax.annotate(
            f"{total:.2f} ms", (total, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7
        )
    ax.set_xlim(0, max(left) * 1.15 if left and max(left) > 0 else 1)
    ax.set_xlabel("milliseconds per draft step (batch 1)")
    ax.set_title("Where a draft step's time goes")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def plot_predicted_vs_measured(online: list[dict], path: Path) -> None:
    """Predicted against measured throughput, and speedup over plain decoding where the rows have it."""
    plt = _plt()
    with_speedup = [r for r in online if "measured_speedup" in r]
    panels = [("tokens_per_s", "tokens/s", "relative_error", online)]
    if with_speedup:
        panels.append(("speedup", "speedup over plain decoding", "speedup_relative_error", with_speedup))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, (name, unit, error, rows) in zip(axes[0], panels):
        _predicted_vs_measured_panel(ax, rows, name, unit, error)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _predicted_vs_measured_panel(ax, rows: list[dict], name: str, unit: str, error: str) -> None:
    """One scatter of ``predicted_<name>`` (and ``reprofiled_predicted_<name>``) against
    ``measured_<name>``, with the ±10% band."""
    xs = [r[f"measured_{name}"] for r in rows]
    ys = [r[f"predicted_{name}"] for r in rows]
    ax.scatter(xs, ys, s=24, color="tab:blue", label="sweep's latency profile")
    re = [
        (r[f"measured_{name}"], r[f"reprofiled_predicted_{name}"])
        for r in rows
        if f"reprofiled_predicted_{name}" in r
    ]
    if re:
        ax.scatter(
            [a for a, _ in re],
            [b for _, b in re],
            s=24,
            marker="x",
            color="tab:orange",
            label="latencies re-measured around the run",
        )
    lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between(
        [lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.15, label="±10%"
    )
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(f"measured {unit} (engine run)")
    ax.set_ylabel(f"predicted {unit}")
    med = statistics.median(r[error] for r in rows)
    again = [r[f"reprofiled_{error}"] for r in rows if f"reprofiled_{error}" in r]
    also = f", {statistics.median(again):.1%} re-measured" if again else ""
    ax.set_title(f"{unit.capitalize()}: median error {med:.1%}{also} (n={len(rows)})", fontsize=10)
    ax.legend(fontsize=8)


def plot_best_per_batch(st: Study, best: dict[int, dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    bs = [str(b) for b in st.batches]
    plain = [st.plain_tps(b) or 0 for b in st.batches]
    spec = [best[b]["tps"] for b in st.batches]
    x = range(len(bs))
    ax.bar([i - 0.2 for i in x], plain, width=0.4, color="gray", label="plain decoding")
    ax.bar([i + 0.2 for i in x], spec, width=0.4, color="tab:green", label="best configuration")
    for i, b in enumerate(st.batches):
        ax.annotate(
            f"{short_name(best[b]['draft'])}\nk={best[b]['k']}",
            (i + 0.2, spec[i]),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(list(x), bs)
    ax.set_xlabel("batch size")
    ax.set_ylabel("predicted tokens/s (mean over datasets)")
    ax.set_title("Best configuration per batch size")
    ax.set_ylim(0, max(spec + plain) * 1.25)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bench(doc: dict, path: Path, title: str) -> None:
    plt = _plt()
    cats = list(doc["categories"]) + ["overall"]
    data = {**doc["categories"], "overall": doc["overall"]}
    methods = [
        ("tokens_per_s", "specdraft speculative"),
        ("plain_tokens_per_s", "specdraft plain"),
        ("hf_plain_tokens_per_s", "HF generate"),
        ("hf_assisted_tokens_per_s", "HF assisted"),
        ("hf_prompt_lookup_tokens_per_s", "HF prompt lookup"),
    ]
    methods = [(m, name) for m, name in methods if any(data[c].get(m) is not None for c in cats)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(cats) + 2), 3.8))
    w = 0.8 / max(len(methods), 1)
    for j, (m, label) in enumerate(methods):
        ax.bar(
            [i + (j - (len(methods) - 1) / 2) * w for i in range(len(cats))],
            [data[c].get(m) or 0 for c in cats],
            width=w,
            label=label,
        )
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Findings
# ------------------------------------------------------------------------------------------------


def correlations(st: Study) -> dict:
    """The correlations the findings quote (None where there are too few points)."""
    models = [d for d in st.drafts if d.perplexity is not None]
    b1 = min(st.batches)
    ppl = [math.log(d.perplexity) for d in models]
    acc = [d.accepted for d in models]
    sp_m = [d.best_speedup[b1] for d in models]
    lat_all = [d.t_draft_ms for d in st.drafts]
    sp_all = [d.best_speedup[b1] for d in st.drafts]
    acc_all = [d.accepted for d in st.drafts]
    pts = _dataset_points(st)
    out = {
        "n_model_drafts": len(models),
        "ppl_acc_pearson": pearson(ppl, acc),
        "ppl_acc_spearman": spearman(ppl, acc),
        "ppl_speedup_spearman": spearman(ppl, sp_m),
        "ppl_speedup_pearson": pearson(ppl, sp_m),
        "top1_acc_spearman": spearman([d.top1 for d in models], acc),
        "lat_speedup_spearman": spearman(lat_all, sp_all),
        "lat_speedup_pearson": pearson(lat_all, sp_all),
        "acc_speedup_spearman": spearman(acc_all, sp_all),
        "n_points_ds": len(pts),
        "ppl_acc_ds_spearman": spearman([math.log(p[0]) for p in pts], [p[1] for p in pts]),
        "ppl_acc_ds_pearson": pearson([math.log(p[0]) for p in pts], [p[1] for p in pts]),
    }
    return out


def verification_cost(st: Study) -> dict:
    """T_target(b, n) / T_target(b, 1) from the target's latency profile at its shortest context,
    for the smallest and largest batch and n = 2, 3, 5, 9 (those measured)."""
    prof = next((r["profiles"] for r in st.latency if r.get("draft") is None and r.get("profiles")), None)
    if not prof:
        return {}
    ctx = min(prof, key=int)
    table = {int(b): {int(n): t for n, t in row.items()} for b, row in prof[ctx]["t_target"].items()}
    sizes = sorted(table)
    out = {"batches": (sizes[0], sizes[-1]), "context": int(ctx)}
    for b in (sizes[0], sizes[-1]):
        row = table[b]
        out[b] = {n: row[n] / row[1] for n in (1, 2, 3, 5, 9) if n in row and 1 in row}
    return out


def best_per_batch(st: Study) -> dict[int, dict]:
    """The configuration (draft, k) with the highest mean predicted throughput at each batch size."""
    out = {}
    for b in st.batches:
        best = max(st.drafts, key=lambda d: d.best_tps[b])
        out[b] = {
            "draft": best.draft,
            "k": best.best_k[b],
            "tps": best.best_tps[b],
            "speedup": best.best_speedup[b],
        }
    return out


def findings(st: Study, corr: dict, best: dict[int, dict], online: list[dict]) -> list[str]:
    """Sentences about the original study's claims, each with its verdict computed from the data."""
    out = [_latency_finding(st, corr), _perplexity_finding(st, corr)]
    if st.batches and st.drafts:
        out += [_best_k_finding(st), _batch_size_finding(st, best)]
    cost = verification_cost(st)
    if cost:
        out.append(_verification_finding(cost))
    if online:
        out.append(_online_finding(online))
    return out


def _latency_finding(st: Study, corr: dict) -> str:
    """Throughput depends mainly on draft latency?"""
    b1 = min(st.batches)
    lat, ppl_sp, acc_sp = (
        corr["lat_speedup_spearman"],
        corr["ppl_speedup_spearman"],
        corr["acc_speedup_spearman"],
    )
    if lat is None:
        return (
            f"**Throughput depends mainly on draft latency: cannot be judged** from {len(st.drafts)} "
            "draft(s) (a rank correlation needs at least 3 with different latencies)."
        )
    holds = abs(lat) >= 0.5 and (ppl_sp is None or abs(lat) > abs(ppl_sp))
    fastest = min(st.drafts, key=lambda d: d.t_draft_ms)
    top = max(st.drafts, key=lambda d: d.best_speedup[b1])
    return (
        f"**Throughput depends mainly on draft latency: {'holds' if holds else 'does not hold'} "
        f"here.** Across {len(st.drafts)} drafts at batch {b1} (each at its best k), Spearman rho "
        f"between draft step latency and predicted speedup is {_fmt(lat)}, against {_fmt(ppl_sp)} "
        f"for draft perplexity and {_fmt(acc_sp)} for mean accepted length. The best draft is "
        f"`{short_name(top.draft)}` ({top.best_speedup[b1]:.2f}x at k={top.best_k[b1]}, T_draft "
        f"{top.t_draft_ms:.2f} ms = {top.t_draft_ms / top.t_target_ms:.1%} of a target step); the "
        f"cheapest is `{short_name(fastest.draft)}` ({fastest.t_draft_ms:.2f} ms)."
    )


def _perplexity_finding(st: Study, corr: dict) -> str:
    """Language-modelling quality (perplexity) barely predicts acceptance?"""
    pa, pa_p, n = corr["ppl_acc_spearman"], corr["ppl_acc_pearson"], corr["n_model_drafts"]
    ds = corr["ppl_acc_ds_spearman"]
    if pa is None and ds is None:
        return (
            "**Language-modelling quality (perplexity) barely predicts acceptance: cannot be judged** "
            f"({corr['n_model_drafts']} model draft(s) with a perplexity; a correlation needs at least 3)."
        )
    weak = [abs(x) < 0.5 for x in (pa, ds) if x is not None]
    holds = all(weak)
    mixed = any(weak) and not holds
    verdict = "holds" if holds else ("partly holds" if mixed else "does not hold")
    top1 = corr["top1_acc_spearman"]
    return (
        f"**Language-modelling quality (perplexity) barely predicts acceptance: {verdict} here.** "
        f"Over {n} model drafts, log-perplexity on held-out target text vs mean accepted length "
        f"(k={st.k_ref}): Pearson {_fmt(pa_p)}, Spearman {_fmt(pa)}; over {corr['n_points_ds']} "
        f"(draft, dataset) pairs with per-dataset perplexity: Spearman {_fmt(ds)}. (Negative = lower "
        "perplexity, more accepted tokens; |rho| < 0.5 counts as barely predictive.) Top-1 agreement "
        f"with the target, by contrast, has Spearman {_fmt(top1)} with acceptance; perplexity vs "
        f"speedup: Spearman {_fmt(corr['ppl_speedup_spearman'])}."
    )


def _best_k_finding(st: Study) -> str:
    """The best k per batch size, and whether it shrinks as the batch grows."""
    parts = []
    for b in st.batches:
        every = [d.best_k[b] for d in st.drafts]
        paying = [d.best_k[b] for d in st.drafts if d.best_speedup[b] > 1.0]
        parts.append(
            f"batch {b}: {statistics.median(every):g} over all drafts, "
            + (
                f"{statistics.median(paying):g} over the {len(paying)} that beat plain decoding"
                if paying
                else "none beats plain decoding"
            )
        )
    model_ks = {b: [d.best_k[b] for d in st.drafts if d.kind == "model"] for b in st.batches}
    first, last = st.batches[0], st.batches[-1]
    shrinks = (
        model_ks[first]
        and model_ks[last]
        and statistics.median(model_ks[last]) < statistics.median(model_ks[first])
    )
    return (
        "**The best k** (median of each draft's k with the highest predicted throughput): "
        f"{'; '.join(parts)}. "
        + (
            "The best k shrinks as the batch grows: verification scores b x (k + 1) tokens, so extra "
            "draft tokens cost more in a bigger batch."
            if shrinks
            else "The best k does not shrink with batch size here."
        )
    )


def _batch_size_finding(st: Study, best: dict[int, dict]) -> str:
    """Whether the best predicted speedup falls with batch size."""
    first, last = st.batches[0], st.batches[-1]
    sp = {b: best[b]["speedup"] for b in st.batches}
    falls = sp[last] < sp[first]
    return (
        "**Batch size:** the best configuration's predicted speedup is "
        + ", ".join(
            f"{sp[b]:.2f}x at batch {b} (`{short_name(best[b]['draft'])}`, k={best[b]['k']})"
            for b in st.batches
        )
        + (
            " - speculation pays less as the batch grows (the target step becomes compute-bound)."
            if falls
            else " - it does not fall with batch size here."
        )
    )


def _verification_finding(cost: dict) -> str:
    """What a target forward over k + 1 tokens costs relative to a plain step."""
    b_lo, b_hi = cost["batches"]
    return (
        "**Verification cost on this hardware:** a target forward over k + 1 tokens costs "
        + ", ".join(f"{cost[b_lo][n]:.2f}x" for n in sorted(cost[b_lo]) if n > 1)
        + f" a plain step for k = {', '.join(str(n - 1) for n in sorted(cost[b_lo]) if n > 1)} at "
        f"batch {b_lo}, and "
        + ", ".join(f"{cost[b_hi][n]:.2f}x" for n in sorted(cost[b_hi]) if n > 1)
        + f" at batch {b_hi} (context {cost['context']}). A draft pays only when its accepted tokens "
        "per step outgrow this ratio plus its own cost: with T_target(k + 1) far above T_target(1), "
        "even a free draft (prompt lookup) needs long accepted runs."
    )


def _online_finding(online: list[dict]) -> str:
    """The analytic model's error against real (online) runs."""
    med = statistics.median(r["relative_error"] for r in online)
    within = sum(r["relative_error"] <= 0.10 for r in online)
    acc_eq = sum(
        abs(r["online_mean_accepted_length"] - r["offline_mean_accepted_length"]) < 1e-6 for r in online
    )
    line = (
        f"**Analytic model vs real runs:** median |predicted - measured| / measured = {med:.1%} over "
        f"{len(online)} configurations run online ({within} within 10%); the online mean accepted "
        f"length equals the offline one in {acc_eq} of {len(online)} runs"
    )
    re = [r["reprofiled_relative_error"] for r in online if "reprofiled_relative_error" in r]
    if re:
        line += (
            "; with latencies re-measured right before and after each run the median error is "
            f"{statistics.median(re):.1%}"
        )
    sp = [r["speedup_relative_error"] for r in online if "speedup_relative_error" in r]
    if sp:
        rsp = [
            r["reprofiled_speedup_relative_error"] for r in online if "reprofiled_speedup_relative_error" in r
        ]
        line += (
            "; the speedup over plain decoding, run interleaved with each run step by step so that the "
            f"host's drift falls on both, is predicted with median error {statistics.median(sp):.1%}"
            + (f" ({statistics.median(rsp):.1%} from the re-measured latencies)" if rsp else "")
        )
    cf = [r["analytic_relative_error"] for r in online if "analytic_relative_error" in r]
    if cf:
        line += (
            "; the closed form b E[tokens] / (k T_draft + T_target(k + 1)) at the mean context, "
            f"without the step-by-step replay, has median error {statistics.median(cf):.1%}"
        )
    return line + "."


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def _study_sections(st: Study, inp: Inputs, out_dir: Path) -> tuple[list[str], list[str]]:
    """(findings, body sections) for study results."""
    corr = correlations(st)
    best = best_per_batch(st)
    plot_throughput_vs_k(st, out_dir / "throughput_vs_k.png")
    plot_speedup_vs_latency(st, out_dir / "speedup_vs_latency.png")
    from specdraft.study import claims  # imports this module's helpers

    body = [
        claims.section(st, out_dir),
        _drafts_section(st),
        "## Throughput vs k\n\n![throughput vs k](throughput_vs_k.png)",
        "## Speedup vs draft latency\n\n![speedup vs draft latency](speedup_vs_latency.png)",
    ]
    if any(d.perplexity is not None for d in st.drafts):
        body.append(_perplexity_section(st, corr, out_dir))
    breakdown = _breakdown_section(inp, out_dir)
    if breakdown:
        body.append(breakdown)
    if st.online:
        body.append(_online_section(st.online, out_dir))
    body.append(_best_section(st, best, out_dir))
    return findings(st, corr, best, st.online), body


def _drafts_section(st: Study) -> str:
    """One table row per draft: latency, quality, acceptance, best k and speedup per batch size."""
    return (
        "## Drafts\n\n"
        + _table(
            [
                "draft",
                "T_draft(1) ms",
                "T_draft / T_target",
                "held-out perplexity",
                "top-1 agreement",
                f"accepted/step (k={st.k_ref})",
            ]
            + [f"best k, b={b}" for b in st.batches]
            + [f"speedup b={b}" for b in st.batches],
            [
                [
                    f"`{short_name(d.draft)}`",
                    f"{d.t_draft_ms:.2f}",
                    f"{d.t_draft_ms / d.t_target_ms:.2f}",
                    _fmt(d.perplexity, "{:.1f}" if (d.perplexity or 0) < 1e5 else "{:.2e}"),
                    _fmt(d.top1, "{:.1%}"),
                    f"{d.accepted:.2f}",
                ]
                + [str(d.best_k[b]) for b in st.batches]
                + [f"{d.best_speedup[b]:.2f}x" for b in st.batches]
                for d in st.drafts
            ],
        )
        + f"\n\nT_target(1, 1) = {st.drafts[0].t_target_ms:.2f} ms (median over the datasets' contexts). "
        "Speedups are predicted steady-state decode throughput over plain decoding of the same target, "
        "mean over datasets."
    )


def _perplexity_section(st: Study, corr: dict, out_dir: Path) -> str:
    """Acceptance vs draft perplexity: the plot and the correlations."""
    plot_acceptance_vs_perplexity(st, out_dir / "acceptance_vs_perplexity.png", corr)
    return (
        "## Acceptance vs draft perplexity\n\n"
        "![acceptance vs perplexity](acceptance_vs_perplexity.png)\n\n"
        + _table(
            ["pair", "n", "Pearson", "Spearman"],
            [
                [
                    "log perplexity vs accepted/step (per draft)",
                    corr["n_model_drafts"],
                    _fmt(corr["ppl_acc_pearson"]),
                    _fmt(corr["ppl_acc_spearman"]),
                ],
                [
                    "log perplexity vs accepted/step (per draft and dataset)",
                    corr["n_points_ds"],
                    _fmt(corr["ppl_acc_ds_pearson"]),
                    _fmt(corr["ppl_acc_ds_spearman"]),
                ],
                [
                    "log perplexity vs speedup (per draft)",
                    corr["n_model_drafts"],
                    _fmt(corr["ppl_speedup_pearson"]),
                    _fmt(corr["ppl_speedup_spearman"]),
                ],
                [
                    "draft latency vs speedup (all drafts)",
                    len(st.drafts),
                    _fmt(corr["lat_speedup_pearson"]),
                    _fmt(corr["lat_speedup_spearman"]),
                ],
            ],
        )
    )


def _breakdown_section(inp: Inputs, out_dir: Path) -> str | None:
    """The draft-step latency breakdown of the study's latency rows and profile files, if any."""
    breakdowns = {}
    for r in inp.latency:
        for c in sorted(r.get("profiles", {}), key=int):
            bd = r["profiles"][c].get("draft_breakdown")
            if r.get("draft") and bd:
                breakdowns[short_name(r["draft"])] = bd
                break
    for path, doc in inp.profiles:
        if doc.get("draft_breakdown"):
            breakdowns[f"{doc.get('draft', path.stem)} ({path.name})"] = doc["draft_breakdown"]
    if not breakdowns:
        return None
    plot_breakdown(breakdowns, out_dir / "draft_latency_breakdown.png")
    return (
        "## Draft-step latency breakdown\n\n![draft latency breakdown](draft_latency_breakdown.png)\n\n"
        "From the profiler (`specdraft.bench.profile`): one batch-1 draft step under torch.profiler, "
        "scaled to its unprofiled median."
    )


def _online_section(online: list[dict], out_dir: Path) -> str:
    """Predicted vs measured throughput of the online validation runs."""
    plot_predicted_vs_measured(online, out_dir / "predicted_vs_measured.png")
    return (
        "## Predicted vs measured throughput\n\n![predicted vs measured](predicted_vs_measured.png)\n\n"
        + _table(
            [
                "draft",
                "dataset",
                "k",
                "batch",
                "measured tok/s",
                "predicted tok/s",
                "error",
                "speedup measured",
                "predicted",
                "error",
                "accepted/step online",
                "offline",
                "outputs = cached",
            ],
            [
                [
                    f"`{short_name(r['draft'])}`",
                    r["dataset"],
                    r["k"],
                    r["batch"],
                    f"{r['measured_tokens_per_s']:.1f}",
                    f"{r['predicted_tokens_per_s']:.1f}",
                    f"{r['relative_error']:.1%}",
                    *_speedup_cells(r),
                    f"{r['online_mean_accepted_length']:.3f}",
                    f"{r['offline_mean_accepted_length']:.3f}",
                    f"{r['outputs_equal_cached']}/{r['prompts']}",
                ]
                for r in online
            ],
        )
        + "\n\nMeasured: steady-state decode tokens/s of a real engine run (prefill and each batch's "
        "first step left out, as in the prediction); speedup: over plain decoding of the same prompts, "
        "run interleaved with it step by step (rows validated before that was measured show -)."
    )


def _speedup_cells(r: dict) -> list[str]:
    """Measured and predicted speedup over plain decoding of an online row, and the error."""
    if "measured_speedup" not in r:
        return ["-"] * 3
    return [
        f"{r['measured_speedup']:.2f}x",
        f"{r['predicted_speedup']:.2f}x",
        f"{r['speedup_relative_error']:.1%}",
    ]


def _best_section(st: Study, best: dict[int, dict], out_dir: Path) -> str:
    """The best configuration per batch size, overall and per dataset."""
    plot_best_per_batch(st, best, out_dir / "best_per_batch.png")
    per_ds = []
    for ds in st.datasets:
        for b in (st.batches[0], st.batches[-1]):
            rows = [
                r
                for r in st.rows
                if r["dataset"] == ds and r["batch"] == b and r.get("predicted_tokens_per_s")
            ]
            if rows:
                r = max(rows, key=lambda r: r["predicted_tokens_per_s"])
                per_ds.append(
                    [
                        ds,
                        b,
                        f"`{short_name(r['draft'])}`",
                        r["k"],
                        f"{r['predicted_tokens_per_s']:.1f}",
                        _fmt(r.get("predicted_speedup"), "{:.2f}x"),
                        f"{r['mean_accepted_length']:.2f}",
                    ]
                )
    return (
        "## Best configuration per batch size\n\n![best per batch](best_per_batch.png)\n\n"
        + _table(
            ["batch", "draft", "k", "predicted tok/s", "plain tok/s", "speedup"],
            [
                [
                    b,
                    f"`{short_name(best[b]['draft'])}`",
                    best[b]["k"],
                    f"{best[b]['tps']:.1f}",
                    _fmt(st.plain_tps(b), "{:.1f}"),
                    f"{best[b]['speedup']:.2f}x",
                ]
                for b in st.batches
            ],
        )
        + "\n\nPer dataset (smallest and largest batch):\n\n"
        + _table(["dataset", "batch", "draft", "k", "predicted tok/s", "speedup", "accepted/step"], per_ds)
    )


def _bench_sections(inp: Inputs, out_dir: Path) -> tuple[list[str], list[str]]:
    from specdraft.bench.runner import markdown_table

    found, body = [], []
    for i, (path, doc) in enumerate(inp.bench, 1):
        png = f"bench_{i}_{path.stem}.png"
        cfg = doc.get("config", {})
        title = (
            f"bench {path.name}: target {cfg.get('target', '?')}, draft {cfg.get('draft', '?')}, k "
            f"{cfg.get('k', '?')}"
        )
        plot_bench(doc, out_dir / png, title)
        o = doc["overall"]
        text = f"## Bench: {path.name}\n\n"
        if cfg.get("command"):
            text += f"`{cfg['command']}`\n\n"
        text += markdown_table(doc) + f"\n\n![{path.stem}]({png})"
        slow = sorted(doc.get("prompts", []), key=lambda r: r.get("speedup") or 0)[:3]
        if slow:
            text += "\n\nSlowest prompts (speedup): " + ", ".join(
                f"{r.get('category')}/{r.get('id')} {_fmt(r.get('speedup'), '{:.2f}x')}" for r in slow
            )
        body.append(text)
        line = (
            f"**Bench `{path.name}`:** speculative decoding ran at "
            f"{_fmt(o.get('tokens_per_s'), '{:.1f}')} tokens/s vs "
            f"{_fmt(o.get('plain_tokens_per_s'), '{:.1f}')} plain ({_fmt(o.get('speedup'), '{:.2f}x')}), "
            f"{_fmt(o.get('mean_accepted_tokens'))} tokens per target forward over {o.get('prompts')} prompts"
        )
        if o.get("identical") is not None:
            line += f"; outputs identical to plain decoding for {o['identical']} of {o['prompts']} prompts"
        for m, label in (
            ("hf_plain", "transformers generate"),
            ("hf_assisted", "transformers assisted"),
            ("hf_prompt_lookup", "transformers prompt lookup"),
        ):
            if o.get(f"{m}_tokens_per_s"):
                line += f"; {label} {o[f'{m}_tokens_per_s']:.1f} tokens/s"
        found.append(line + ".")
    return found, body


def write_report(inputs: list[Path], out_dir: Path) -> Path:
    """Write ``REPORT.md`` and its PNG plots to ``out_dir``; returns the REPORT.md path.

    Args:
        inputs: study results JSONL files, bench JSON files and/or latency profile JSON files.
        out_dir: where the report goes (created if missing).

    Raises:
        SpecdraftError: missing, unrecognised or malformed inputs.
    """
    inp = load_inputs([Path(p) for p in inputs])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    found, body = [], []
    header = ["# specdraft study report", "", "Inputs: " + ", ".join(f"`{p}`" for p in inp.files)]
    if inp.config:
        st = Study(inp)
        f, b = _study_sections(st, inp, out_dir)
        found += f
        body += b
        targets = sorted({r["target"] for r in inp.config})
        versions = sorted({r["code_version"] for r in inp.config})
        prof = next((p for r in inp.latency for p in r.get("profiles", {}).values()), {})
        header.append(
            f"\nStudy: target {', '.join(targets)}; {len(inp.config)} configurations = {len(st.drafts)} "
            f"drafts x {len(st.ks)} k x {len(st.batches)} batch sizes x {len(st.datasets)} datasets "
            f"({', '.join(st.datasets)}); code {', '.join(versions)}; {prof.get('dtype', '?')}, "
            f"{prof.get('threads', '?')} thread(s), {prof.get('cpu', '?')}. Acceptance is measured "
            "offline against cached greedy target continuations; throughput is predicted from it and "
            "profiled latencies with `specdraft.analytic`."
        )
        if inp.runs:
            header.append(
                "\nProduced by: " + "; ".join(f"`{r['command']}` ({r['started']})" for r in inp.runs[-3:])
            )
    elif inp.online:
        plot_predicted_vs_measured(inp.online, out_dir / "predicted_vs_measured.png")
        body.append(
            "## Predicted vs measured throughput\n\n![predicted vs measured](predicted_vs_measured.png)"
        )
    if inp.profiles and not inp.config:
        breakdowns = {
            f"{d.get('draft', p.stem)} ({p.name})": d["draft_breakdown"]
            for p, d in inp.profiles
            if d.get("draft_breakdown")
        }
        if breakdowns:
            plot_breakdown(breakdowns, out_dir / "draft_latency_breakdown.png")
            body.append(
                "## Draft-step latency breakdown\n\n![draft latency breakdown](draft_latency_breakdown.png)"
            )
    for path, doc in inp.profiles:
        from specdraft.bench.profile import LatencyProfile

        try:
            body.append(f"## Latency profile: {path.name}\n\n" + LatencyProfile.from_dict(doc).table())
        except (KeyError, TypeError, ValueError) as e:
            raise SpecdraftError(f"{path}: malformed latency profile ({e})") from None
    if inp.bench:
        f, b = _bench_sections(inp, out_dir)
        found += f
        body += b
    if inp.attacks:
        f, b = attack_report.sections(inp.attacks, out_dir)
        found += f
        body += b
    text = (
        "\n".join(header)
        + "\n\n## Findings\n\n"
        + ("\n".join(f"- {x}" for x in found) or "- (no findings: no study or bench results)")
    )
    text += "\n\n" + "\n\n".join(body) + "\n"
    path = out_dir / REPORT
    path.write_text(text)
    return path
