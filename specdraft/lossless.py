"""What "lossless" means in bf16, as a check: classify a speculative output against plain greedy.

In fp32, greedy speculative decoding is token-identical to plain greedy decoding. In bf16 it need
not be: a token's logits computed inside a (k + 1)-token verification forward differ slightly from
the same position computed by a 1-token forward (other matmul kernels, other accumulation order,
bf16 rounding of every intermediate), and that can flip a near-tie between the two best tokens.
So, comparing a speculative run with a plain greedy run of the same target on the same prompt:

- ``"identical"``: the same tokens.
- ``"tie-divergent"``: they first differ at output index i, and at i the plain run's top-2 logit
  margin (top1 - top2) was below the tolerance: a near-tie that rounding may flip. Acceptable.
- ``"divergent"``: they first differ where the plain run was confident. This is a bug.

After the first difference the two runs continue from different contexts, so nothing after it
is compared.

Default tolerance (:data:`DEFAULT_TOLERANCE`) and why
------------------------------------------------------
A near-tie flips when the gap between the plain run's top token and a runner-up changes sign, so
the tolerance must exceed how much that gap moves between a 1-token forward and the same position
scored inside (k + 1)-token forwards. :func:`logit_drift` measures exactly that (``--drift`` in
``specdraft check``): the plain greedy continuation is fed once token by token and once in chunks of
k + 1, each on a fresh cache (so later chunks also read keys/values that (k + 1)-token forwards
wrote, as in a speculative run), and every position's logits are compared. On this machine (AMD
EPYC, AVX2 only, torch 2.13 CPU), the real SmolLM2-135M-Instruct in bf16, with::

    specdraft check --target smollm2-135m --draft prune:0,1,2,29 --dtype bf16 --k K --threads 1 \
        --prompts ../shared/data/spec_bench/question.jsonl --limit 6 --max-new-tokens 32 --drift

for K = 1, 3, 8, and on six short chat prompts (K = 8, ``--max-new-tokens 24``: "What is speculative
decoding?", "List three facts about the planet Mars.", "Write a haiku about autumn.", "Translate
to French: The weather is nice today.", "What is 17 times 23?", "Explain photosynthesis in one
sentence."):

- largest change of a top-vs-runner-up gap ("max margin shift"): 0.625 (0.5 on Spec-Bench);
- largest change of any single logit: 1.31 (0.875 on Spec-Bench); logits are ~10-25 there, where
  one bf16 step is 0.0625-0.125, so these are a few bf16 steps;
- all 15 divergences seen (in 24 prompt runs) were at a plain margin of at most 0.125, most at exactly 0
  (bf16 logits tie exactly often); none was divergent at tolerance 2.0.

The default tolerance is 2.0: more than three times the largest measured gap shift, and above
1.5 times the largest single-logit drift (the worst case, both logits moving by the maximum in
opposite directions, would be 2 x 1.31 = 2.6 and was never approached). A plain margin of 2.0
means the top token is about e^2 ~ 7 times likelier than the next: a divergence beyond that is a
bug, not rounding. In fp32 the tolerance is 0 (:func:`default_tolerance`): any difference is a bug.

The whole Spec-Bench set, every drafter (``benchmarks/check_lossless.py``)
------------------------------------------------------------------------
Plain greedy decoding of the target is run once per question (every turn; a later turn is asked
after the plain answer to the earlier ones, through the bench's chat templating,
:func:`specdraft.bench.runner.converse`) and stored in ``reference.jsonl``: one line per question
and turn with the fed prompt ids, the output ids, the top-2 margins and the commit. Then each
drafter decodes the stored prompt ids speculatively (greedy, batch 1, one policy for the whole
run, as ``specdraft bench``) and ``checks.jsonl`` gets one line per (drafter, question). A turn is
fed the reference's prompt ids: while the earlier turns were identical these are the speculative
run's own conversation; at the first differing turn the question is classified and its later
turns are not run. Both files are appended a question at a time, so a killed run continues at the
next unchecked (drafter, question); ``report.json`` / ``report.md`` are rebuilt from ``checks.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdraft.engine import Engine, Request, decode_requests
from specdraft.errors import SpecdraftError
from specdraft.models.runtime import ForwardOutput, Runtime

DEFAULT_TOLERANCE = 2.0
"""Top-2 logit margin below which a bf16 divergence counts as a near-tie (module docstring)."""

IDENTICAL, TIE_DIVERGENT, DIVERGENT = "identical", "tie-divergent", "divergent"


def default_tolerance(dtype: torch.dtype) -> float:
    """0 in float32 (greedy speculative output must be token-identical), else :data:`DEFAULT_TOLERANCE`."""
    return 0.0 if dtype == torch.float32 else DEFAULT_TOLERANCE


class _RecordingRuntime:
    """Wraps a runtime and keeps the logits of every decode forward (those without ``logits_index``).

    The engine's plain path feeds one token per step with no ``logits_index`` and its prefill
    passes one, so the recorded forwards are exactly the decoding steps.
    """

    def __init__(self, runtime: Runtime):
        self.inner = runtime
        self.vocab_size = runtime.vocab_size
        self.max_context = runtime.max_context
        self.dtype = runtime.dtype
        self.step_logits: list[torch.Tensor] = []  # each (B, T, V)

    def new_state(self, batch_size: int, capacity: int):
        return self.inner.new_state(batch_size, capacity)

    def forward(self, state, tokens, positions, **kwargs) -> ForwardOutput:
        out = self.inner.forward(state, tokens, positions, **kwargs)
        if kwargs.get("logits_index") is None:
            self.step_logits.append(out.logits)
        return out


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """``top1 - top2`` over the last dim of ``(..., V)`` logits (0 for an exact tie)."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def plain_greedy_margins(
    runtime: Runtime, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = ()
) -> tuple[list[int], list[float]]:
    """Plain greedy decoding with the engine (no drafter, k = 0), and its top-2 margin per token.

    Args:
        runtime: the target runtime (any dtype).
        prompt_ids: the prompt's token ids.
        max_new_tokens: generation budget.
        eos_ids: stop after any of these.

    Returns:
        ``(tokens, margins)``: the output tokens and, for each output index i, ``top1 - top2`` of
        the logits the plain run chose token i from (``len(margins) == len(tokens)``).
    """
    rec = _RecordingRuntime(runtime)
    engine = Engine(rec, drafter=None)
    [tokens] = decode_requests(engine, [Request(list(prompt_ids), max_new_tokens, eos_ids=tuple(eos_ids))])
    logits = torch.cat([lg[0] for lg in rec.step_logits])  # (steps, V): one position per plain step
    margins = top2_margin(logits).tolist()[: len(tokens)]
    assert logits[: len(tokens)].argmax(-1).tolist() == tokens, "recorded logits do not match the output"
    return tokens, margins


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ; None when they are equal.

    When one is a strict prefix of the other, the difference is at the shorter one's length (one
    run stopped where the other went on).
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(
    spec_tokens: list[int], plain_tokens: list[int], margins: list[float], tol: float = DEFAULT_TOLERANCE
) -> str:
    """Classify a speculative greedy output against the plain greedy output of the same target.

    Args:
        spec_tokens: the speculative run's output tokens.
        plain_tokens: the plain greedy run's output tokens (same prompt, budget and EOS ids).
        margins: the plain run's top-2 logit margin per output index (:func:`plain_greedy_margins`).
        tol: margin below which a divergence is a near-tie (:data:`DEFAULT_TOLERANCE`; 0 for fp32).

    Returns:
        ``"identical"``, ``"tie-divergent"`` (first difference at an index where the plain run's
        margin is ``< tol``) or ``"divergent"``. A strict prefix (one run stopped while the other
        went on with the same tokens so far) is ``"divergent"``: stopping depends only on the tokens
        emitted, so with the same EOS ids and budget it cannot come from a near-tie.
    """
    i = first_difference(spec_tokens, plain_tokens)
    if i is None:
        return IDENTICAL
    if i < min(len(spec_tokens), len(plain_tokens)) and i < len(margins) and margins[i] < tol:
        return TIE_DIVERGENT
    return DIVERGENT


