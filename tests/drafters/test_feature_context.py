"""Feature drafters keep their context across steps without drafts (issue 18).

A step with k = 0 (``--k auto``, the safe arm's plain probes) never reaches the drafter, yet the
target's features of the positions it commits must: the engine keeps every committed position's
(:class:`~specdraft.drafters.base.TargetFeatures`) and the drafter feeds what it has not fed at its
next proposal. So, whatever steps ran in between (k = 0 alternating with drafting, runs of several
k = 0 steps, rows leaving and a row joining), every proposal of every feature kind (EAGLE-style, with
a head subset, its EAGLE-2 tree, DREAM-style, with a local head fused in, CTC) is the one a fresh
draft makes when fed every pair of the row's context at once from one full target forward; and it is
not the one of a draft that started over from the last forward's pair (what happened before), so the
test can fail. The context starts at the last prompt position, or ``prompt_pairs`` before it for a
draft that reads the prompt (the engine keeps the prefill's features). Greedy output stays plain
decoding's."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters.base import DraftContext, TargetFeatures
from specdraft.engine import Engine, Request
from specdraft.policy import FixedK
from specdraft.verify import SamplingParams
from tests.helpers import kept_features
from tests.test_tv_all_drafters import PROMPT, make_case, peaked

KINDS = ["feature", "feature-head", "tree-feature", "dream", "local-fused", "ctc"]


class Pattern(FixedK):
    """k at the steps ``pattern`` marks 1, none (k = 0) at those it marks 0, cyclically."""

    def __init__(self, k: int, pattern: tuple[int, ...]):
        super().__init__(k)
        self.pattern, self.steps = pattern, 0

    def choose(self, rows=None, lag=None) -> int:
        self.steps += 1
        return self.k if self.pattern[(self.steps - 1) % len(self.pattern)] else 0


def _rows(prop, b: int):
    """Row b's proposal: a tree's (tokens, parents), a chain's valid tokens (None: nothing)."""
    if prop.trees is not None:
        tree = prop.trees[b]
        return None if tree is None else (tree.tokens.tolist(), tree.parents.tolist())
    n = int(prop.num_valid[b]) if prop.num_valid is not None else prop.tokens.shape[1]
    return prop.tokens[b, :n].tolist() or None


class Recording:
    """Wraps a drafter; keeps, per proposing row, its committed tokens, the first position of the
    draft's context, k, the draft cache's capacity, what it proposed and the draft's logits for the first
    draft token (after the real pairs: :meth:`FeatureDrafterBase.start`)."""

    def __init__(self, inner):
        self.inner, self.seen, self.begun = inner, [], None
        self.name, self.vocab_size = inner.name, inner.vocab_size
        self.hidden_layers = inner.hidden_layers
        self.proposes_trees = getattr(inner, "proposes_trees", False)
        base = getattr(inner, "feature", inner)  # a tree drafter's feature draft
        start = base.start

        def recorded(state, ctx, **kw):
            self.begun = start(state, ctx, **kw)
            return self.begun

        base.start = recorded

    def new_state(self, batch_size, capacity):
        return self.inner.new_state(batch_size, capacity)

    def propose(self, state, ctx, k):
        prop = self.inner.propose(state, ctx, k)
        for b, L in enumerate(ctx.lengths.tolist()):
            if _rows(prop, b) is not None:
                first = int(state.start[b])
                row = (ctx.tokens[b, :L].tolist(), first, k, state.kv.capacity, _rows(prop, b))
                self.seen.append((*row, self.begun.logits[b]))
        return prop

    def observe(self, state, num_accepted, verified=None):
        self.inner.observe(state, num_accepted, verified)


def fed_at_once(rec: Recording, target, tokens: list[int], start: int, k: int, capacity: int):
    """What a fresh draft proposes after ``tokens`` when fed the pairs ``start .. L - 2`` at once,
    with the target's features from one forward over the whole context; and its first logits."""
    drafter = rec.inner
    L = len(tokens)
    out = target.forward(
        target.new_state(1, L + 1),
        torch.tensor([tokens]),
        torch.arange(L).unsqueeze(0),
        hidden_layers=drafter.hidden_layers,
    )
    pairs = getattr(drafter, "feature", drafter).prompt_pairs  # it starts that many before the answer
    hidden = kept_features({i: h[:, : L - 1] for i, h in out.hidden.items()}, [0], capacity).hidden
    kept = TargetFeatures(hidden, torch.tensor([start + pairs]))
    buf = torch.zeros(1, capacity, dtype=torch.int64)
    buf[0, :L] = torch.tensor(tokens)
    ctx = DraftContext(buf, torch.tensor([L]), [SamplingParams()], [None], features=kept)
    state = drafter.new_state(1, capacity)
    state.max_lag = capacity  # every pair from start on, however many
    prop = drafter.propose(state, ctx, k)
    return _rows(prop, 0), rec.begun.logits[0]


