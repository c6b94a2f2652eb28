"""Token-tree verification with stub logits: tree shape and mask, greedy paths, chains against
verify.verify, and the output distribution of multi-candidate rejection sampling (exact TV bounds)."""

import math

import pytest
import torch

from specdraft import tree as tree_mod
from specdraft.errors import SpecdraftError
from specdraft.tree import TokenTree, verify_tree, verify_tree_greedy, verify_tree_sampling
from specdraft.verify import SamplingParams, logits_to_probs, verify

V = 6
GREEDY, HOT = SamplingParams(), SamplingParams(temperature=1.0)


def argmax_logits(ids: list[int]) -> torch.Tensor:
    """(T, V) logits whose argmax at row t is ids[t]."""
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float() * 10


# -------------------------------------------------------------------------------------- the tree
def test_from_chains_shares_prefixes_in_topological_order():
    t = TokenTree.from_chains([[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3]])
    assert t.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert t.parents.tolist() == [-1, 0, 1, 1, 0, -1]
    assert t.depth.tolist() == [1, 2, 3, 3, 2, 1]
    assert t.children == {-1: [0, 5], 0: [1, 4], 1: [2, 3]}


def test_from_chains_keeps_the_first_chains_q_row_for_a_shared_node():
    a, b = torch.eye(V)[[1, 2]], torch.eye(V)[[3, 4]]
    t = TokenTree.from_chains([[1, 2], [1, 4]], [a, b])
    assert t.tokens.tolist() == [1, 2, 4]
    assert torch.equal(t.draft_probs, torch.stack([a[0], a[1], b[1]]))


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-2]])
def test_a_parent_after_its_child_is_an_error(parents):
    with pytest.raises(SpecdraftError):
        TokenTree(torch.zeros(len(parents), dtype=torch.int64), torch.tensor(parents))


def test_step_mask_is_exactly_the_ancestor_relation():
    t = TokenTree.from_chains([[1, 2, 3], [1, 4], [5, 6], [5, 7, 0]])
    root, S = 7, 20
    mask = t.step_mask(root, S)
    assert mask.shape == (t.num_nodes + 1, S)
    assert mask[:, : root + 1].all()  # context and root: seen by every query
    assert not mask[:, root + 1 + t.num_nodes :].any()  # nothing past the nodes' slots
    assert not mask[0, root + 1 :].any()  # the root sees no node
    parents = t.parents.tolist()
    for i in range(t.num_nodes):  # walk the parents by hand
        seen, j = set(), i
        while j >= 0:
            seen.add(j)
            j = parents[j]
        row = mask[1 + i, root + 1 : root + 1 + t.num_nodes]
        assert set(row.nonzero().squeeze(1).tolist()) == seen, i
    assert t.positions(root).tolist() == [7, 8, 9, 10, 9, 8, 9, 9, 10]  # root + depth
    assert t.slots(root).tolist() == list(range(7, 7 + t.num_nodes + 1))
    with pytest.raises(SpecdraftError):
        t.step_mask(root, root + t.num_nodes)


def test_a_chains_mask_is_causal():
    t = TokenTree.chain([3, 1, 4, 1])
    assert torch.equal(t.step_mask(5), torch.ones(5, 10, dtype=torch.bool).tril(5))
    assert torch.equal(t.positions(5), t.slots(5))


# ------------------------------------------------------------------------------------------ greedy
def test_greedy_never_accepted():
    t = TokenTree.from_chains([[1, 2], [3, 4]])
    v = verify_tree_greedy(t, argmax_logits([5, 0, 0, 0, 0]))
    assert v.num_accepted == 0 and v.nodes.tolist() == [] and v.tokens.tolist() == [5]


def test_greedy_always_accepted_branch_gets_the_bonus():
    t = TokenTree.from_chains([[1, 2], [3, 4]])  # nodes 0:1 1:2 2:3 3:4
    #   after:  root  1  2  3  4
    v = verify_tree_greedy(t, argmax_logits([3, 0, 0, 4, 5]))
    assert v.nodes.tolist() == [2, 3] and v.tokens.tolist() == [3, 4, 5]