@dataclass
class Drift:
    """How far logits move when positions are scored k + 1 at a time instead of one at a time.

    Attributes:
        k: draft length (chunks of k + 1 positions, as a step whose drafts are all accepted).
        positions: how many positions were compared.
        max_abs: largest absolute difference of any logit at any position.
        max_margin_shift: largest change, at any position, of the margin between the single-token
            run's top token and any of its 8 runners-up (what decides whether an argmax flips).
        argmax_flips: positions whose argmax differs between the two ways.
    """

    k: int
    positions: int
    max_abs: float
    max_margin_shift: float
    argmax_flips: int


def logit_drift(runtime: Runtime, prompt_ids: list[int], continuation: list[int], k: int) -> Drift:
    """Measure the logit drift the bf16 tolerance must cover (module docstring).

    Prefills ``prompt_ids[:-1]`` and then feeds ``[prompt_ids[-1]] + continuation`` twice, each on
    a fresh cache: token by token (how plain decoding scores them) and in chunks of k + 1 (how a
    speculative run whose drafts are all accepted scores them, so later chunks also attend to
    keys/values written by (k + 1)-token forwards). Compares the logits at every position.

    Args:
        runtime: the target runtime.
        prompt_ids: at least one token.
        continuation: tokens to feed after the prompt (e.g. the plain greedy output).
        k: draft length (>= 1).
    """
    P = len(prompt_ids) - 1
    feed = torch.tensor([prompt_ids[-1:] + list(continuation)])  # (1, N)
    N = feed.shape[1]
    positions = P + torch.arange(N).unsqueeze(0)  # (1, N)
    capacity = P + N + 1

    def run(chunk: int) -> torch.Tensor:
        state = runtime.new_state(1, capacity)
        if P > 0:
            last = torch.tensor([[P - 1]])
            runtime.forward(
                state, torch.tensor([prompt_ids[:-1]]), torch.arange(P).unsqueeze(0), logits_index=last
            )
        outs = [
            runtime.forward(state, feed[:, i : i + chunk], positions[:, i : i + chunk]).logits[0]
            for i in range(0, N, chunk)
        ]
        return torch.cat(outs)  # (N, V)

    single, chunked = run(1), run(k + 1)
    top = single.topk(9, dim=-1).indices  # (N, 9): the top token and 8 runners-up
    delta = (chunked - single).gather(1, top)  # (N, 9)
    shift = (delta[:, 1:] - delta[:, :1]).abs().max()
    flips = int((chunked.argmax(-1) != single.argmax(-1)).sum())
    return Drift(
        k=k,
        positions=N,
        max_abs=float((chunked - single).abs().max()),
        max_margin_shift=float(shift),
        argmax_flips=flips,
    )


