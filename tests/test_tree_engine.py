"""Token-tree steps in the engine: greedy output identical to plain decoding, the cache compacted
after a tree step (a following chain step continues as plain decoding does), EOS and max_new_tokens
inside a tree step, the drafter's :class:`~specdraft.drafters.base.Verified` and per-token sources."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters.base import DraftState, Proposal
from specdraft.drafters.lookup_tree import LookupTreeDrafter
from specdraft.engine import Engine, Request, generate
from specdraft.errors import SpecdraftError
from specdraft.models.hf import HFRuntime
from specdraft.policy import CostAwareK, FixedK
from specdraft.tree import TokenTree
from specdraft.verify import SamplingParams
from tests.helpers import assert_target_logprobs, decode, decode_logprobs, plain_greedy, random_prompts

K = 6


class OracleTrees:
    """Proposes per row a tree of a wrong branch, the plain continuation cut (and, on some steps,
    corrupted) at a random depth and another wrong branch, at most k nodes. Every ``chain_every``-th
    step it proposes a chain instead, so chain steps follow tree steps."""

    name, vocab_size = "oracle", None

    def __init__(self, references: list[list[int]], seed: int = 0, chain_every: int = 0, vocab: int = 254):
        self.references = references  # prompt + plain output of each prompt
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(seed)
        self.chain_every = chain_every
        self.steps = 0
        self.verified = []

    def new_state(self, batch_size, capacity):
        return DraftState(batch_size)

    def _rand(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.g).tolist()

    def _chains(self, seq: list[int], k: int) -> list[list[int]]:
        ref = next(r for r in self.references if r[: len(seq)] == seq)
        nxt = ref[len(seq) :]
        depth = int(torch.randint(0, k, (1,), generator=self.g))
        good = nxt[:depth]
        if good and int(torch.randint(0, 3, (1,), generator=self.g)) == 0:
            good[-1] = (good[-1] + 1) % self.vocab  # rejected at its last node
        chains = [self._rand(1), good, self._rand(k - 1 - len(good))]
        return [c for c in chains if c]

    def propose(self, state, ctx, k) -> Proposal:
        self.steps += 1
        B = ctx.lengths.shape[0]
        seqs = [ctx.tokens[b, : int(ctx.lengths[b])].tolist() for b in range(B)]
        if self.chain_every and self.steps % self.chain_every == 0:
            tokens = torch.zeros(B, k, dtype=torch.int64)
            for b, seq in enumerate(seqs):
                good = next(r for r in self.references if r[: len(seq)] == seq)[len(seq) : len(seq) + k]
                tokens[b, : len(good)] = torch.tensor(good, dtype=torch.int64)
            return Proposal(tokens)
        trees = []
        for b, seq in enumerate(seqs):
            if b == 1 and self.steps % 2:  # a row with nothing to propose
                trees.append(None)
                continue
            chains = self._chains(seq, k)
            sources = ["noise", "good", "noise"][: len(chains)]
            trees.append(TokenTree.from_chains(chains, sources=sources))
        return Proposal(torch.zeros(B, 0, dtype=torch.int64), trees=trees)

    def observe(self, state, num_accepted, verified=None):
        self.verified.append(verified)


def _references(tiny, prompts, n):
    return [p + plain_greedy(tiny.target, p, n + K + 2) for p in prompts]


def test_tree_steps_give_plain_greedy_output_batch_1_and_3(tiny):
    prompts = random_prompts([5, 9, 3], seed=11)
    refs = _references(tiny, prompts, 24)
    for batch in ([prompts[0]], prompts):
        drafter = OracleTrees(refs, seed=1)
        engine = Engine(tiny.target, drafter, FixedK(K))
        out = decode(engine, batch, 24)
        assert out == [plain_greedy(tiny.target, p, 24) for p in batch]
        assert engine.stats.accepted > 5  # the trees were really accepted from (not only bonus tokens)
        assert engine.stats.mean_accepted_length > 1.2


def test_tree_steps_report_the_targets_logprobs_along_the_accepted_path(tiny):
    prompts = random_prompts([5, 9, 3], seed=11)
    refs = _references(tiny, prompts, 24)
    engine = Engine(tiny.target, OracleTrees(refs, seed=1), FixedK(K))
    got = decode_logprobs(engine, prompts, 24, [SamplingParams(logprobs=2)] * 3)
    assert engine.stats.accepted > 5
    for prompt, row in zip(prompts, got):
        assert [g.token for g in row] == plain_greedy(tiny.target, prompt, 24)
        assert_target_logprobs(tiny.model, prompt, row, 2)


@pytest.fixture(scope="module")
def quant_rt(tmp_path_factory):
    """The quantized runtime over a tiny Q4_1 GGUF (vocabulary 96), as tests/models/test_quant_tree.py."""
    from specdraft import kernels
    from specdraft.models import quant
    from tests.models.test_quant import TYPES, write_tiny_gguf

    if not kernels.available() or "avx2" not in quant.variants():
        pytest.skip(f"native kernels unavailable ({kernels.status()})")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, TYPES["Q4_1"])
    yield quant.QuantRuntime(path)
    mp.undo()


def test_tree_steps_on_the_quantized_runtime(quant_rt):
    prompts = random_prompts([5, 9, 3], vocab=94, seed=16)
    refs = [p + plain_greedy(quant_rt, p, 20 + K + 2) for p in prompts]
    for batch in ([prompts[0]], prompts):
        engine = Engine(quant_rt, OracleTrees(refs, seed=6, chain_every=3, vocab=94), FixedK(K))
        assert decode(engine, batch, 20) == [plain_greedy(quant_rt, p, 20) for p in batch]
        assert engine.stats.accepted > 5


def test_chain_steps_after_tree_steps_continue_as_plain(tiny):
    """The accepted path's cache entries are moved to their chain slots: a chain step that follows
    (every third step here) reads them and still reproduces plain decoding."""
    prompts = random_prompts([4, 7, 6], seed=12)
    refs = _references(tiny, prompts, 30)
    engine = Engine(tiny.target, OracleTrees(refs, seed=2, chain_every=3), FixedK(K))
    assert decode(engine, prompts, 30) == [plain_greedy(tiny.target, p, 30) for p in prompts]


def test_eos_and_max_new_tokens_inside_a_tree_step(tiny):
    prompts = random_prompts([6, 8, 5], seed=13)
    refs = _references(tiny, prompts, 20)
    eos = (refs[0][len(prompts[0]) + 7],)  # plain output token 7 of the first prompt
    for n in (1, 3, 11):
        engine = Engine(tiny.target, OracleTrees(refs, seed=n), FixedK(K))
        out = decode(engine, prompts, n, eos_ids=eos)
        assert out == [plain_greedy(tiny.target, p, n, eos_ids=eos) for p in prompts]
    engine = Engine(tiny.target, OracleTrees(refs, seed=3), FixedK(K))
    assert decode(engine, prompts, 20, eos_ids=eos)[0][-1] == eos[0]


def test_verified_and_sources(tiny):
    prompt = random_prompts([7], seed=14)[0]
    refs = _references(tiny, [prompt], 16)
    drafter = OracleTrees(refs, seed=4)
    engine = Engine(tiny.target, drafter, FixedK(K))
    events = list(generate(engine, [Request(prompt, 16)]))
    for ev, ver in zip(events, drafter.verified):
        assert ver.committed[0] == ev.tokens
        assert ev.source[-1] == "target" or len(ev.tokens) < len(ver.committed[0]) + 1
        assert all(s == "good" for s in ev.source[:-1])  # only the plain continuation is accepted
        fed, parents, nxt = ver.inputs[0], ver.parents[0], ver.target_next[0]
        assert len(fed) == len(parents) == len(nxt) and parents[0] == -1
        # the target's argmax after the root is what plain decoding emits next
        assert nxt[0] == ev.tokens[0]
    assert any(len(ev.tokens) > 1 for ev in events)


def test_a_tree_larger_than_k_is_refused(tiny):
    class Big(OracleTrees):
        def propose(self, state, ctx, k):
            tree = TokenTree.from_chains([list(range(1, k + 2))])
            return Proposal(torch.zeros(1, 0, dtype=torch.int64), trees=[tree])

    engine = Engine(tiny.target, Big([]), FixedK(3))
    with pytest.raises(SpecdraftError):
        decode(engine, [[1, 2, 3]], 4)


def test_a_runtime_without_tree_masks_is_refused_when_the_engine_is_built(tiny):
    with pytest.raises(SpecdraftError, match="token trees"):
        Engine(HFRuntime(tiny.model), LookupTreeDrafter(), FixedK(4))
    Engine(tiny.target, LookupTreeDrafter(), FixedK(4))  # the compact runtime takes them


class Trees:
    """Per row, the plain continuation (``good``) or random tokens as a k-node tree: a chain of
    k - 1 tokens and one sibling at the root."""

    name, vocab_size = "trees", None

    def __init__(self, references: list[list[int]], good: bool):
        self.references, self.good = references, good
        self.g = torch.Generator().manual_seed(5)

    def new_state(self, batch_size, capacity):
        return DraftState(batch_size)

    def propose(self, state, ctx, k):
        trees = []
        for b in range(ctx.lengths.shape[0]):
            seq = ctx.tokens[b, : int(ctx.lengths[b])].tolist()
            ref = next(r for r in self.references if r[: len(seq)] == seq)
            chain = ref[len(seq) : len(seq) + k - 1] if self.good else []
            chain += torch.randint(0, 254, (k - 1 - len(chain),), generator=self.g).tolist()
            trees.append(TokenTree.from_chains([c for c in (chain, [254]) if c]))
        return Proposal(torch.zeros(len(trees), 0, dtype=torch.int64), trees=trees)

    def observe(self, state, num_accepted, verified=None):
        pass


class SteadyCostAware(CostAwareK):
    """The cost-aware policy fed fixed latencies (a node 0.01, a forward over n tokens
    1 + 0.1 (n - 1)) instead of this loaded machine's, so that its choices depend on acceptance."""

    def update(
        self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None, width=None
    ):
        n = width if width is not None else int(num_drafted.max()) + 1
        super().update(k, num_drafted, num_accepted, 0.01 * k, 1.0 + 0.1 * (n - 1), bucket, rows, width)


def test_the_cost_aware_policy_chooses_the_node_budget(tiny):
    """T(n) is measured per tree size n + 1 and acceptance per budget (the accepted length): trees
    that are never accepted go to budget 0 (plain steps, probing now and then), trees that hold the
    target's continuation keep a large budget; the output stays plain greedy."""
    prompts = random_prompts([5, 8], seed=15)
    refs = _references(tiny, prompts, 60)
    late, stats = {}, {}
    for good in (False, True):
        engine = Engine(tiny.target, Trees(refs, good), SteadyCostAware(k_max=6, k_start=4))
        assert decode(engine, prompts, 60) == [plain_greedy(tiny.target, p, 60) for p in prompts]
        # k_history holds each step's deepest tree (0: a plain step)
        late[good] = engine.stats.k_history[len(engine.stats.k_history) // 2 :]
        stats[good] = engine.stats
    assert sum(k == 0 for k in late[False]) > 0.6 * len(late[False]), late[False]
    assert sum(k >= 4 for k in late[True]) > 0.7 * len(late[True]), late[True]  # budget >= 5
    assert stats[True].mean_accepted_length > 2.5
    assert stats[False].mean_accepted_length < 1.2
