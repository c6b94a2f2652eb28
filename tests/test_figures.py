"""Every speed ratio the READMEs and docstrings quote comes from a committed output file that the same
paragraph names (issue 13 item 5).

A paragraph (or table row) that states a ratio such as ``1.20x`` must name a committed file or folder
under ``results/`` or ``drafts/results/`` (a bare file name like ``bench_designed.json`` counts when
one such file is committed), and the ratio must be in one of those files: as printed (``1.20``) or
as a number that rounds to it (JSON). Ranges (``1.5-1.7x``) are checked at both ends; times in
milliseconds (``13.9 ms``) likewise.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULT_DIRS = ("results/", "drafts/results/")
RATIO = re.compile(r"(?<![\w.])~?(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?(?:x| ms)(?![\w])")
PATH = re.compile(r"(?:drafts/)?results/[\w./-]*[\w/]")
BARE = re.compile(r"`([\w.-]+\.(?:json|log|md))`")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE]-?\d+)?")


@cache
def committed() -> tuple[str, ...]:
    """The tracked files under the result folders (every file there when this is no git checkout)."""
    out = subprocess.run(
        ["git", "ls-files", *RESULT_DIRS], cwd=REPO, capture_output=True, text=True, check=False
    )
    if out.returncode == 0:
        return tuple(out.stdout.split())
    return tuple(str(p.relative_to(REPO)) for d in RESULT_DIRS for p in (REPO / d).rglob("*") if p.is_file())


def named_files(block: str) -> list[str]:
    """The committed result files a block names: paths (folders expand to their files) and bare file names."""
    files = []
    for p in PATH.findall(block):
        files += [f for f in committed() if f == p or f.startswith(p.rstrip("/") + "/")]
    for name in BARE.findall(block):
        files += [f for f in committed() if f.rsplit("/", 1)[-1] == name]
    return files


def _ratios(obj) -> list[float]:
    """Ratios of the numbers side by side in one JSON object (``tokens_per_s``: method over plain)."""
    if isinstance(obj, list):
        return [r for x in obj for r in _ratios(x)]
    if not isinstance(obj, dict):
        return []
    values = [v for v in obj.values() if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    return [a / b for a in values for b in values] + [r for v in obj.values() for r in _ratios(v)]


@cache
def numbers_in(path: str) -> tuple[str, frozenset[float]]:
    """A result file's text and the numbers in it (for JSON also the ratios of sibling numbers)."""
    text = (REPO / path).read_text(errors="replace")
    numbers = [float(x) for x in NUMBER.findall(text)]
    if path.endswith(".json"):
        numbers += _ratios(json.loads(text))
    return text, frozenset(numbers)


def found(figure: str, files: list[str]) -> bool:
    digits = len(figure.partition(".")[2])
    for f in files:
        text, numbers = numbers_in(f)
        if figure in text or any(abs(round(x, digits) - float(figure)) < 1e-9 for x in numbers):
            return True
    return False


def blocks(text: str) -> list[str]:
    """Paragraphs, with each table row a block of its own."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        rows = [line for line in para.splitlines() if line.lstrip().startswith("|")]
        out += rows if rows else [para]
    return out


def docstrings() -> list[tuple[str, str]]:
    out = []
    for path in sorted((REPO / "specdraft").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out.append((f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 1)}", doc))
    return out


def sources() -> list[tuple[str, str]]:
    out = [(name, (REPO / name).read_text()) for name in ("README.md", "drafts/README.md")]
    return out + docstrings()


def unsourced(where: str, text: str) -> list[str]:
    problems = []
    for block in blocks(text):
        figures = [x for m in RATIO.finditer(block) for x in m.groups() if x]
        if not figures:
            continue
        files = named_files(block)
        head = " ".join(block.split())[:90]
        if not files:
            problems.append(f"{where}: {', '.join(figures)} with no committed result file named: {head}")
            continue
        missing = [x for x in figures if not found(x, files)]
        if missing:
            problems.append(f"{where}: {', '.join(missing)} not in {', '.join(files)}: {head}")
    return problems


@pytest.mark.parametrize("where", ["README.md", "drafts/README.md", "docstrings"])
def test_every_ratio_comes_from_a_named_committed_file(where):
    texts = docstrings() if where == "docstrings" else [(where, (REPO / where).read_text())]
    problems = [p for w, t in texts for p in unsourced(w, t)]
    assert not problems, "\n".join(problems)


def test_named_result_paths_are_committed():
    missing = []
    for where, text in sources():
        for p in PATH.findall(text):
            if not any(f == p or f.startswith(p.rstrip("/") + "/") for f in committed()):
                missing.append(f"{where}: {p}")
    assert not missing, "\n".join(missing)


def test_the_checker_catches_an_unsourced_figure():
    assert unsourced("x", "an 8-row product cost ~3.4x a 1-row one")
    assert unsourced("x", "1.99x plain (`results/engine-2026-12-01c/bench_policy.log`)")
    assert not unsourced("x", "k 2 1.20x plain (`results/engine-2026-12-01c/bench_policy.log`)")
    assert unsourced("x", "it was 6-9 ms of per-op overhead per forward")


def test_dtype_auto_help_says_what_resolve_dtype_does(monkeypatch):
    """``--dtype auto`` on a CPU without native bf16: bf16 weights (fp32 arithmetic) for the compact
    runtime when the kernels run, fp32 for the transformers adapter; the help must say both."""
    import argparse

    import torch

    from specdraft import api, kernels
    from specdraft.commands import add_model_arguments

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    help_text = " ".join(next(a.help for a in p._actions if a.dest == "dtype").split())
    monkeypatch.setattr(api, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert api.resolve_dtype("auto", runtime="compact") == torch.bfloat16
    assert "bf16 weights with fp32 arithmetic" in help_text
    assert api.resolve_dtype("auto", runtime="hf") == torch.float32
    assert "fp32 without them or with --runtime hf" in help_text


def test_bench_policy_commands_the_readme_names_resolve():
    """The policies of every ``bench_policy.py --policies ...`` command quoted in the READMEs exist
    (a figure from a throwaway wrapper's ``old-auto`` is not reproducible)."""
    from specdraft.errors import SpecdraftError
    from specdraft.policy import make_policy

    commands = [
        c for _, t in sources()[:2] for c in re.findall(r"bench_policy\.py[^`]*?--policies\s+([\w,.-]+)", t)
    ]
    assert commands, "the README names no bench_policy command"
    for names in commands:
        for name in names.split(","):
            try:
                make_policy(name)
            except SpecdraftError as e:
                pytest.fail(f"bench_policy.py --policies {names}: {e}")