# ------------------------------------------------------------------------------------ whole-set check
REFERENCE, CHECKS, META = "reference.jsonl", "checks.jsonl", "meta.json"
REPORT_JSON, REPORT_MD = "report.json", "report.md"


@dataclass
class ReferenceTurn:
    """Plain greedy decoding of one turn of one question (a line of ``reference.jsonl``).

    Attributes:
        id: the question id.
        category: its Spec-Bench category.
        turn: the turn's index (0-based).
        prompt_ids: the token ids fed (chat-templated conversation, fitted to the budget).
        tokens: the plain greedy output.
        margins: the plain run's top-2 logit margin per output index.
        commit: the git commit the line was computed at.
    """

    id: str
    category: str
    turn: int
    prompt_ids: list[int]
    tokens: list[int]
    margins: list[float]
    commit: str


@dataclass
class Check:
    """One drafter's speculative answers to one question against the reference (a line of
    ``checks.jsonl``).

    Attributes:
        drafter: the draft spec.
        id: the question id.
        category: its category.
        verdict: :data:`IDENTICAL`, :data:`TIE_DIVERGENT` or :data:`DIVERGENT`.
        turn: the first differing turn (None when identical).
        position: the first differing output index in that turn (None when identical).
        plain_token: the plain output's token there (None: plain stopped there).
        spec_token: the speculative output's token there (None: it stopped there).
        new_tokens: speculative output tokens over the turns run.
        seconds: their wall seconds, prefill included.
        steps: target forwards after the prefill.
        drafted: draft tokens verified in them (0: ``--k auto`` never drafted, nothing was checked).
        accepted: those accepted (mean accepted length: ``(accepted + steps) / steps``).
        commit: the git commit the line was computed at.
    """

    drafter: str
    id: str
    category: str
    verdict: str
    turn: int | None
    position: int | None
    plain_token: int | None
    spec_token: int | None
    new_tokens: int
    seconds: float
    steps: int
    drafted: int
    accepted: int
    commit: str


