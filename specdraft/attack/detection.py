"""The defense's detection rule measured on recorded acceptance (issue 17).

The rule is :class:`specdraft.policy.RowWatch`'s (its thresholds are documented there): a request
is flagged as collapsed when its first-draft-token hits h of n proposals are below
``detect_fraction`` of the drafter's running average p *and* ``P(X <= h) < detect_alpha`` for a
request whose acceptance spreads around p as a Beta of concentration ``detect_concentration``
(a beta-binomial; None: a binomial), once the average rests on ``detect_warmup`` decayed
proposals.

To check it without a model, a request is recorded as the sequence of its proposals' first-token
outcomes (1: the target accepted the first draft token, 0: it did not) under a fixed k
(:class:`HitRecorder` wraps the policy of a real decode). :func:`replay` feeds such sequences
through a fresh :class:`~specdraft.policy.CostAwareK`, one request after another as a server at
batch 1 would (the policy, and so the running average, is shared by all of them), with the policy
scheduling each request's proposals: a request that is switched off verifies only its probes, which
take the next outcomes of its record; for a drafter whose proposals are free (``shadow=True``,
prompt lookup) it also takes one at every step it is off, as the engine's unverified proposals for
such a row do (:meth:`specdraft.policy.CostAwareK.shadow`); for a feature or model drafter
(``catch_up``: its ``read_back + 1``) a proposal after s steps without one first reads back the
outcomes of those positions, up to ``catch_up - 1`` of them, as its catch-up does
(:meth:`specdraft.policy.CostAwareK.hindsight`; recorded with ``HitRecorder(1, hindsight=True)``,
one outcome per position). It returns, per request, the step and
the proposal at which it was flagged (None: never), from which :func:`rates` gives the
false-positive rate over clean requests and the detection rate over adversarial ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.policy import CostAwareK, FixedK, RowWatch


@dataclass
class Flag:
    """When :func:`replay` saw a request flagged.

    Attributes:
        step: decode steps of the request up to and including the flagging one (None: never).
        proposal: proposals it had verified then (None: never).
        steps: decode steps it ran in all.
    """

    step: int | None
    proposal: int | None
    steps: int


class HitRecorder(FixedK):
    """A fixed-k policy that records, per request id, its proposals' first-token outcomes
    (``hits[request_id]``: 1 accepted, 0 rejected, one per proposal). With ``hindsight`` it asks
    every row for the outcomes a feature drafter reads back at its catch-up and records them in
    order too: at k = 1 that is one outcome per position (a step that accepts its draft token
    commits a bonus token, which the next catch-up reads back)."""

    def __init__(self, k: int, hindsight: bool = False):
        super().__init__(k)
        self.hits: dict[int, list[int]] = {}
        self.asks = hindsight

    def hindsight_rows(self, rows: list[int]) -> list[bool] | None:
        return [True] * len(rows) if self.asks else None

    def hindsight(self, rows: list[int], outcomes: list[list[bool]]) -> None:
        for r, hits in zip(rows, outcomes):
            self.hits.setdefault(r, []).extend(int(h) for h in hits)

    def update(self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None, **kw):
        if rows is None or k == 0:
            return
        for r, d, a in zip(rows, num_drafted.tolist(), num_accepted.tolist()):
            if d > 0:
                self.hits.setdefault(r, []).append(int(a >= 1))


def replay(
    requests: list[list[int]],
    watch: RowWatch | None = None,
    tokens: int | None = None,
    shadow: bool = False,
    catch_up: int = 0,
) -> list[Flag]:
    """Replay recorded requests through one fresh policy, one after another (module docstring).

    Args:
        requests: per request, its proposals' first-token outcomes (1 accepted, 0 rejected).
        watch: the row watch (thresholds) under test (default: the policy's).
        tokens: decode steps per request (default: the length of its record); a request whose
            record runs out before that decodes plainly for the rest.
        shadow: a request that is off takes an outcome at every step (a free drafter's
            unverified proposals), not only at its probes.
        catch_up: a drafter's ``read_back + 1``: a proposal after s steps without one first
            takes ``min(s, catch_up - 1)`` outcomes in hindsight (0: none).
    """
    policy = CostAwareK(watch=watch or RowWatch())
    one, zero = torch.tensor([1]), torch.tensor([0])
    flags = []
    for rid, hits in enumerate(requests):
        n_steps = len(hits) if tokens is None else tokens
        used, idle, flag = 0, 0, Flag(None, None, n_steps)
        for step in range(1, n_steps + 1):
            k = policy.choose([rid])
            if catch_up and k > 0 and policy.hindsight_rows([rid]) == [True]:
                seen = hits[used : used + min(idle, catch_up - 1)]
                policy.hindsight([rid], [[bool(h) for h in seen]])
                used += len(seen)
            off = shadow and bool(policy.unverified([rid]))
            verify = used < len(hits) and int(policy.trim(one, None, [rid])[0]) > 0
            idle = 0 if verify else idle + 1
            if verify:
                policy.update(1, one, torch.tensor([hits[used]]), 1e-4, 1e-2, None, [rid])
                used += 1
            else:
                policy.update(0, zero, zero, 0.0, 1e-2, None, [rid])
            if off and used < len(hits):
                policy.shadow([rid], [bool(hits[used])])
                used += 1
            if flag.step is None and rid in policy.collapsed:
                flag.step, flag.proposal = step, used
        flags.append(flag)
    return flags


def rates(flags: list[Flag], adversarial: list[bool]) -> dict:
    """``{"false_positive_rate", "detected_rate", "median_steps_to_flag"}`` over the replayed
    requests (``adversarial[i]``: request i is an attacked one); a rate with no request is None."""
    clean = [f.step is not None for f, a in zip(flags, adversarial) if not a]
    attacked = [f for f, a in zip(flags, adversarial) if a]
    steps = sorted(f.step for f in attacked if f.step is not None)
    return {
        "false_positive_rate": sum(clean) / len(clean) if clean else None,
        "detected_rate": sum(f.step is not None for f in attacked) / len(attacked) if attacked else None,
        "median_steps_to_flag": steps[len(steps) // 2] if steps else None,
    }
