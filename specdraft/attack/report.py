"""The attack section of ``specdraft report``: one row and one pair of bars per ``attack.json``.

Each ``attack.json`` (``specdraft attack --out DIR``) is one drafter under one method. The table
gives, per file, mean accepted length and speedup over plain decoding *clean* (the drafter at a
fixed k on the clean prompts), *attacked* (the same on the attacked prompts, undefended) and
*defended* (``--k auto`` on the attacked prompts: the cost-aware policy's per-row collapse defense),
then the stealth figures (identical first N tokens, ROUGE-L) and the defense's detection and
false-positive rates. The plot shows the first two groups as bars, one group per drafter.

A figure the run could not measure is null in the JSON and ``n/a`` here (the continuous attack's
input is an embedding, not text: its attacked and defended speedups are null and its accepted
lengths are simulated, see :mod:`specdraft.attack.run`).
"""

from __future__ import annotations

from pathlib import Path

SIDES = (("clean", "clean"), ("attacked", "attacked"), ("defended", "defended"))
ACCEPTED = {
    "clean": "clean_mean_accepted",
    "attacked": "attacked_mean_accepted",
    "defended": "defended_mean_accepted",
}
SPEEDUP = {"clean": "clean_speedup", "attacked": "attacked_speedup", "defended": "defended_speedup"}


def is_attack(doc: dict) -> bool:
    """Whether a JSON document is an ``attack.json``."""
    return isinstance(doc.get("overall"), dict) and "attacked_mean_accepted" in doc["overall"]


def label(path: Path, doc: dict) -> str:
    """``draft (method)`` from the file's config, else its directory's name."""
    cfg = doc.get("config", {})
    if cfg.get("draft") and cfg.get("method"):
        from specdraft.study.report import short_name

        return f"{short_name(cfg['draft'])} ({cfg['method']})"
    return path.parent.name or path.stem


def _fmt(x, spec: str = "{:.2f}") -> str:
    return "n/a" if x is None else spec.format(x)


def table(docs: list[tuple[Path, dict]]) -> str:
    """The markdown table, one row per attack file."""
    head = ["drafter (method)", "prompts", "accepted clean / attacked / defended"]
    head += ["speedup clean / attacked / defended", "identical prefix", "ROUGE-L", "detected", "false pos."]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for path, doc in docs:
        o = doc["overall"]
        acc = " / ".join(_fmt(o.get(ACCEPTED[s])) for s, _ in SIDES)
        speed = " / ".join(_fmt(o.get(SPEEDUP[s]), "{:.2f}x") for s, _ in SIDES)
        cells = [label(path, doc), str(o.get("prompts", "?")), acc, speed]
        cells += [_fmt(o.get("identical_prefix_rate"), "{:.0%}"), _fmt(o.get("rouge_l"))]
        cells += [_fmt(o.get("detected_rate"), "{:.0%}"), _fmt(o.get("false_positive_rate"), "{:.0%}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(docs: list[tuple[Path, dict]], path: Path) -> None:
    """Two panels (mean accepted length, speedup over plain), clean / attacked / defended bars per
    drafter; a figure that is null is left out (no bar), not drawn as 0."""
    from specdraft.study.report import _plt

    plt = _plt()
    names = [label(p, d) for p, d in docs]
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 1.6 * len(docs) + 4), 3.8))
    w = 0.8 / len(SIDES)
    for ax, fields, ylabel, base in (
        (axes[0], ACCEPTED, "mean accepted length (bonus incl.)", 1.0),
        (axes[1], SPEEDUP, "speedup over plain decoding", 1.0),
    ):
        for j, (side, text) in enumerate(SIDES):
            xs = [i + (j - 1) * w for i in range(len(docs))]
            ys = [d["overall"].get(fields[side]) for _, d in docs]
            kept = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if kept:
                ax.bar([x for x, _ in kept], [y for _, y in kept], width=w, label=text)
        ax.axhline(base, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(docs)), names, rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle("acceleration-collapse attack: clean vs attacked vs defended")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def findings(docs: list[tuple[Path, dict]]) -> list[str]:
    """One computed sentence per attack file."""
    out = []
    for path, doc in docs:
        o = doc["overall"]
        line = (
            f"**Attack `{label(path, doc)}`** ({o.get('prompts', '?')} prompts): mean accepted length "
            f"{_fmt(o.get('clean_mean_accepted'))} -> {_fmt(o.get('attacked_mean_accepted'))}"
        )
        if o.get("halved_rate") is not None:
            line += f", halved on {o['halved_rate']:.0%} of prompts"
        if o.get("draft_halved_rate") is not None:
            line += f" (accepted draft tokens halved on {o['draft_halved_rate']:.0%})"
        line += f"; target's first tokens identical on {_fmt(o.get('identical_prefix_rate'), '{:.0%}')}"
        if o.get("defended_speedup") is not None:
            line += (
                f"; under attack {_fmt(o.get('attacked_speedup'), '{:.2f}x')} plain undefended, "
                f"{_fmt(o.get('defended_speedup'), '{:.2f}x')} defended"
            )
        out.append(line + ".")
    return out


def sections(docs: list[tuple[Path, dict]], out_dir: Path) -> tuple[list[str], list[str]]:
    """``(findings, body)`` for :func:`specdraft.study.report.write_report`."""
    plot(docs, out_dir / "attack.png")
    commands = [d.get("config", {}).get("command") for _, d in docs]
    body = "## Attack: clean vs attacked vs defended\n\n" + table(docs)
    body += "\n\n![attack](attack.png)"
    if any(commands):
        body += "\n\nCommands:\n\n" + "\n".join(f"- `{c}`" for c in commands if c)
    return findings(docs), [body]