def git_commit() -> str:
    """The repository's ``HEAD`` (short hash, ``+dirty`` with uncommitted changes), or ``unknown``."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "specdraft").strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def read_jsonl(path) -> list[dict]:
    """The lines of a JSONL file ([] when missing); a torn last line (a run killed mid-write) is
    dropped, a bad line elsewhere is an error."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):
                raise SpecdraftError(f"{path}:{n}: not a JSON line: remove it to resume") from None
    return rows


def append_jsonl(path, rows: list[dict]) -> None:
    """Append ``rows`` to a JSONL file and flush them to disk (one question's lines at a time). A
    torn last line left by a killed run is cut off first."""
    with open(path, "ab+") as f:
        end = f.seek(0, os.SEEK_END)
        if end:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                f.seek(0)
                f.truncate(f.read().rfind(b"\n") + 1)
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
        f.flush()
        os.fsync(f.fileno())


@dataclass
class FullsetOptions:
    """How the whole-set check decodes.

    Attributes:
        k: the draft-length policy of every drafter (``auto``: the cost-aware default; one policy
            per drafter for the whole run, as ``specdraft bench`` keeps one).
        max_new_tokens: generation budget per turn.
        long_prompts: ``truncate`` or ``skip`` prompts longer than the budget (as ``specdraft bench``).
        tolerance: near-tie margin; None: :func:`specdraft.bench.harness.tolerance` (0 on the
            quantized runtime and in fp32: any difference is divergent).
        progress: progress bars on stderr.
    """

    k: str | int = "auto"
    max_new_tokens: int = 64
    long_prompts: str = "truncate"
    tolerance: float | None = None
    progress: bool = True


def _meta(pipe, n_questions: int, options: FullsetOptions) -> dict:
    """What the stored reference and checks depend on; a resumed run must match it."""
    from specdraft.bench.harness import runtime_precision, tolerance
    from specdraft.policy import make_policy

    reserve = Engine(pipe.runtime, None, make_policy(options.k)).reserve
    return {
        "target": pipe.target.name,
        "precision": runtime_precision(pipe.runtime),
        "max_new_tokens": options.max_new_tokens,
        "k": str(options.k),
        "prompt_budget_tokens": pipe.runtime.max_context - options.max_new_tokens - reserve,
        "long_prompts": options.long_prompts,
        "tolerance": tolerance(pipe.runtime, options.tolerance),
        "questions": n_questions,
    }


def _check_meta(out: Path, meta: dict) -> None:
    """Write ``meta.json`` on the first run; on a resumed one, refuse other settings."""
    path = out / META
    if not path.is_file():
        path.write_text(json.dumps({**meta, "commit": git_commit()}, indent=2) + "\n")
        return
    stored = json.loads(path.read_text())
    changed = [f"{k} {stored.get(k)!r} -> {v!r}" for k, v in meta.items() if stored.get(k) != v]
    if changed:
        raise SpecdraftError(
            f"{out} holds a run with other settings ({'; '.join(changed)}): resume with the same "
            "ones or use another --out"
        )


def _bar(total: int, desc: str, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="q", disable=not enabled, dynamic_ncols=True)


def reference_answers(pipe, prompts, out: Path, options: FullsetOptions) -> dict[str, list[ReferenceTurn]]:
    """The plain greedy answers to every turn of ``prompts``: those in ``out/reference.jsonl``,
    the others computed (:func:`plain_question`) and appended to it.

    Returns:
        The question id -> its turns, in the order of ``prompts`` (a question whose prompt did not
        fit, with ``long_prompts="skip"``, has none and is left out).
    """
    stored: dict[str, list[ReferenceTurn]] = {}
    for row in read_jsonl(out / REFERENCE):
        stored.setdefault(row["id"], []).append(ReferenceTurn(**row))
    budget = _meta(pipe, len(prompts), options)["prompt_budget_tokens"]
    commit, tokens, seconds = git_commit(), 0, 0.0
    bar = _bar(len(prompts), "plain", sum(p.id in stored for p in prompts), options.progress)
    for prompt in (p for p in prompts if p.id not in stored):
        t0 = time.perf_counter()
        turns = plain_question(pipe, prompt, budget, options, commit)
        append_jsonl(out / REFERENCE, [asdict(t) for t in turns])
        stored[prompt.id] = turns
        tokens, seconds = tokens + sum(len(t.tokens) for t in turns), seconds + time.perf_counter() - t0
        bar.set_postfix_str(f"{tokens / seconds:.1f} tok/s", refresh=False)
        bar.update(1)
    bar.close()
    return {p.id: stored[p.id] for p in prompts if stored.get(p.id)}


