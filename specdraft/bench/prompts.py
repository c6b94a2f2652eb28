"""Benchmark prompts: Spec-Bench JSONL files, plain ``{"prompt": ...}`` files, and fitting them
into the target's context window.

Two line formats are read, and may be mixed in one file:

- Spec-Bench (FastChat) ``{"question_id": 81, "category": "writing", "turns": ["...", "..."]}``.
  A question with two turns is a conversation: the second turn is asked after the model's *own*
  first answer (see :mod:`specdraft.bench.runner`).
- ``{"prompt": "..."}``, optionally with ``"category"``; without one the category is the file's
  stem (``hellaswag_prompts.jsonl`` -> ``hellaswag_prompts``).

The default suite is Spec-Bench's ``spec_bench/question.jsonl`` (480 questions, 13 categories).
:func:`data_file` finds a data file in ``$SPECDRAFT_DATA``, else in the project's read-only data
folder ``../shared/data`` beside the repository, else in the small slices shipped in
``specdraft/data`` (52 Spec-Bench questions, 4 per category; see its README), with a note on stderr.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specdraft.data.make_slices import BY_PATH
from specdraft.errors import SpecdraftError

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"  # the full data files, read-only, beside the repository
SHIPPED_DATA = Path(__file__).resolve().parents[1] / "data"  # the slices in specdraft/data (package data)
SPEC_BENCH = Path("spec_bench") / "question.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question.

    Attributes:
        id: the question id (Spec-Bench ``question_id``, else the 1-based line number).
        category: Spec-Bench category, or the file's stem for plain prompt files.
        turns: user messages, in order; the model answers each before the next is asked.
    """

    id: str
    category: str
    turns: tuple[str, ...]


def data_file(relative: str | Path) -> Path:
    """A data file by its path inside a data directory (``spec_bench/question.jsonl``).

    The first that exists of ``$SPECDRAFT_DATA/<relative>`` (when the variable is set),
    ``../shared/data/<relative>`` (:data:`SHARED_DATA`) and the slice shipped in ``specdraft/data``
    (:data:`SHIPPED_DATA`; a one-line note on stderr the first time each slice is used). When none
    exists, the first of those paths, so that the "not found" message names where it was looked for.
    """
    env = os.environ.get("SPECDRAFT_DATA")
    candidates = [Path(env).expanduser() / relative] if env else []
    candidates += [SHARED_DATA / relative, SHIPPED_DATA / relative]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        return candidates[0]
    if found == candidates[-1]:
        _note_slice(Path(relative).as_posix())
    return found


_noted: set[str] = set()


def _note_slice(relative: str) -> None:
    if relative in _noted:
        return
    _noted.add(relative)
    s = BY_PATH.get(relative)
    what = f"the {s.lines}-{s.unit} slice of {s.name}" if s else f"the {relative} slice"
    print(
        f"note: using {what} shipped in specdraft/data; set SPECDRAFT_DATA for the full set", file=sys.stderr
    )


def is_shipped_slice(path: Path) -> bool:
    """Whether ``path`` (from :func:`data_file`) is one of the slices shipped in ``specdraft/data``."""
    return Path(path).resolve().is_relative_to(SHIPPED_DATA)


def default_prompts_path() -> Path:
    """The Spec-Bench question file (:func:`data_file` ``spec_bench/question.jsonl``)."""
    return data_file(SPEC_BENCH)


def _parse_line(obj, path: Path, lineno: int) -> BenchPrompt:
    where = f"{path}:{lineno}"
    if not isinstance(obj, dict):
        raise SpecdraftError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "turns" in obj:
        turns = obj["turns"]
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise SpecdraftError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        qid = obj.get("question_id", lineno)
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise SpecdraftError(f"{where}: 'prompt' must be a non-empty string")
        turns = [obj["prompt"]]
        qid = obj.get("id", lineno)
    else:
        raise SpecdraftError(f"{where}: a line needs 'turns' (Spec-Bench format) or 'prompt'")
    category = obj.get("category", path.stem)
    if not isinstance(category, str) or not category:
        raise SpecdraftError(f"{where}: 'category' must be a non-empty string")
    return BenchPrompt(id=str(qid), category=category, turns=tuple(turns))


