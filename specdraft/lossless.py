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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.engine import Engine, Request, decode_requests
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