def run(engine: Engine, prompts: list[list[int]], lengths: list[int], join_after: int) -> list[list[int]]:
    """Decode; the last prompt joins the batch after ``join_after`` steps (rows leave as they end)."""
    reqs = [Request(p, n) for p, n in zip(prompts, lengths)]
    engine.add(reqs[:-1])
    out: dict[int, list[int]] = {}
    steps = 0
    while engine.active:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)
        steps += 1
        if steps == join_after:
            engine.add(reqs[-1:])
    return [out[r.id] for r in reqs]


@pytest.mark.parametrize("prompt_pairs", [0, 3], ids=["answer", "prompt"])
@pytest.mark.parametrize("pattern", [(1, 0), (1, 0, 0, 0, 1, 1, 0, 0, 0)], ids=["alternate", "runs"])
@pytest.mark.parametrize("name", KINDS)
def test_proposals_after_plain_steps_are_a_draft_fed_every_pair(name, pattern, prompt_pairs):
    target = peaked(seed=10, scale=12.0)
    case = make_case(name, target)
    getattr(case.drafter, "feature", case.drafter).prompt_pairs = prompt_pairs
    rec = Recording(case.drafter)
    prompts = [PROMPT + [i] * (1 + 2 * i) for i in range(4)]
    lengths = [30, 12, 22, 16]
    engine = Engine(target, rec, Pattern(case.policy.k_max, pattern), hidden_layers=rec.hidden_layers)
    assert run(engine, prompts, lengths, 4) == run(Engine(target), prompts, lengths, 4)
    assert len(rec.seen) >= 12
    joined = [s for s in rec.seen if s[0][: len(prompts[-1])] == prompts[-1]]
    assert joined  # the row that joined proposed too
    restarted = 0
    for tokens, first, k, capacity, prop, logits in rec.seen:
        assert first == next(len(p) for p in prompts if p == tokens[: len(p)]) - 1 - prompt_pairs
        want, want_logits = fed_at_once(rec, target, tokens, first, k, capacity)
        assert prop == want
        assert torch.allclose(logits, want_logits, atol=1e-4)
        _, over = fed_at_once(rec, target, tokens, len(tokens) - 2, k, capacity)
        restarted += not torch.allclose(logits, over, atol=1e-3)
    # a draft that starts over from the last forward's pair (as before) drafts from other logits
    assert restarted > len(rec.seen) / 2


@pytest.mark.parametrize("name", KINDS)
def test_after_a_stretch_longer_than_max_lag_the_context_starts_over(name):
    """A row that has proposed and then sat out more than ``max_lag`` steps (here 4) feeds only its
    last ``max_lag`` pairs: its proposal is the one of a fresh draft fed those pairs at once, its
    catch-up as priced by the policy (``lag``) is at most ``max_lag``, and greedy output stays
    plain decoding's."""
    target = peaked(seed=10, scale=12.0)
    case = make_case(name, target)
    getattr(case.drafter, "feature", case.drafter).max_lag = 4
    rec = Recording(case.drafter)
    prompts = [PROMPT + [i] * (1 + 2 * i) for i in range(2)]
    lengths = [30, 26]
    pattern = (1, 0, 0, 0, 0, 0, 0, 0)  # 7 steps without drafts between proposals
    engine = Engine(target, rec, Pattern(case.policy.k_max, pattern), hidden_layers=rec.hidden_layers)
    assert run(engine, prompts, lengths, 1) == run(Engine(target), prompts, lengths, 1)
    later = [s for s in rec.seen if s[1] != next(len(p) for p in prompts if p == s[0][: len(p)]) - 1]
    assert later  # proposals after a long stretch: their context started over
    for tokens, first, k, capacity, prop, logits in later:
        assert first == len(tokens) - 1 - 4
        want, want_logits = fed_at_once(rec, target, tokens, first, k, capacity)
        assert prop == want
        assert torch.allclose(logits, want_logits, atol=1e-4)
    state = rec.new_state(1, 64)
    state.fed[0] = 3
    assert state.lag(torch.tensor([40])).tolist() == [4]


