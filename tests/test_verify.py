"""Verification with stub logits: greedy and rejection sampling, never / always / partially accepted."""

import math

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.verify import (
    SamplingParams,
    greedy_tokens,
    logits_to_probs,
    verify,
    verify_greedy,
    verify_sampling,
)

V = 6


def one_hot_logits(ids: list[list[int]], vocab: int = V) -> torch.Tensor:
    """(B, T, V) logits whose argmax at [b, t] is ids[b][t] (10 there, 0 elsewhere)."""
    t = torch.tensor(ids)
    return torch.nn.functional.one_hot(t, vocab).float() * 10


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


# ------------------------------------------------------------------------------------------ greedy
def test_greedy_tokens_pick_the_first_maximum_as_torch_argmax_does():
    x = torch.randn(3, 5, 64)
    x[0, 0, [7, 3, 40]] = 9.0  # a three-way tie: the first index wins
    x[1, 2, [50, 11]] = float("nan")  # NaN is the maximum, the first one
    x[2, 1] = 0.0  # a constant row
    for logits in (x, x[:, ::2], x[0, 0], x.to(torch.bfloat16)):  # a view, one row, a torch fallback
        got = greedy_tokens(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
    assert greedy_tokens(x)[0, 0] == 3 and greedy_tokens(x)[1, 2] == 11 and greedy_tokens(x)[2, 1] == 0


def test_greedy_never_always_partially_accepted_in_one_batch():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    target = one_hot_logits([[4, 2, 3, 5], [1, 2, 3, 5], [1, 2, 0, 5]])  # target argmax per position
    v = verify_greedy(draft, target)
    assert v.num_accepted.tolist() == [0, 3, 2]
    outputs = [v.tokens[b, : int(v.num_accepted[b]) + 1].tolist() for b in range(3)]
    assert outputs == [[4], [1, 2, 3, 5], [1, 2, 0]]  # recovered token 4; bonus 5; recovered 0


def test_greedy_accepts_only_a_prefix():
    # position 1 rejects, so position 2 matching does not count
    v = verify_greedy(torch.tensor([[1, 2, 3]]), one_hot_logits([[1, 0, 3, 5]]))
    assert v.num_accepted.tolist() == [1]
    assert v.tokens[0, :2].tolist() == [1, 0]


def test_greedy_num_valid_caps_acceptance_and_takes_the_targets_token_there():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3]])
    target = one_hot_logits([[1, 2, 3, 5], [1, 2, 3, 5]])
    v = verify_greedy(draft, target, num_valid=torch.tensor([1, 0]))
    assert v.num_accepted.tolist() == [1, 0]
    assert v.tokens[0, :2].tolist() == [1, 2]  # the target's own choice after the valid draft
    assert v.tokens[1, :1].tolist() == [1]


# ---------------------------------------------------------------------------------------- sampling
def test_sampling_always_accepts_when_q_equals_p():
    torch.manual_seed(0)
    B, k = 64, 4
    p = torch.rand(B, k + 1, V).softmax(-1)
    draft = torch.stack([torch.multinomial(p[b, :k], 1).squeeze(-1) for b in range(B)])  # (B, k)
    v = verify_sampling(draft, p[:, :k].clone(), p, gens(B))
    assert v.num_accepted.tolist() == [k] * B
    assert torch.equal(v.tokens[:, :k], draft)  # accepted drafts are kept; the bonus comes from p_k


def test_sampling_never_accepts_a_token_the_target_rules_out():
    B, k = 32, 3
    p = torch.full((B, k + 1, V), 1.0 / (V - 1))
    p[:, :, 0] = 0.0  # the target never emits token 0
    q = torch.zeros(B, k, V)
    q[:, :, 0] = 0.9
    q[:, :, 1] = 0.1
    draft = torch.zeros(B, k, dtype=torch.int64)  # all drafts are token 0
    v = verify_sampling(draft, q, p, gens(B))
    assert v.num_accepted.tolist() == [0] * B
    recovered = v.tokens[:, 0]
    assert (recovered != 0).all()  # the residual max(p - q, 0) has no mass on token 0