def test_greedy_partially_accepted_branches_the_longest_wins():
    # root -> 1 -> 2 -> 3 ; root -> 1 -> 4 -> 5 -> 0 ; root -> 2
    t = TokenTree.from_chains([[1, 2, 3], [1, 4, 5, 0], [2]])  # nodes 0:1 1:2 2:3 3:4 4:5 5:0 6:2
    #   after:   root 1  2  3  4  5  0  2
    logits = argmax_logits([1, 4, 3, 0, 5, 1, 0, 0])
    v = verify_tree_greedy(t, logits)
    assert v.nodes.tolist() == [0, 3, 4] and v.tokens.tolist() == [1, 4, 5, 1]  # 0 rejected after 5
    v = verify_tree(t, logits, GREEDY, None)
    assert v.nodes.tolist() == [0, 3, 4]
    # a match below a rejected node does not count: 3 is the argmax after 2, but 2 is rejected
    v = verify_tree_greedy(t, argmax_logits([1, 5, 3, 0, 0, 0, 0, 0]))
    assert v.nodes.tolist() == [0] and v.tokens.tolist() == [1, 5]


def test_a_repeated_sibling_is_never_followed():
    """Siblings built directly with the same token: the first one is the candidate, as the
    rejection rule with point masses has it, even when the repeat's branch would go deeper."""
    t = TokenTree(torch.tensor([3, 1, 3, 2]), torch.tensor([-1, 0, -1, 2]))
    assert t.repeats.tolist() == [False, False, True, False]
    #   after:      root 3  1  3  2
    v = verify_tree_greedy(t, argmax_logits([3, 5, 0, 2, 4]))
    assert v.nodes.tolist() == [0] and v.tokens.tolist() == [3, 5]
    p = torch.eye(V)[[3, 5, 0, 2, 4]]  # the same, sampled from point masses
    v = verify_tree_sampling(t, p, torch.Generator().manual_seed(0))
    assert v.nodes.tolist() == [0] and v.tokens.tolist() == [3, 5]


def test_an_empty_tree_is_a_plain_step():
    t = TokenTree.from_chains([])
    assert verify_tree(t, argmax_logits([4]), GREEDY, None).tokens.tolist() == [4]
    v = verify_tree(t, torch.log(torch.eye(V)[[2]]), HOT, torch.Generator().manual_seed(0))
    assert v.tokens.tolist() == [2] and v.num_accepted == 0


def test_logit_rows_must_match_the_nodes():
    with pytest.raises(SpecdraftError):
        verify_tree(TokenTree.chain([1, 2]), argmax_logits([1, 2]), GREEDY, None)


# ----------------------------------------------------------------------- a chain is verify.verify
@pytest.mark.parametrize("mode", ["greedy", "with-q", "no-q"])
def test_a_chain_tree_verifies_as_verify_verify_draw_for_draw(mode):
    k, trials = 4, 60
    g = torch.Generator().manual_seed(5)
    params = GREEDY if mode == "greedy" else SamplingParams(temperature=1.0, top_k=4)
    accepted = set()
    for s in range(trials):
        logits = torch.randn(k + 1, V, generator=g) * 2
        draft = logits[:k].argmax(-1)
        if s % 3:  # change one draft token so that some steps reject
            i = int(torch.randint(k, (1,), generator=g))
            draft[i] = (draft[i] + 1 + s % (V - 1)) % V
        q = logits_to_probs(torch.randn(k, V, generator=g), params) if mode == "with-q" else None
        ref = verify(
            draft.view(1, k),
            None if q is None else q.view(1, k, V),
            logits.view(1, k + 1, V),
            [params],
            [torch.Generator().manual_seed(s)],
        )
        v = verify_tree(TokenTree.chain(draft.tolist(), q), logits, params, torch.Generator().manual_seed(s))
        n = int(ref.num_accepted[0])
        assert v.num_accepted == n and v.nodes.tolist() == list(range(n))
        assert v.tokens.tolist() == ref.tokens[0, : n + 1].tolist()
        accepted.add(n)
    assert len(accepted) >= 3  # never, partially and fully accepted chains were all compared


# ------------------------------------------------------------------- sampling: the distribution
P1 = torch.tensor([0.35, 0.05, 0.25, 0.0, 0.2, 0.15])  # the target after the root
Q1 = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.05, 0.15])  # a draft that disagrees with it (TV 0.6)


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """(V, V) target and draft distributions of the second token given the first."""
    g = torch.Generator().manual_seed(11)
    p2 = (torch.randn(V, V, generator=g) * 1.5).softmax(-1)
    p2[:, 1] = 0.0  # a token the target never emits second
    q2 = (torch.randn(V, V, generator=g) * 1.5).softmax(-1)
    return p2 / p2.sum(-1, keepdim=True), q2


