"""A ragged step on the quantized runtime (``forward(..., lengths=)``): row b feeds only its own
n_b tokens, and each row's logits are bit for bit those of its own one-token steps; the padding is
neither computed nor written to the cache."""

import pytest
import torch

from specdraft import kernels
from specdraft.bench.harness import decode_counted
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine, Request
from specdraft.errors import SpecdraftError
from specdraft.models import quant
from specdraft.models.quant import QuantRuntime
from specdraft.policy import CostAwareK, FixedK
from tests.helpers import decode, plain_greedy, random_prompts
from tests.models.test_quant import CFG, TYPES, write_tiny_gguf

pytestmark = pytest.mark.skipif(
    not kernels.available() or "avx2" not in quant.variants(),
    reason=f"native kernels unavailable ({kernels.status()})",
)

CONTEXTS = random_prompts([6] * 4, vocab=96, seed=5)  # 4 rows, 6 tokens each
NEW = random_prompts([4] * 4, vocab=96, seed=6)  # each row's next tokens: [last, d_1 .. d_3]
MORE = random_prompts([3] * 4, vocab=96, seed=7)  # a second step's


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0"])
def gguf_path(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))  # the GGUF index cache
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, TYPES[request.param])
    yield path
    mp.undo()


class RaggedSpy(QuantRuntime):
    """The quantized runtime, keeping the ``lengths`` of each ragged step it ran (rows that differ)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.ragged_steps: list[list[int]] = []

    def forward(self, *args, lengths=None, **kw):
        if lengths is not None and len(set(lengths.tolist())) > 1:
            self.ragged_steps.append(lengths.tolist())
        return super().forward(*args, lengths=lengths, **kw)


def _prefilled(rt, contexts: list[list[int]], capacity: int = 24):
    state = rt.new_state(len(contexts), capacity)
    n = len(contexts[0])
    rt.forward(state, torch.tensor(contexts), torch.arange(n).expand(len(contexts), n))
    return state


def _one_token_steps(rt, context: list[int], steps: list[list[int]]) -> list[torch.Tensor]:
    """Each step's tokens fed one at a time to a one-row cache; ``(n, V)`` logits per step."""
    state, p, out = _prefilled(rt, [context]), len(context), []
    for chain in steps:
        rows = []
        for t in chain:
            rows.append(rt.forward(state, torch.tensor([[t]]), torch.tensor([[p]])).logits[0, 0])
            p += 1
        out.append(torch.stack(rows))
    return out


def _ragged_step(rt, state, new: list[list[int]], lengths: list[int], starts: list[int]) -> torch.Tensor:
    T = len(new[0])
    positions = torch.tensor(starts).unsqueeze(1) + torch.arange(T)  # (B, T)
    return rt.forward(state, torch.tensor(new), positions, lengths=torch.tensor(lengths)).logits


@pytest.mark.parametrize(
    "first, second", [([1, 4, 2, 3], [3, 1, 2, 1]), ([4, 1, 1, 1], [1, 1, 3, 2]), ([2, 1, 4], [1, 3, 1])]
)
@pytest.mark.parametrize("variant", quant.variants())
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_ragged_rows_equal_their_own_one_token_steps(gguf_path, variant, kv_dtype, first, second):
    """Two ragged steps (the second from each row's own length): every row's logits equal its own
    one-token steps bit for bit, so the first step wrote exactly the row's cache entries. Four rows
    on two threads attend a row per thread, three rows one after another (quant.c attend_step);
    each row's cache is found by its offset in bytes, for fp16 and fp32 caches alike."""
    B = len(first)
    rt = QuantRuntime(gguf_path, variant, kv_dtype=kv_dtype)
    state = _prefilled(rt, CONTEXTS[:B])
    P = len(CONTEXTS[0])
    a = _ragged_step(rt, state, NEW[:B], first, [P] * B)
    b = _ragged_step(rt, state, MORE[:B], second, [P + n for n in first])
    for row, (n1, n2) in enumerate(zip(first, second)):
        ref = _one_token_steps(rt, CONTEXTS[row], [NEW[row][:n1], MORE[row][:n2]])
        assert torch.equal(a[row, :n1], ref[0]), (row, n1)
        assert torch.equal(b[row, :n2], ref[1]), (row, n2)
        assert not a[row, n1:].any() and not b[row, n2:].any()  # padding: not computed


def test_padding_costs_nothing_and_is_not_written(gguf_path):
    """The padded tokens' cache slots keep what was there: row 0 (n = 1) leaves slots 7.. as a
    chain step of 1 token would; an all-full step is the plain chain step."""
    rt = QuantRuntime(gguf_path)
    state = _prefilled(rt, CONTEXTS)
    before = [k.clone() for k in state.k]
    _ragged_step(rt, state, NEW, [1, 4, 4, 4], [6] * 4)
    assert all(torch.equal(k[0, :, 7:], k0[0, :, 7:]) for k, k0 in zip(state.k, before))
    assert not all(torch.equal(k[1, :, 7:10], k0[1, :, 7:10]) for k, k0 in zip(state.k, before))
    full = _ragged_step(rt, _prefilled(rt, CONTEXTS), NEW, [4] * 4, [6] * 4)
    chain = rt.forward(_prefilled(rt, CONTEXTS), torch.tensor(NEW), torch.arange(6, 10).expand(4, 4)).logits
    assert torch.equal(full, chain)


def test_ragged_hidden_states_and_refusals(gguf_path):
    rt = QuantRuntime(gguf_path)
    state = _prefilled(rt, CONTEXTS)
    tokens, positions = torch.tensor(NEW), torch.arange(6, 10).expand(4, 4)
    out = rt.forward(state, tokens, positions, hidden_layers=(0, -1), lengths=torch.tensor([2, 1, 4, 3]))
    assert out.hidden[0].shape == (4, 4, CFG["hidden_size"]) and not out.hidden[-1][1, 1:].any()
    assert out.hidden[-1][2].abs().sum(-1).gt(0).all()
    for bad in ([0, 1, 1, 1], [5, 1, 1, 1], [1, 2]):
        with pytest.raises(SpecdraftError, match="ragged lengths"):
            rt.forward(state, tokens, positions, lengths=torch.tensor(bad))
    with pytest.raises(SpecdraftError, match="logits_index"):
        rt.forward(
            state,
            tokens,
            positions,
            lengths=torch.tensor([1, 2, 3, 4]),
            logits_index=torch.zeros(4, 1).long(),
        )


def test_the_engine_verifies_ragged_and_keeps_greedy_output(gguf_path):
    """Prompt lookup proposes different lengths per row: the engine's chain steps feed each row its
    own 1 + k_b tokens (the runtime's ``lengths``), and the output is plain greedy decoding's; a
    cost-aware policy is told that steps are ragged."""
    rt = RaggedSpy(gguf_path)
    prompts = random_prompts([5, 9], vocab=96, seed=8) + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 4] * 6]
    reference = [plain_greedy(rt, p, 12) for p in prompts]
    rt.ragged_steps.clear()
    assert decode(Engine(rt, PromptLookupDrafter(), FixedK(4)), prompts, 12) == reference
    assert rt.ragged_steps and all(min(n) >= 1 and max(n) <= 5 for n in rt.ragged_steps)
    policy = CostAwareK()
    assert Engine(rt, PromptLookupDrafter(), policy).ragged and policy.ragged
    run = decode_counted(Engine(rt, PromptLookupDrafter(), FixedK(4)), [Request(p, 12) for p in prompts])
    assert run.outputs == reference and run.tokens_fed == sum(run.steps) + run.stats.drafted  # no padding
