"""A token-tree step on the quantized runtime: every node's logits are bit for bit those of a chain
step over the same prefix (so tree verification keeps the runtime's greedy output), and moving the
accepted nodes' cache entries leaves exactly the cache a chain step leaves."""

import pytest
import torch

from specdraft import kernels
from specdraft.errors import SpecdraftError
from specdraft.models import quant
from specdraft.models.quant import QuantRuntime
from specdraft.tree import TokenTree
from tests.helpers import random_prompts
from tests.models.test_quant import TYPES, write_tiny_gguf

pytestmark = pytest.mark.skipif(
    not kernels.available() or "avx2" not in quant.variants(),
    reason=f"native kernels unavailable ({kernels.status()})",
)

CHAINS = [[11, 12, 13], [11, 14], [15, 16, 17, 18], [15, 19], [20]]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))  # the GGUF index cache
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, TYPES["Q4_1"])
    yield QuantRuntime(path)
    mp.undo()


def _prefilled(rt, contexts: list[list[int]], capacity: int = 40):
    state = rt.new_state(len(contexts), capacity)
    n = len(contexts[0])
    rt.forward(state, torch.tensor(contexts), torch.arange(n).expand(len(contexts), n))
    return state


def _chain_logits(rt, context: list[int], chain: list[int]) -> torch.Tensor:
    state = _prefilled(rt, [context])
    P = len(context)
    return rt.forward(state, torch.tensor([chain]), torch.arange(P, P + len(chain)).unsqueeze(0)).logits[0]


def _tree_step(rt, state, tree: TokenTree, roots: list[int], root_pos: int) -> torch.Tensor:
    B = len(roots)
    tokens = torch.cat([torch.tensor(roots).unsqueeze(1), tree.tokens.expand(B, -1)], dim=1)  # (B, N + 1)
    out = rt.forward(
        state,
        tokens,
        tree.positions(root_pos).expand(B, -1),
        attn_mask=tree.step_mask(root_pos, state.capacity).expand(B, -1, -1),
        slots=tree.slots(root_pos).expand(B, -1),
    )
    return out.logits  # (B, N + 1, V)


def test_each_nodes_logits_equal_a_chain_steps_bit_for_bit(rt):
    contexts, roots = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]], [7, 3]
    tree = TokenTree.from_chains(CHAINS)
    logits = _tree_step(rt, _prefilled(rt, contexts), tree, roots, 6)
    for b, (context, root) in enumerate(zip(contexts, roots)):
        assert torch.equal(logits[b, 0], _chain_logits(rt, context, [root])[0])
        for i in range(tree.num_nodes):
            path = tree.tokens[tree.ancestors[i]].tolist()  # root-to-node tokens
            chain = _chain_logits(rt, context, [root, *path])[-1]
            assert torch.equal(logits[b, 1 + i], chain), (b, i)
    # node 3 (11 -> 14) hung below 13 instead (so that it sees 12 and 13) gets another row
    leaky = TokenTree(tree.tokens, torch.tensor([-1, 0, 1, 2, -1, 4, 5, 6, 4, -1]))
    wrong = _tree_step(rt, _prefilled(rt, contexts[:1]), leaky, roots[:1], 6)
    assert not torch.equal(wrong[0, 1 + 3], logits[0, 1 + 3])