def plain_question(
    pipe, prompt, budget: int, options: FullsetOptions, commit: str = ""
) -> list[ReferenceTurn]:
    """Plain greedy decoding of every turn of one question, with its margins: the bench's
    conversation and chat templating (:func:`specdraft.bench.runner.converse`)."""
    from specdraft.bench.harness import Run
    from specdraft.bench.runner import converse

    margins: list[list[float]] = []

    def decode(ids: list[int]) -> Run:
        out_ids, m = plain_greedy_margins(pipe.runtime, ids, options.max_new_tokens, pipe.eos_ids)
        margins.append([round(x, 4) for x in m])  # enough for a tolerance; a smaller file
        return Run(out_ids, 0.0)

    run = converse(pipe, prompt, decode, budget, options.long_prompts)
    return [
        ReferenceTurn(prompt.id, prompt.category, t, ids, out_ids, m, commit)
        for t, (ids, out_ids, m) in enumerate(zip(run.prompt_ids, run.turns, margins))
    ]


def check_question(
    name: str, method, turns: list[ReferenceTurn], max_new_tokens: int, tol: float, commit: str = ""
) -> Check:
    """One drafter's speculative answers to one question's turns against the plain ones.

    Args:
        name: the draft spec (for the record).
        method: the speculative engine method (:func:`specdraft.bench.harness.engine_method`).
        turns: the question's reference turns, in order.
        max_new_tokens: the budget the reference was decoded with.
        tol: near-tie margin for :func:`classify`.
        commit: the git commit, for the record.
    """
    from specdraft.stats import SpecStats

    stats, new_tokens, seconds = SpecStats(), 0, 0.0
    verdict, where = IDENTICAL, (None, None, None, None)
    for ref in turns:
        run = method.run(ref.prompt_ids, max_new_tokens)
        new_tokens, seconds = new_tokens + len(run.tokens), seconds + run.seconds
        stats.merge(run.stats)
        i = first_difference(run.tokens, ref.tokens)
        if i is not None:  # later turns would follow another conversation: not run
            verdict = classify(run.tokens, ref.tokens, ref.margins, tol)
            where = (ref.turn, i, _token_at(ref.tokens, i), _token_at(run.tokens, i))
            break
    q = turns[0]
    counts = (new_tokens, round(seconds, 4), stats.steps, stats.drafted, stats.accepted)
    return Check(name, q.id, q.category, verdict, *where, *counts, commit)


def _token_at(tokens: list[int], i: int) -> int | None:
    """``tokens[i]``, or None where that run had stopped."""
    return tokens[i] if i < len(tokens) else None


def check_drafter(
    name: str,
    method,
    reference: dict[str, list[ReferenceTurn]],
    out: Path,
    options: FullsetOptions,
    tol: float,
) -> None:
    """Check ``name`` on every reference question not yet in ``out/checks.jsonl``, appending a
    line per question."""
    done = {r["id"] for r in read_jsonl(out / CHECKS) if r["drafter"] == name}
    todo = [q for q in reference if q not in done]
    commit, tokens, seconds, identical = git_commit(), 0, 0.0, 0
    bar = _bar(len(reference), name, len(reference) - len(todo), options.progress)
    for n, qid in enumerate(todo, 1):
        check = check_question(name, method, reference[qid], options.max_new_tokens, tol, commit)
        append_jsonl(out / CHECKS, [asdict(check)])
        tokens, seconds = tokens + check.new_tokens, seconds + check.seconds
        identical += check.verdict == IDENTICAL
        bar.set_postfix_str(f"{tokens / seconds:.1f} tok/s, identical {identical}/{n}", refresh=False)
        bar.update(1)
    bar.close()


SUMS = ("new_tokens", "seconds", "steps", "drafted", "accepted")  # Check fields a report adds up


