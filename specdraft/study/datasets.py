"""The study's datasets: Spec-Bench categories and HellaSwag prompts, with cached target continuations.

- Each Spec-Bench category is one dataset: the first ``per_dataset`` questions of the category,
  first turn only (the offline pass needs one fixed prefix; multi-turn is ``specdraft bench``'s job).
- ``hellaswag``: the *last* ``per_dataset`` prompts of ``hellaswag_prompts.jsonl``, the study's own
  workload.
- ``hellaswag-heldout``: the ``heldout`` prompts just before those, whose target continuations are
  the held-out text on which each draft's perplexity and top-1 agreement are measured. Both slices
  come from the end of the file, so drafts trained on its head (issue 4) are not scored on their
  training text. Spec-Bench is never used for draft quality.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specdraft.bench.prompts import BenchPrompt, data_file, default_prompts_path, fit_context, read_prompts
from specdraft.errors import SpecdraftError
from specdraft.study.offline import Sequence, cached_continuations
from specdraft.study.sweep import HELLASWAG, Dataset

HELDOUT = "hellaswag-heldout"


def default_hellaswag_path() -> Path:
    return data_file("hellaswag_prompts.jsonl")


def select_prompts(
    spec_bench: Path | None,
    hellaswag: Path | None,
    names: list[str] | None,
    per_dataset: int,
    heldout: int,
) -> tuple[dict[str, list[str]], list[str]]:
    """Prompt texts per dataset name, and the held-out HellaSwag texts.

    Args:
        spec_bench: Spec-Bench question file (None: leave Spec-Bench out).
        hellaswag: HellaSwag prompt file (None: no ``hellaswag`` dataset and no held-out text).
        names: datasets to keep (None: all).
        per_dataset: prompts per dataset.
        heldout: held-out HellaSwag prompts for draft quality (0: none).

    Raises:
        SpecdraftError: an unknown dataset name, an empty or malformed file (file and line named),
            too few HellaSwag prompts.
    """
    if per_dataset < 1:
        raise SpecdraftError(f"prompts per dataset must be >= 1, got {per_dataset}")
    texts: dict[str, list[str]] = {}
    if spec_bench is not None:
        for p in read_prompts(spec_bench):
            texts.setdefault(p.category, []).append(p.turns[0])
    hs: list[BenchPrompt] = read_prompts(hellaswag) if hellaswag is not None else []
    if hs:
        if len(hs) < per_dataset + heldout:
            raise SpecdraftError(
                f"{hellaswag} has {len(hs)} prompts; the study needs {per_dataset} + {heldout} held out"
            )
        texts[HELLASWAG] = [p.turns[0] for p in hs[len(hs) - per_dataset :]]
    held = (
        [p.turns[0] for p in hs[len(hs) - per_dataset - heldout : len(hs) - per_dataset]]
        if hs and heldout
        else []
    )
    if names:
        unknown = [n for n in names if n not in texts]
        if unknown:
            raise SpecdraftError(
                f"unknown dataset{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: available are "
                f"{', '.join(texts)}"
            )
        texts = {n: texts[n] for n in names}
    if not texts:
        raise SpecdraftError("no datasets: give a Spec-Bench file and/or a HellaSwag file")
    return {n: t[:per_dataset] for n, t in texts.items()}, held


def build_datasets(
    pipe,
    texts: dict[str, list[str]],
    held: list[str],
    *,
    dtype: str,
    max_new_tokens: int,
    max_prompt_tokens: int,
    k_max: int,
    log: Callable[[str], None],
    cache_dir: Path | None = None,
) -> tuple[list[Dataset], Dataset | None]:
    """Tokenize (fitting the context window) and attach the target's cached continuations."""
    budget = min(max_prompt_tokens, pipe.runtime.max_context - max_new_tokens - k_max - 2)
    if budget < 2:
        raise SpecdraftError(
            f"no room for prompts: max_prompt_tokens {max_prompt_tokens}, context {pipe.runtime.max_context}"
        )

    def make(name: str, prompts: list[str]) -> Dataset:
        ids = []
        for text in prompts:
            fitted = fit_context(pipe.encode(text), budget, "truncate")
            if fitted.message:
                log(f"{name}: prompt {fitted.message}")
            ids.append(fitted.ids)
        seqs = cached_continuations(
            pipe.runtime,
            ids,
            max_new_tokens,
            pipe.eos_ids,
            target=pipe.target.name,
            dtype=dtype,
            cache_dir=cache_dir,
        )
        return Dataset(name, seqs, Dataset.fingerprint_of(ids))

    datasets = []
    for i, (name, prompts) in enumerate(texts.items(), 1):
        log(
            f"target continuations {i}/{len(texts)}: {name} ({len(prompts)} prompts x {max_new_tokens} "
            "tokens)"
        )
        datasets.append(make(name, prompts))
    heldout = None
    if held:
        log(f"target continuations: {HELDOUT} ({len(held)} prompts x {max_new_tokens} tokens)")
        heldout = make(HELDOUT, held)
    return datasets, heldout


__all__ = [
    "HELDOUT",
    "Sequence",
    "build_datasets",
    "default_hellaswag_path",
    "default_prompts_path",
    "select_prompts",
]