def read_prompts(path: str | Path) -> list[BenchPrompt]:
    """Every prompt of a JSONL file, in file order (blank lines are skipped).

    Raises:
        SpecdraftError: the file is missing or empty, or a line is not valid JSON or lacks
            ``turns``/``prompt``; the message names the file and the line.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        # a missing Spec-Bench file (not looked up again: that would print the data note)
        hint = (
            " (set SPECDRAFT_DATA to the data directory)"
            if path.as_posix().endswith(SPEC_BENCH.as_posix())
            else ""
        )
        raise SpecdraftError(f"prompt file not found: {path}{hint}")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdraftError(
                    f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})"
                ) from None
            prompts.append(_parse_line(obj, path, lineno))
    if not prompts:
        raise SpecdraftError(f"prompt file {path} has no prompts")
    return prompts


def select(
    prompts: list[BenchPrompt], categories: list[str] | None = None, limit: int | None = None
) -> list[BenchPrompt]:
    """Keep the given categories (all when None) and the first ``limit`` prompts of each.

    Raises:
        SpecdraftError: a category that no prompt has, or ``limit < 1``.
    """
    present = list(dict.fromkeys(p.category for p in prompts))
    if categories:
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise SpecdraftError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}: the file "
                f"has {', '.join(present)}"
            )
        prompts = [p for p in prompts if p.category in categories]
    if limit is not None:
        if limit < 1:
            raise SpecdraftError(f"--limit must be >= 1, got {limit}")
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= limit:
                kept.append(p)
        prompts = kept
    return prompts


def load_prompts(
    path: str | Path | None = None, categories: list[str] | None = None, limit: int | None = None
) -> list[BenchPrompt]:
    """:func:`read_prompts` then :func:`select`; ``path=None`` is the Spec-Bench suite."""
    return select(read_prompts(path or default_prompts_path()), categories, limit)


def parse_categories(text: str | None) -> list[str] | None:
    """``"qa, rag"`` -> ``["qa", "rag"]``; None or empty -> None (all categories)."""
    if not text:
        return None
    cats = [c.strip() for c in text.split(",") if c.strip()]
    return cats or None


@dataclass(frozen=True)
class Fitted:
    """A prompt's token ids after fitting the context window.

    Attributes:
        ids: the ids to feed (None when the prompt was skipped).
        dropped: prompt tokens removed by truncation (0 when it fitted).
        message: why it was truncated or skipped, for the user; None when it fitted as is.
    """

    ids: list[int] | None
    dropped: int = 0
    message: str | None = None


def fit_context(ids: list[int], budget: int, mode: str = "truncate", keep_tail: int = 64) -> Fitted:
    """Make a prompt fit in ``budget`` tokens.

    ``truncate`` cuts the middle: it keeps the start (the instruction) and the last ``keep_tail``
    tokens (the end of the user turn and the chat template's assistant header), so the model is
    still asked the question; ``skip`` drops the prompt.

    Args:
        ids: the prompt's token ids.
        budget: how many prompt tokens fit (context window - new tokens - draft reserve).
        mode: ``truncate`` or ``skip``.
        keep_tail: tokens kept from the end when truncating.
    """
    if len(ids) <= budget:
        return Fitted(ids)
    if mode == "skip" or budget < 2:
        return Fitted(None, len(ids), f"skipped: {len(ids)} prompt tokens, {budget} fit")
    if mode != "truncate":
        raise SpecdraftError(f"unknown long-prompt mode {mode!r}: use truncate or skip")
    tail = min(keep_tail, budget // 2)
    kept = ids[: budget - tail] + ids[len(ids) - tail :]
    return Fitted(kept, len(ids) - len(kept), f"truncated from {len(ids)} to {len(kept)} tokens")
