"""A token-tree step on the compact runtime: every node's logits are those of a chain step over the
same prefix (bit for bit on the native kernels, fp32 and bf16 weights; close on torch's attention),
and moving the accepted nodes' cache entries leaves the cache a chain step leaves."""

import pytest
import torch

from specdraft import kernels
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.tiny import tiny_llama
from specdraft.tree import TokenTree

ATOL = 2e-5
CHAINS = [[11, 12, 13], [11, 14], [15, 16, 17, 18], [15, 19], [20]]


@pytest.fixture(scope="module")
def rt():
    return LlamaRuntime(LlamaWeights.from_hf(tiny_llama(seed=3), torch.float32))


native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built here")


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_native_tree_rows_are_bit_identical_to_chain_steps(dtype, batch, monkeypatch):
    """fp32 weights take the fused attention path, bf16 weights the all-layers native call; either
    way the tree goes through the native attention (spied) and every row equals the chain's."""
    rt = LlamaRuntime(LlamaWeights.from_hf(tiny_llama(seed=4), dtype))
    if rt.dtype != torch.float32:
        pytest.skip("this CPU computes bf16 weights in bf16 through torch (native bf16), not the kernels")
    calls = []
    layout = kernels.tree_layout
    monkeypatch.setattr(kernels, "tree_layout", lambda *a: calls.append(layout(*a)) or calls[-1])
    contexts = [[1, 2, 3, 4, 5, 6], [9, 8, 7], [4, 4, 4, 4, 4, 4, 4, 4]][:batch]
    trees = [
        TokenTree.from_chains(CHAINS),
        TokenTree.from_chains([[30, 31], [32]]),
        TokenTree.from_chains([[5]]),
    ]
    N = max(t.num_nodes for t in trees[:batch])
    state = rt.new_state(batch, 40)
    P = max(len(c) for c in contexts)
    ctx = torch.tensor([c + [0] * (P - len(c)) for c in contexts])
    rt.forward(state, ctx, torch.arange(P).expand(batch, P))
    pads = [
        TokenTree(
            torch.cat([t.tokens, torch.zeros(N - t.num_nodes, dtype=torch.int64)]),
            torch.cat([t.parents, -torch.ones(N - t.num_nodes, dtype=torch.int64)]),
        )
        for t in trees[:batch]
    ]
    roots = [len(c) for c in contexts]  # the root sits at the context's length
    tokens = torch.stack([torch.cat([torch.tensor([7]), t.tokens]) for t in pads])
    out = rt.forward(
        state,
        tokens,
        torch.stack([t.positions(r) for t, r in zip(pads, roots)]),
        attn_mask=torch.stack([t.step_mask(r, 40) for t, r in zip(pads, roots)]),
        slots=torch.stack([t.slots(r) for t, r in zip(pads, roots)]),
    ).logits  # (B, N + 1, V)
    assert calls and all(c is not None for c in calls)  # the native path took the tree
    for b in range(batch):
        tree = trees[b]
        for i in range(-1, tree.num_nodes):
            path = [] if i < 0 else tree.tokens[tree.ancestors[i]].tolist()
            chain = _chain_logits(rt, contexts[b], [7, *path])[-1]
            assert torch.equal(out[b, 1 + i], chain), (b, i)


def _prefilled(rt, context: list[int], capacity: int = 40):
    state = rt.new_state(1, capacity)
    rt.forward(state, torch.tensor([context]), torch.arange(len(context)).unsqueeze(0))
    return state


def _chain_logits(rt, context: list[int], chain: list[int]) -> torch.Tensor:
    """``(len(chain), V)``: a causal step over ``chain`` after ``context`` (as the engine scores a chain)."""
    state = _prefilled(rt, context)
    P = len(context)
    return rt.forward(state, torch.tensor([chain]), torch.arange(P, P + len(chain)).unsqueeze(0)).logits[0]


def _tree_step(rt, state, tree: TokenTree, root: int, root_pos: int) -> torch.Tensor:
    tokens = torch.cat([torch.tensor([root]), tree.tokens]).unsqueeze(0)  # (1, N + 1)
    out = rt.forward(
        state,
        tokens,
        tree.positions(root_pos).unsqueeze(0),
        attn_mask=tree.step_mask(root_pos, state.capacity).unsqueeze(0),
        slots=tree.slots(root_pos).unsqueeze(0),
    )
    return out.logits[0]  # (N + 1, V)


def test_each_nodes_logits_equal_a_chain_steps_for_the_same_prefix(rt):
    context, root = [1, 2, 3, 4, 5, 6], 7
    tree = TokenTree.from_chains(CHAINS)
    logits = _tree_step(rt, _prefilled(rt, context), tree, root, len(context))
    root_row = _chain_logits(rt, context, [root])[0]
    torch.testing.assert_close(logits[0], root_row, atol=ATOL, rtol=0)
    for i in range(tree.num_nodes):
        path = tree.tokens[tree.ancestors[i]].tolist()  # root-to-node tokens
        chain = _chain_logits(rt, context, [root, *path])[-1]
        torch.testing.assert_close(logits[1 + i], chain, atol=ATOL, rtol=0, msg=f"node {i}")
        assert int(logits[1 + i].argmax()) == int(chain.argmax())
    # node 3 (11 -> 14) hung below 13 instead (so that it sees 12 and 13) gets another row
    leaky = TokenTree(tree.tokens, torch.tensor([-1, 0, 1, 2, -1, 4, 5, 6, 4, -1]))
    wrong = _tree_step(rt, _prefilled(rt, context), leaky, root, len(context))
    assert (wrong[1 + 3] - logits[1 + 3]).abs().max() > 1e-3


def test_moving_the_accepted_path_leaves_the_cache_of_a_chain(rt):
    context, root = [9, 8, 7, 6, 5], 4
    tree = TokenTree.from_chains(CHAINS)
    P = len(context)
    state = _prefilled(rt, context)
    _tree_step(rt, state, tree, root, P)
    path = tree.ancestors[7].nonzero().squeeze(1)  # nodes 4, 5, 6, 7: tokens 15, 16, 17, 18
    state.move_slots(0, tree.slots(P)[1 + path], P + 1)
    nxt = [21, 22]
    after = P + 1 + path.shape[0]
    got = rt.forward(state, torch.tensor([nxt]), torch.arange(after, after + 2).unsqueeze(0)).logits[0]
    ref = _chain_logits(rt, context, [root, *tree.tokens[path].tolist(), *nxt])[-2:]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_slots_need_a_mask(rt):
    state = rt.new_state(1, 8)
    with pytest.raises(SpecdraftError):
        rt.forward(state, torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), slots=torch.tensor([[0, 1]]))
    with pytest.raises(SpecdraftError):  # a slot beyond the cache
        mask = torch.ones(1, 2, 8, dtype=torch.bool)
        rt.forward(
            state,
            torch.tensor([[1, 2]]),
            torch.tensor([[0, 1]]),
            attn_mask=mask,
            slots=torch.tensor([[0, 8]]),
        )