def test_sampling_partial_acceptance_and_residual():
    k = 3
    p = torch.zeros(1, k + 1, V)
    q = torch.zeros(1, k, V)
    p[0, 0, 2] = q[0, 0, 2] = 1.0  # position 0: p == q, accepted
    p[0, 1, 3], p[0, 1, 4] = 0.5, 0.5  # position 1: the draft's token 5 is impossible under p
    q[0, 1, 5] = 1.0
    p[0, 2:, 1] = 1.0
    q[0, 2, 1] = 1.0
    draft = torch.tensor([[2, 5, 1]])
    for seed in range(20):
        v = verify_sampling(draft, q, p, gens(1, seed))
        assert v.num_accepted.tolist() == [1]
        assert v.tokens[0, 0] == 2 and int(v.tokens[0, 1]) in (3, 4)


def test_sampling_num_valid_samples_from_p_not_the_residual():
    """A row that proposed 1 of k=2 tokens and had it accepted must sample position 1 from p."""
    p = torch.zeros(1, 3, V)
    p[0, 0, 1] = 1.0
    p[0, 1, 0] = p[0, 1, 2] = 0.5
    p[0, 2, 3] = 1.0
    q = torch.zeros(1, 2, V)
    q[0, 0, 1] = 1.0
    q[0, 1, 0] = 1.0  # junk q past num_valid: using it would always give token 2
    draft = torch.tensor([[1, 0]])
    seen = set()
    for seed in range(40):
        v = verify_sampling(draft, q, p, gens(1, seed), num_valid=torch.tensor([1]))
        assert v.num_accepted.tolist() == [1]
        seen.add(int(v.tokens[0, 1]))
    assert seen == {0, 2}


def test_sampling_k0_samples_from_p():
    p = torch.zeros(2, 1, V)
    p[0, 0, 4] = 1.0
    p[1, 0, 2] = 1.0
    v = verify_sampling(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, V), p, gens(2))
    assert v.num_accepted.tolist() == [0, 0]
    assert v.tokens[:, 0].tolist() == [4, 2]


def test_draft_without_distribution_is_checked_against_a_sample_from_p():
    k = 2
    p = torch.zeros(2, k + 1, V)
    p[:, 0, 1] = 1.0  # the target certainly emits 1 first
    p[0, 1, 2] = 1.0
    p[1, 1, 5] = 1.0
    p[:, 2, 3] = 1.0
    draft = torch.tensor([[1, 2], [1, 2]])
    v = verify_sampling(draft, None, p, gens(2))
    assert v.num_accepted.tolist() == [2, 1]
    assert v.tokens[0].tolist() == [1, 2, 3]  # both accepted, bonus 3
    assert v.tokens[1, :2].tolist() == [1, 5]  # second rejected, recovered = the sample from p


def test_draft_without_distribution_respects_num_valid():
    p = torch.zeros(1, 3, V)
    p[0, :, 1] = 1.0
    v = verify_sampling(torch.tensor([[1, 1]]), None, p, gens(1), num_valid=torch.tensor([0]))
    assert v.num_accepted.tolist() == [0]
    assert v.tokens[0, 0] == 1


def _first_token_histogram(q0: torch.Tensor, p: torch.Tensor, n: int, point_mass: bool) -> torch.Tensor:
    """Frequencies of the first output token over n rows whose single draft token is drawn from q0."""
    draft = torch.multinomial(q0, n, replacement=True, generator=torch.Generator().manual_seed(1234)).view(
        n, 1
    )
    q = None if point_mass else q0.expand(n, 1, V)
    v = verify_sampling(draft, q, p.expand(n, 2, V), gens(n, 99))
    return torch.bincount(v.tokens[:, 0], minlength=V).float() / n


@pytest.mark.parametrize("point_mass", [False, True], ids=["with-q", "no-q"])
def test_first_output_token_is_distributed_as_p(point_mass):
    """One position, exactly: accept/recover must turn a draft from q into a sample from p."""
    p0 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    q0 = torch.tensor([0.05, 0.1, 0.1, 0.15, 0.2, 0.4])  # deliberately far from p (TV 0.55)
    p = torch.stack([p0, torch.full((V,), 1.0 / V)]).unsqueeze(0)  # (1, 2, V)
    n = 6000
    freq = _first_token_histogram(q0, p, n, point_mass)
    tv = 0.5 * float((freq - p0).abs().sum())
    # P(TV >= t) <= 2^V exp(-2 n t^2) (Weissman et al. 2003); t for a one-in-a-million failure rate
    bound = math.sqrt((V * math.log(2) + math.log(1e6)) / (2 * n))
    assert tv < bound, (tv, bound)
    assert 0.5 * float((q0 - p0).abs().sum()) > 4 * bound  # a sampler that returned q would fail


