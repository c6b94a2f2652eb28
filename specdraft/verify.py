"""Verification: draft tokens, draft probabilities (or none) and target logits in, a verdict out.

Vocabulary (as vLLM's rejection sampler defines it):

- *draft tokens*: the k tokens the drafter proposed for a row.
- *accepted*: the longest prefix of the draft tokens that verification keeps.
- *recovered* token: when draft token i is rejected, the token emitted in its place.
- *bonus* token: when all k are accepted, one more token sampled from the target at position k.
- *output* tokens: accepted + (recovered or bonus); always ``accepted + 1`` tokens per step.

Distributions follow the papers: ``p`` is the target's, ``q`` the draft's. Both are processed the
same way (temperature, top-k, top-p) before they are compared.

Nothing here calls a model, so stub logits test it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError

MAX_LOGPROBS = 20  # most alternatives reported per token (SamplingParams.logprobs), as OpenAI's top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep only the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = off).
        seed: seeds the row's own ``torch.Generator``; None draws a fresh seed.
        logprobs: also report, for every output token, its log-probability under the target's raw
            distribution (the logits' log-softmax, before temperature, top-k and top-p, as vLLM's
            default ``raw_logprobs``) and the this-many most likely tokens' (0: the chosen token's
            only); None: none (:attr:`specdraft.engine.StepEvent.logprobs`). Reporting changes
            nothing about which tokens are chosen.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SpecdraftError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecdraftError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecdraftError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SpecdraftError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target (raw logits' log-softmax) and the
    ``SamplingParams.logprobs`` most likely tokens' ``(id, logprob)``, most likely first; a prompt's
    first token has none (``logprob`` None)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each of ``tokens`` (output token j predicted by ``logits[j]``, ``(T, V)``) with its logprob
    and the ``top`` most likely tokens'."""
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens).unsqueeze(1))[:, 0].tolist()
    best = lp.topk(top, dim=-1) if top else None
    out = []
    for j, (t, c) in enumerate(zip(tokens, chosen)):
        alts = () if best is None else tuple(zip(best.indices[j].tolist(), best.values[j].tolist()))
        out.append(TokenLogprob(t, c, alts))
    return out


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p, then softmax, over the last dim (any leading shape)."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of ``probs`` (..., V) -> (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator)
    return out.view(probs.shape[:-1])


@dataclass
class Verdict:
    """The result of verifying one step for a batch.

    Attributes:
        num_accepted: ``(B,)`` accepted draft tokens per row (0..k).
        tokens: ``(B, k + 1)``; row b's output tokens are ``tokens[b, : num_accepted[b] + 1]``
            (accepted drafts, then the recovered or bonus token). Entries past that are junk.
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: the first maximum of each row, as torch's argmax picks it.

    Float32 CPU logits go through numpy: torch's CPU argmax is not vectorised, numpy's is (several
    times faster over the ``B x (k + 1)`` vocabulary rows every greedy step reads; at batch 8 and
    k = 6 torch's took ~3% of a SmolLM2 step on 2 Zen 3 cores). NaN counts as the maximum in both.
    """
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.requires_grad:
        return logits.argmax(-1)
    return torch.as_tensor(logits.numpy().argmax(-1))


def _first_rejection(accept: torch.Tensor, num_valid: torch.Tensor | None) -> torch.Tensor:
    """Length of the all-True prefix of ``accept`` (B, k), capped at ``num_valid``."""
    n = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # (B,)
    return n if num_valid is None else torch.minimum(n, num_valid)