def fullset_report(out: Path, questions: int) -> dict:
    """Per drafter (in the order first checked): questions checked, identical / tie-divergent /
    divergent counts, each non-identical question's first difference, tokens/s and mean accepted
    length, from ``out/checks.jsonl``; ``questions`` is the set's size (a drafter with fewer
    checked is incomplete)."""
    drafters: dict[str, dict] = {}
    for row in read_jsonl(out / CHECKS):
        d = drafters.setdefault(row["drafter"], _empty_tally())
        d["checked"] += 1
        d[row["verdict"].replace("-", "_")] += 1
        for key in SUMS:
            d[key] += row[key]
        d["commits"] = sorted({*d["commits"], row["commit"]})
        if row["verdict"] != IDENTICAL:
            keys = ("id", "category", "verdict", "turn", "position", "plain_token", "spec_token")
            d["differences"].append({k: row[k] for k in keys})
    for d in drafters.values():
        d["complete"] = d["checked"] >= questions
        d["tokens_per_s"] = round(d["new_tokens"] / d["seconds"], 2) if d["seconds"] else None
        d["mean_accepted_tokens"] = (
            round((d["accepted"] + d["steps"]) / d["steps"], 3) if d["steps"] else None
        )
        d["seconds"] = round(d["seconds"], 1)
    return {"questions": questions, "drafters": drafters}


def _empty_tally() -> dict:
    classes = {c.replace("-", "_"): 0 for c in (IDENTICAL, TIE_DIVERGENT, DIVERGENT)}
    return {"checked": 0, **classes, **dict.fromkeys(SUMS, 0), "commits": [], "differences": []}


def report_markdown(report: dict) -> str:
    """:func:`fullset_report` as a markdown table, one row per drafter."""
    head = ["drafter", "checked", "identical", "tie-divergent", "divergent", "first differences"]
    head += ["drafted", "accepted/step", "tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, d in report["drafters"].items():
        diffs = "; ".join(
            f"q{x['id']} turn {x['turn'] + 1} token {x['position']}: {x['plain_token']} -> {x['spec_token']}"
            for x in d["differences"][:3]
        ) + ("; ..." if len(d["differences"]) > 3 else "")
        checked = f"{d['checked']}/{report['questions']}" + ("" if d["complete"] else " (incomplete)")
        cells = [f"`{name}`", checked, d["identical"], d["tie_divergent"], d["divergent"], diffs or "-"]
        cells += [d["drafted"], d["mean_accepted_tokens"], d["tokens_per_s"]]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def run_fullset(pipe, drafters: list, prompts, out, options: FullsetOptions | None = None) -> dict:
    """The whole-set check (module docstring): the plain reference once, then each drafter in order.

    Args:
        pipe: the target (:class:`specdraft.api.Pipeline`; its own drafter is not used).
        drafters: ``(name, build)`` pairs, ``build()`` making the drafter (called only when the
            drafter has questions left), checked in this order.
        prompts: the questions (:func:`specdraft.bench.prompts.load_prompts`).
        out: the results directory (created; a run there before is resumed).
        options: how to decode.

    Returns:
        :func:`fullset_report`, also written to ``out/report.json`` and ``out/report.md``.
    """
    from specdraft.bench.harness import engine_method
    from specdraft.policy import make_policy

    options = options or FullsetOptions()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta(pipe, len(prompts), options)
    _check_meta(out, meta)
    with _sole_run(out):
        reference = reference_answers(pipe, prompts, out, options)
        for name, build in drafters:
            done = {r["id"] for r in read_jsonl(out / CHECKS) if r["drafter"] == name}
            if all(q in done for q in reference):
                continue
            policy = make_policy(options.k)  # one for the drafter's whole run: an adaptive one keeps learning
            method = engine_method(name, pipe.runtime, build(), policy, eos_ids=pipe.eos_ids)
            try:
                check_drafter(name, method, reference, out, options, meta["tolerance"])
            finally:
                write_report(out, len(reference))
        return write_report(out, len(reference))


@contextmanager
def _sole_run(out: Path):
    """Hold a lock on ``out/meta.json`` while checking: two runs on one directory would check the
    same questions and interleave their lines."""
    import fcntl

    with open(out / META) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SpecdraftError(f"another check is running on {out}: let it end or stop it first") from None
        yield


def write_report(out: Path, questions: int) -> dict:
    """:func:`fullset_report` written to ``out/report.json`` and ``out/report.md``."""
    report = fullset_report(out, questions)
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2) + "\n")
    (out / REPORT_MD).write_text(report_markdown(report))
    return report