class LagPattern(Pattern):
    """:class:`Pattern`, keeping the catch-up ``lag`` the engine priced at each step that drafts."""

    def __init__(self, k: int, pattern: tuple[int, ...]):
        super().__init__(k, pattern)
        self.lags: list[list[int]] = []

    def choose(self, rows=None, lag=None) -> int:
        k = super().choose(rows, lag)
        if k:
            self.lags.append(lag.tolist())
        return k


@pytest.mark.parametrize("name", ["feature", "ctc"])
def test_a_first_proposal_after_more_than_max_lag_steps_feeds_its_last_max_lag_pairs(name):
    """A row that first proposes after more than ``max_lag`` (here 4) steps without drafts feeds its
    last ``max_lag`` pairs, not every answer pair so far, and the catch-up the policy prices
    (``lag``) says so from the row's first step on: before, it read 0 for a row that had not
    proposed (a draft reading no prompt pairs), so a late first proposal's catch-up was charged to
    the draft token (``results/feature-q8-2026-12-05/README.md``)."""
    target = peaked(seed=10, scale=12.0)
    case = make_case(name, target)
    case.drafter.max_lag = 4
    rec = Recording(case.drafter)
    prompts = [PROMPT + [i] * (1 + 2 * i) for i in range(2)]
    policy = LagPattern(case.policy.k_max, (0, 0, 0, 0, 0, 0, 0, 1))  # first drafts at step 8
    engine = Engine(target, rec, policy, hidden_layers=rec.hidden_layers)
    assert run(engine, prompts, [30, 26], 1) == run(Engine(target), prompts, [30, 26], 1)
    assert rec.seen and policy.lags and all(lag == [4, 4] for lag in policy.lags)
    for tokens, first, k, capacity, prop, logits in rec.seen:
        assert first == len(tokens) - 1 - 4
        want, want_logits = fed_at_once(rec, target, tokens, first, k, capacity)
        assert prop == want
        assert torch.allclose(logits, want_logits, atol=1e-4)
    state = rec.new_state(1, 64)
    assert state.lag(torch.tensor([10])).tolist() == [0]  # its first step: nothing to feed yet
    assert state.lag(torch.tensor([12])).tolist() == [2] and state.lag(torch.tensor([40])).tolist() == [4]


class Asking(Pattern):
    """:class:`Pattern` that asks every row for its outcomes in hindsight (``hindsight_rows``)."""

    def hindsight_rows(self, rows):
        return [True] * len(rows)

    def hindsight(self, rows, outcomes):
        pass


class ReadBack(Recording):
    """:class:`Recording`, keeping each row's tokens, context start, cache capacity and hindsight."""

    def __init__(self, inner):
        super().__init__(inner)
        self.read = []

    def propose(self, state, ctx, k):
        prop = super().propose(state, ctx, k)
        for b, L in enumerate(ctx.lengths.tolist()):
            if prop.hindsight is not None and prop.hindsight[b]:
                row = (ctx.tokens[b, :L].tolist(), int(state.start[b]), state.kv.capacity)
                self.read.append((*row, prop.hindsight[b]))
        return prop


@pytest.mark.parametrize("name", ["feature", "feature-head", "dream"])
def test_hindsight_tells_what_proposals_at_the_catch_up_positions_would_have_got(name):
    """A proposal after steps without drafts reads back, at each real pair but its last, whether the
    greedy token there is the one the target committed: the n outcomes of a row of length L are
    those of proposals at lengths L - n .. L - 1, each what a fresh draft fed the row's pairs up to
    there proposes, against the committed token. Both outcomes occur, so the check can fail."""
    target = peaked(seed=10, scale=12.0)
    case = make_case(name, target)
    rec = ReadBack(case.drafter)
    prompts = [PROMPT + [i] * (1 + 2 * i) for i in range(3)]
    lengths = [30, 12, 22]
    engine = Engine(target, rec, Asking(1, (1, 0, 0, 0)), hidden_layers=rec.hidden_layers)
    assert run(engine, prompts, lengths, 2) == run(Engine(target), prompts, lengths, 2)
    outcomes = []
    for tokens, first, capacity, read in rec.read:
        L, n = len(tokens), len(read)
        for j, hit in enumerate(read):
            want, _ = fed_at_once(rec, target, tokens[: L - n + j], first, 1, capacity)
            assert hit == (want[0] == tokens[L - n + j])
            outcomes.append(hit)
    assert len(outcomes) >= 20 and 0 < sum(outcomes) < len(outcomes), outcomes
