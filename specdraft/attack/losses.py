"""The two losses of an acceleration-collapse attack, and the projection that keeps them apart.

Mistletoe (arXiv 2605.14005): craft an input on which the draft's proposals are rejected while the
target still gives the same answer. Both losses are computed on the target's own greedy
continuation ``y`` of the clean prompt, teacher-forced: the sequence is ``prompt + y`` and the
logits at positions ``Tp - 1 .. Tp + n - 2`` are the next-token distributions over ``y``
(p: the target, q: the draft, as everywhere in specdraft).

- *degradation* (to minimise): the expected acceptance of ``y`` under the draft, averaged over the
  continuation. Greedy verification accepts a draft token only when it is the target's token, so
  it is q(y_i), the draft's probability of the target token; sampling accepts with probability
  ``E_{x ~ q} min(1, p(x) / q(x)) = sum_x min(p(x), q(x))``.
- *preservation* (to keep at 0): ``KL(p_clean || p_attacked)`` over the continuation positions.
  When the target's argmax at every position stays ``y_i``, its greedy output is exactly ``y``
  (:func:`keeps_argmax`).

A step follows ``project_out(g_deg, g_pres) + lam * g_pres``: the degradation gradient with its
component along the preservation gradient removed (it lies in the null space of the latter, so to
first order it leaves the target's distributions unchanged), plus the preservation pull.

Both models are differentiable transformers causal LMs in fp32 that take ``inputs_embeds``
(:class:`Models`); a draft with a truncated vocabulary (``head``) is mapped back to the target's
ids, its other tokens having probability 0.
"""

from __future__ import annotations

import inspect
from copy import deepcopy
from dataclasses import dataclass

import torch


@dataclass
class Models:
    """The differentiable target and draft an attack works on.

    Attributes:
        target: transformers causal LM of the target (fp32, frozen).
        draft: transformers causal LM of the draft (same tokenizer; fp32, frozen).
        head: ``(Vd,)`` the target ids the draft may propose (its output rows, or the rows of its
            full-width head that are used), or None when it proposes from the whole vocabulary.
    """

    target: torch.nn.Module
    draft: torch.nn.Module
    head: torch.Tensor | None = None

    @property
    def target_embedding(self) -> torch.Tensor:
        """``(V, C)`` the target's input embedding matrix."""
        return self.target.get_input_embeddings().weight

    @property
    def draft_embedding(self) -> torch.Tensor:
        """``(V, Cd)`` the draft's input embedding matrix."""
        return self.draft.get_input_embeddings().weight

    def target_logprobs(self, embeds: torch.Tensor, keep: int | None = None, prefix=None) -> torch.Tensor:
        """``(B, T, C)`` input embeddings -> ``(B, T, V)`` the target's next-token log-probabilities
        (``(B, keep, V)``: only the last ``keep`` positions, the LM head run on those alone; ``prefix``:
        a :class:`Prefix` whose target keys and values come before ``embeds``)."""
        cache = None if prefix is None else prefix.target
        return torch.log_softmax(_logits(self.target, embeds, keep, cache), -1)

    def draft_logprobs(self, embeds: torch.Tensor, keep: int | None = None, prefix=None) -> torch.Tensor:
        """``(B, T, Cd)`` input embeddings -> ``(B, T, V)`` the draft's log-probabilities over the
        target's vocabulary (``-inf`` outside a truncated head; ``keep`` and ``prefix`` as in
        :meth:`target_logprobs`)."""
        logits = _logits(self.draft, embeds, keep, None if prefix is None else prefix.draft)
        if self.head is None:
            return torch.log_softmax(logits, -1)
        if logits.shape[-1] != self.head.shape[0]:  # a full-width head of which only ``head`` is used
            logits = logits[..., self.head]
        logq = torch.log_softmax(logits, -1)
        V = self.target_embedding.shape[0]
        full = logq.new_full((*logq.shape[:-1], V), float("-inf"))
        return full.index_copy(-1, self.head, logq)


class Prefix:
    """Both models' keys and values of an input's first positions, computed once (no
    gradient), so that inputs which differ only after them run forward from there: the continuous
    attack's steps when it perturbs a window at the end of a long prompt, the discrete attack's
    candidates after the message's head. Each forward on it runs on a copy: the prefix itself never
    changes, and no forward's graph reaches into the next one."""

    def __init__(self, models: Models, target_embeds: torch.Tensor, draft_embeds: torch.Tensor):
        self.target = _prefill(models.target, target_embeds)
        self.draft = _prefill(models.draft, draft_embeds)
        self._repeated = {1: self}

    def repeated(self, batch: int) -> Prefix:
        """The same prefix before each of ``batch`` inputs (made once per batch size)."""
        if batch not in self._repeated:
            copy = Prefix.__new__(Prefix)
            copy._repeated = {}
            copy.target, copy.draft = deepcopy(self.target), deepcopy(self.draft)
            copy.target.batch_repeat_interleave(batch)
            copy.draft.batch_repeat_interleave(batch)
            self._repeated[batch] = copy
        return self._repeated[batch]