# ------------------------------------------------------------------------------ sampling utilities
# ------------------------------------------------------------------------- verify: the one entry point
GREEDY, HOT = SamplingParams(), SamplingParams(temperature=1.0, seed=3)


def test_verify_of_an_all_greedy_batch_is_verify_greedy():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    target = one_hot_logits([[4, 2, 3, 5], [1, 2, 3, 5], [1, 2, 0, 5]])
    num_valid = torch.tensor([3, 2, 3])
    g = gens(3)
    v = verify(draft, None, target, [GREEDY] * 3, g, num_valid)
    w = verify_greedy(draft, target, num_valid)
    assert torch.equal(v.num_accepted, w.num_accepted) and torch.equal(v.tokens, w.tokens)
    assert [x.initial_seed() for x in g] == [0, 1, 2] and torch.equal(  # no generator was drawn from
        torch.rand(3, generator=g[0]), torch.rand(3, generator=gens(1)[0])
    )


@pytest.mark.parametrize("with_q", [True, False])
def test_verify_in_a_mixed_batch_greedy_rows_match_the_argmax_and_sampled_rows_sample(with_q):
    """Greedy rows get exactly what verify_greedy gives them; a sampled row gets what
    verify_sampling gives it alone with its own params and generator."""
    torch.manual_seed(1)
    B, k = 4, 3
    logits = torch.randn(B, k + 1, V) * 3
    draft = logits[:, :k].argmax(-1)  # (B, k): greedy rows accept at least up to a change below
    draft[0, 1] = (draft[0, 1] + 1) % V  # row 0 (greedy) rejects at 1
    draft[2, 2] = (draft[2, 2] + 1) % V  # row 2 (greedy) rejects at 2
    q = torch.rand(B, k, V).softmax(-1) if with_q else None
    params = [GREEDY, HOT, GREEDY, SamplingParams(temperature=0.7, top_k=3, seed=4)]
    v = verify(draft, q, logits, params, gens(B, 10))

    greedy = verify_greedy(draft, logits)
    for b in (0, 2):
        n = int(v.num_accepted[b])
        assert n == int(greedy.num_accepted[b]) == (1 if b == 0 else 2)
        assert torch.equal(v.tokens[b, : n + 1], greedy.tokens[b, : n + 1])
    for b in (1, 3):
        p = logits_to_probs(logits[b : b + 1], params[b])
        alone = verify_sampling(
            draft[b : b + 1], None if q is None else q[b : b + 1], p, gens(B, 10)[b : b + 1]
        )
        n = int(v.num_accepted[b])
        assert n == int(alone.num_accepted[0])
        assert torch.equal(v.tokens[b, : n + 1], alone.tokens[0, : n + 1])


def test_verify_breaks_a_greedy_tie_as_argmax_does_in_a_mixed_batch():
    """A greedy row whose top two logits tie takes the argmax's choice (the lower id), as a plain
    greedy decode would, even though temperature 0 alone would leave p at 1/2 on each."""
    n = 16
    logits = torch.zeros(n + 1, 2, V)
    logits[:, 0, 1] = logits[:, 0, 4] = 5.0  # a tie at position 0: argmax says 1
    draft = torch.full((n + 1, 1), 4)
    q = torch.nn.functional.one_hot(draft, V).float()
    v = verify(draft, q, logits, [HOT] + [GREEDY] * n, gens(n + 1))
    assert v.num_accepted[1:].tolist() == [0] * n
    assert v.tokens[1:, 0].tolist() == [1] * n


def test_logits_to_probs_temperature_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    torch.testing.assert_close(
        logits_to_probs(logits, SamplingParams(temperature=0.5)), (logits / 0.5).softmax(-1)
    )
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all()
    torch.testing.assert_close(p[:2], logits[:2].softmax(-1))
    full = logits.softmax(-1)  # [0.636, 0.234, 0.086, 0.032, 0.012]
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (p[:2] > 0).all() and (p[2:] == 0).all()  # 0.636 < 0.8, 0.636 + 0.234 >= 0.8
    torch.testing.assert_close(p[:2], full[:2] / full[:2].sum())
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # the most likely token always stays
    batched = logits_to_probs(torch.stack([logits, logits.flip(0)]), SamplingParams(temperature=1.0, top_k=1))
    assert batched.argmax(-1).tolist() == [0, 4] and (batched.max(-1).values == 1).all()


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"logprobs": -1}, {"logprobs": 21}],
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(SpecdraftError):
        SamplingParams(**kwargs)