def verify_greedy(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_valid: torch.Tensor | None = None
) -> Verdict:
    """Accept the longest prefix equal to the target's argmax.

    Args:
        draft_tokens: ``(B, k)``.
        target_logits: ``(B, k + 1, V)``; position i scores the token after draft token i - 1.
        num_valid: ``(B,)`` how many draft tokens each row really proposed (None = all k).
    """
    target_tokens = greedy_tokens(target_logits)  # (B, k + 1)
    if draft_tokens.shape[1] == 0:  # a plain step: nothing to compare (each tensor op counts here)
        return Verdict(num_accepted=torch.zeros(len(target_tokens), dtype=torch.int64), tokens=target_tokens)
    n = _first_rejection(draft_tokens == target_tokens[:, :-1], num_valid)
    # accepted drafts equal the target's choice, so the target's argmax row is the output
    return Verdict(num_accepted=n, tokens=target_tokens)


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: list[torch.Generator | None],
    num_valid: torch.Tensor | None = None,
) -> Verdict:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft token x_i with probability ``min(1, p_i(x_i) / q_i(x_i))``. At the first
    rejection emit a recovered token from ``norm(max(p_i - q_i, 0))``; when all k are accepted emit
    a bonus token from ``p_k``. The emitted sequence is then distributed exactly as sampling from p.

    A draft without a distribution (``draft_probs=None``, e.g. n-gram lookup) is a point mass: it is
    verified by exact match against a sample from p, which is the same rule with ``q = one_hot(x)``.

    Args:
        draft_tokens: ``(B, k)``.
        draft_probs: ``(B, k, V)`` q, processed like p, or None.
        target_probs: ``(B, k + 1, V)`` p after temperature / top-k / top-p.
        generators: one per row (each request owns its randomness).
        num_valid: ``(B,)`` real proposals per row; positions past it are never accepted.
    """
    B, k = draft_tokens.shape
    if k == 0:
        tokens = torch.stack([sample(target_probs[b], generators[b]) for b in range(B)])
        return Verdict(num_accepted=torch.zeros(B, dtype=torch.int64), tokens=tokens)
    if draft_probs is None:
        # sample x_i ~ p_i at every position; accept while draft == sample; the first sample
        # that differs is the recovered token, sample k is the bonus.
        tokens = torch.stack([sample(target_probs[b], generators[b]) for b in range(B)])  # (B, k + 1)
        n = _first_rejection(draft_tokens == tokens[:, :-1], num_valid)
        return Verdict(num_accepted=n, tokens=tokens)

    p = target_probs[:, :-1]  # (B, k, V)
    p_x = p.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, k)
    q_x = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, k)
    u = torch.stack([torch.rand(k, generator=generators[b]) for b in range(B)])  # (B, k)
    # u < p/q  <=>  u * q < p  (q_x > 0 since x was sampled from q; this form avoids dividing)
    n = _first_rejection(u * q_x < p_x, num_valid)

    tokens = torch.empty(B, k + 1, dtype=torch.int64)
    tokens[:, :k] = draft_tokens
    rows = torch.arange(B)
    at = n.clamp(max=k)  # where the recovered/bonus token goes
    p_at = target_probs[rows, at]  # (B, V)
    q_at = torch.zeros_like(p_at)
    rejected = n < k
    if num_valid is not None:
        # a row that proposed fewer than k tokens and accepted all of them samples from p there
        rejected = rejected & (n < num_valid)
    q_at[rejected] = draft_probs[rows[rejected], at[rejected]]
    residual = (p_at - q_at).clamp_min(0)  # (B, V); equals p_at where q_at is zero (bonus)
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; any sample from p is then correct
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    for b in range(B):
        tokens[b, at[b]] = sample(residual[b], generators[b])
    return Verdict(num_accepted=n, tokens=tokens)


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    num_valid: torch.Tensor | None = None,
) -> Verdict:
    """Verify one step for a batch whose rows may be greedy or sampled, each with its own params.

    An all-greedy batch is :func:`verify_greedy`. Otherwise every row goes through
    :func:`verify_sampling` with p processed by its own params; a greedy row's p is the one-hot of
    the target's argmax and its q the one-hot of its draft tokens, which makes the rejection rule
    the argmax match (accept while the draft equals the argmax; emit the argmax) and draws nothing
    from the row's generator.

    Args:
        draft_tokens: ``(B, k)``.
        draft_probs: ``(B, k, V)`` q, or None for a draft without a distribution.
        target_logits: ``(B, k + 1, V)`` raw target logits.
        params: one per row.
        generators: one per row.
        num_valid: ``(B,)`` real proposals per row (None = all k).
    """
    if all(p.greedy for p in params):
        return verify_greedy(draft_tokens, target_logits, num_valid)
    B, V = target_logits.shape[0], target_logits.shape[-1]
    p = torch.stack([logits_to_probs(target_logits[b], params[b]) for b in range(B)])  # (B, k + 1, V)
    greedy_rows = [b for b in range(B) if params[b].greedy]
    if greedy_rows:  # argmax as a point mass: sampling from it is the argmax
        idx = torch.tensor(greedy_rows)
        p[idx] = torch.nn.functional.one_hot(greedy_tokens(target_logits[idx]), V).float()
        if draft_probs is not None:
            draft_probs = draft_probs.clone()
            draft_probs[idx] = torch.nn.functional.one_hot(draft_tokens[idx], V).float()
    return verify_sampling(draft_tokens, draft_probs, p, generators, num_valid)