def _cache_kw(model: torch.nn.Module) -> str:
    # transformers 5.2x renamed past_key_values to cache (as in specdraft.models.hf)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def _prefill(model: torch.nn.Module, embeds: torch.Tensor):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if embeds.shape[1]:
        model(inputs_embeds=embeds, use_cache=True, logits_to_keep=1, **{_cache_kw(model): cache})
    return cache


def _logits(model: torch.nn.Module, embeds: torch.Tensor, keep: int | None, cache=None) -> torch.Tensor:
    extra = {} if keep is None else {"logits_to_keep": keep}
    if cache is None:
        return model(inputs_embeds=embeds, use_cache=False, **extra).logits.float()
    extra[_cache_kw(model)] = deepcopy(cache)  # the forward appends to it
    return model(inputs_embeds=embeds, use_cache=True, **extra).logits.float()


def teacher_forced(prompt: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The input that scores a continuation: ``(B, Tp, C)`` prompt and ``(B, n, C)`` continuation
    embeddings -> ``(B, Tp + n - 1, C)``, whose last n positions predict ``y`` (pass ``keep=n`` to
    :meth:`Models.target_logprobs`; ``y``'s last token predicts nothing and is left out)."""
    return torch.cat([prompt, y[:, :-1]], 1)


def continuation_slice(prompt_len: int, n: int) -> slice:
    """The logit positions that predict a continuation of ``n`` tokens after ``prompt_len``."""
    return slice(prompt_len - 1, prompt_len - 1 + n)


def degradation(logq: torch.Tensor, y: torch.Tensor, logp: torch.Tensor | None = None) -> torch.Tensor:
    """Expected acceptance of the continuation under the draft, mean over positions.

    Args:
        logq: ``(B, n, V)`` the draft's log-probabilities at the continuation positions.
        y: ``(n,)`` or ``(B, n)`` the target's continuation.
        logp: ``(B, n, V)`` the target's log-probabilities there for sampling (``sum_x min(p, q)``);
            None for greedy (``q(y_i)``).

    Returns:
        ``(B,)`` the mean acceptance per sequence.
    """
    if logp is not None:
        return torch.minimum(logp.exp(), logq.exp()).sum(-1).mean(-1)
    y = y.expand(logq.shape[0], -1) if y.dim() == 1 else y
    return logq.gather(-1, y.unsqueeze(-1)).squeeze(-1).exp().mean(-1)


def preservation(logp_clean: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``KL(p_clean || p)`` per position, mean over positions: ``(B, n, V)`` twice -> ``(B,)``."""
    p_clean = logp_clean.exp()
    return (p_clean * (logp_clean - logp)).sum(-1).mean(-1)


def keeps_argmax(logp: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(B,)`` whether the target's argmax is ``y_i`` at every continuation position, i.e. whether
    its greedy output on the attacked prompt is still ``y``."""
    return (logp.argmax(-1) == y).all(-1)


def project_out(g: torch.Tensor, h: torch.Tensor, eps: float = 1e-20) -> torch.Tensor:
    """``g`` with its component along ``h`` removed: ``g - (g.h / h.h) h`` (flattened dot products).

    ``g`` unchanged when ``h`` is (numerically) zero, as it is at the clean input, where the KL
    has its minimum.
    """
    hh = (h * h).sum()
    if hh <= eps:
        return g
    return g - ((g * h).sum() / hh) * h


def simulated_accepted_length(match: list[bool] | torch.Tensor, k: int) -> float:
    """Mean accepted length of greedy speculative decoding with fixed ``k`` (bonus token included).

    ``match[i]``: the draft's argmax after the true prefix ``prompt + y[:i]`` is ``y_i``. Greedy, a
    draft keeps the true prefix while its tokens are accepted, so a step starting at i accepts the
    run of matches from i (at most k, and at most what leaves room for its own token within n:
    tokens past the budget are not counted) and emits one more token, so the figure is n / steps.
    Exact for a draft model under a fixed k; ``k = 0`` is plain decoding (1.0).
    """
    match = [bool(m) for m in match]
    n, i, steps, accepted = len(match), 0, 0, 0
    while i < n:
        m = 0
        while m < min(k, n - i - 1) and match[i + m]:  # the step's own token must fit too
            m += 1
        accepted, steps, i = accepted + m, steps + 1, i + m + 1
    return (accepted + steps) / steps if steps else 0.0


@torch.no_grad()
def greedy_from_embeds(model: torch.nn.Module, embeds: torch.Tensor, n: int) -> list[int]:
    """The greedy continuation of ``n`` tokens of a causal LM from ``(1, T, C)`` input embeddings
    (one prefill, then one-token steps on a transformers ``DynamicCache``)."""
    from transformers import DynamicCache

    kw = _cache_kw(model)
    if n < 1:
        return []
    cache = DynamicCache(config=model.config)
    logits = model(inputs_embeds=embeds, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < n:
        x = torch.tensor([[tokens[-1]]])
        logits = model(input_ids=x, use_cache=True, **{kw: cache}).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    """The prompt's perplexity under ``model``: ``exp`` of the mean next-token loss over ``ids[1:]``."""
    if len(ids) < 2:
        return float("nan")
    x = torch.tensor([ids])
    logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, x[0, 1:]).exp())