PARENTS = torch.tensor([-1, 0, -1, 2, -1, 4])  # three branches of two tokens: 0 -> 1, 2 -> 3, 4 -> 5


def _draw_tree(kind: str, q2: torch.Tensor, g: torch.Generator) -> TokenTree:
    """Three branches of two tokens below the root, drafted as ``kind`` says.

    i.i.d. siblings stay apart even when they draw the same token (SpecInfer's rule): merging such
    a duplicate would skip a round whose rejection is certain, and bias the residual.
    """
    if kind in ("point-mass", "point-mass-rows"):  # deterministic candidates (lookup-like)
        tokens = torch.tensor([2, 0, 1, 3, 0, 4])
        return TokenTree(tokens, PARENTS, torch.eye(V)[tokens] if kind == "point-mass-rows" else None)
    tokens, rows, q1 = [], [], Q1
    for _ in range(3):
        x1 = int(torch.multinomial(q1, 1, generator=g))
        x2 = int(torch.multinomial(q2[x1], 1, generator=g))
        tokens += [x1, x2]
        rows += [q1, q2[x1]]
        if kind == "without-replacement":  # the next sibling is drawn from q1 without x1
            q1 = q1.clone()
            q1[x1] = 0.0
            q1 /= q1.sum()
    return TokenTree(torch.tensor(tokens), PARENTS, torch.stack(rows))


UNIFORM = torch.full((1, V), 1.0 / V)
ROWS = torch.tensor(
    [0, 1, 7, 3, 7, 5, 7]
)  # [root, nodes]: P1, then p2 after a first token, any p after a second


def _first_two_tokens(kind: str, n: int) -> torch.Tensor:
    """(n, 2): the first two output tokens of n independent steps (a step that emits one token is
    followed by a plain step, a sample from p2 after it)."""
    p2, q2 = _tables()
    g = torch.Generator().manual_seed(2024)
    out = torch.empty(n, 2, dtype=torch.int64)
    for i in range(n):
        t = _draw_tree(kind, q2, g)
        p = torch.cat([P1.view(1, V), p2[t.tokens], UNIFORM]).index_select(0, ROWS)
        v = verify_tree_sampling(t, p, g)
        second = v.tokens[1] if v.num_accepted else torch.multinomial(p2[v.tokens[0]], 1, generator=g)[0]
        out[i, 0], out[i, 1] = v.tokens[0], second
    return out


def _tv_and_bound(samples: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """TV between the empirical histogram of ``samples`` (bins 0..K-1) and ``expected`` (K,), and the
    distance it exceeds with probability 1e-6 (Weissman et al. 2003: P(TV >= t) <= 2^K exp(-2 n t^2))."""
    n, K = samples.numel(), expected.numel()
    freq = torch.bincount(samples, minlength=K).float() / n
    return 0.5 * float((freq - expected).abs().sum()), math.sqrt((K * math.log(2) + math.log(1e6)) / (2 * n))


N_TRIALS = 2000
KINDS = ["iid", "without-replacement", "point-mass", "point-mass-rows"]


def _check(kind: str) -> list[tuple[float, float]]:
    """[(tv, bound)] of the first token against P1 and of the first two against P1 x p2."""
    p2, _ = _tables()
    s = _first_two_tokens(kind, N_TRIALS)
    first = _tv_and_bound(s[:, 0], P1)
    pair = _tv_and_bound(s[:, 0] * V + s[:, 1], (P1.unsqueeze(1) * p2).flatten())
    return [first, pair]


@pytest.mark.parametrize("kind", KINDS)
def test_the_output_of_a_tree_step_is_distributed_as_the_target(kind):
    for tv, bound in _check(kind):
        assert tv < bound, (kind, tv, bound)


@pytest.mark.parametrize("kind", ["iid", "without-replacement", "point-mass-rows"])
def test_a_rule_without_the_residual_update_between_children_fails_the_same_test(kind, monkeypatch):
    """The test has the power to see a plausible bug: trying every child against the unchanged p
    (and sampling the recovered token from p) over-emits the drafted tokens."""
    monkeypatch.setattr(tree_mod, "_residual", lambda p, q: p)
    assert any(tv > bound for tv, bound in _check(kind))