def test_moving_the_accepted_path_leaves_the_cache_of_a_chain(rt):
    context, root = [9, 8, 7, 6, 5], 4
    tree = TokenTree.from_chains(CHAINS)
    P = len(context)
    state = _prefilled(rt, [context])
    _tree_step(rt, state, tree, [root], P)
    path = tree.ancestors[7].nonzero().squeeze(1)  # nodes 4, 5, 6, 7: tokens 15, 16, 17, 18
    state.move_slots(0, tree.slots(P)[1 + path], P + 1)
    chain_state = _prefilled(rt, [context])
    chain = [root, *tree.tokens[path].tolist()]
    rt.forward(chain_state, torch.tensor([chain]), torch.arange(P, P + len(chain)).unsqueeze(0))
    n = P + len(chain)
    for k, k_chain in zip(state.k + state.v, chain_state.k + chain_state.v):
        assert torch.equal(k[:, :, :n], k_chain[:, :, :n])
    nxt = torch.tensor([[21, 22]])
    got = rt.forward(state, nxt, torch.arange(n, n + 2).unsqueeze(0)).logits
    ref = rt.forward(chain_state, nxt, torch.arange(n, n + 2).unsqueeze(0)).logits
    assert torch.equal(got, ref)


def test_masks_other_than_trees_are_refused(rt):
    state = rt.new_state(1, 8)
    tokens, pos = torch.tensor([[1, 2]]), torch.tensor([[0, 1]])
    with pytest.raises(SpecdraftError, match="attention mask"):
        rt.forward(state, tokens, pos, slots=pos)
    with pytest.raises(SpecdraftError, match="capacity"):
        rt.forward(
            state, tokens, pos, attn_mask=torch.ones(1, 2, 8, dtype=torch.bool), slots=torch.tensor([[0, 8]])
        )
    causal = torch.arange(8) <= pos.unsqueeze(-1)  # (1, 2, 8)
    hole = causal.clone()
    hole[0, 1, 0] = False  # token 1 does not see slot 0
    with pytest.raises(SpecdraftError, match="tree masks"):
        rt.forward(state, tokens, pos, attn_mask=hole)
    past = torch.arange(8) < 7  # a token at position 2, slot 6, that sees slots 0..5 too
    with pytest.raises(SpecdraftError, match="tree masks"):
        rt.forward(
            state, tokens[:, :1], torch.tensor([[2]]), attn_mask=past.view(1, 1, 8), slots=torch.tensor([[6]])
        )
    # a causal mask is a tree (a chain): the same logits as the causal step
    masked = rt.forward(rt.new_state(1, 8), tokens, pos, attn_mask=causal).logits
    assert torch.equal(masked, rt.forward(rt.new_state(1, 8), tokens, pos).logits)


def test_queries_of_one_step_with_different_contexts_and_cached_ancestors(rt):
    """One step whose queries read different things past the shortest context (slot map rows of
    different widths: a query whose context runs on in place, another through a cached ancestor at
    a slot beyond the context), each bit for bit its own chain step."""
    x = torch.tensor([random_prompts([13], vocab=90, seed=5)[0]])
    z, w = 41, 42
    state = rt.new_state(1, 16)
    rt.forward(state, x[:, :12], torch.arange(12)[None])  # slots 0..11
    branch = torch.zeros(1, 1, 16, dtype=torch.bool)
    branch[..., list(range(10)) + [13]] = True  # z at position 10, slot 13, after x[:10]
    rt.forward(state, torch.tensor([[z]]), torch.tensor([[10]]), attn_mask=branch, slots=torch.tensor([[13]]))
    mask = torch.zeros(1, 2, 16, dtype=torch.bool)
    mask[0, 0, list(range(12)) + [14]] = True  # x[12] at position 12, slot 14: context 0..11
    mask[0, 1, list(range(10)) + [13, 15]] = True  # w at position 11, slot 15: context 0..9, then z
    got = rt.forward(
        state,
        torch.tensor([[int(x[0, 12]), w]]),
        torch.tensor([[12, 11]]),
        attn_mask=mask,
        slots=torch.tensor([[14, 15]]),
    ).logits[0]
    assert torch.equal(got[0], _chain_logits(rt, x[0, :12].tolist(), [int(x[0, 12])])[-1])
    assert torch.equal(got[1], _chain_logits(rt, x[0, :10].tolist(), [z, w])[-1])
    assert not torch.equal(got[1], _chain_logits(rt, x[0, :10].tolist(), [int(x[0, 10]), w])[-1])
