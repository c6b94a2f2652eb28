"""The CTC drafter: collapse, beam search and candidate trees; the engine-side slots compute what the
training model computes; decoding stays lossless, and after a tree step the next real pairs read
the target's features along the accepted path."""

import itertools

import pytest
import torch

from specdraft import api
from specdraft.design.artifact import DraftMeta, save_draft
from specdraft.design.ctc import CTCDraftLM, block_mask
from specdraft.design.prune import depth_prune
from specdraft.design.vocab import VocabSubset
from specdraft.drafters.ctc import CTCDrafter, alignment_beams, candidate_tree, ctc_collapse
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime
from specdraft.models.subset_head import SubsetHeadRuntime, draft_weights
from specdraft.policy import FixedK
from tests.helpers import accepted_columns, decode, head_subset, random_prompts, target_answers

BLANK = 9


def _collapsed(seq):
    a = torch.tensor([seq])
    return a[ctc_collapse(a, BLANK)].tolist()


def test_collapse_merges_repeats_then_drops_blanks():
    assert _collapsed([3, 3, BLANK, 3, 4, 4]) == [3, 3, 4]  # a blank separates a real repeat
    assert _collapsed([3, 3, 3, 4]) == [3, 4]
    assert _collapsed([BLANK, 5, BLANK, BLANK, 6]) == [5, 6]
    assert _collapsed([BLANK, BLANK]) == []
    assert _collapsed([7]) == [7]


def test_beam_search_keeps_the_likeliest_alignments():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(2, 3, 5, generator=g), -1)  # (B, S, V + 1)
    seqs, scores = alignment_beams(logp, width=2, beams=8)  # 2 ** 3 = 8: every alignment of the top-2s
    for b in range(2):
        top = logp[b].topk(2, -1).indices.tolist()
        brute = sorted(
            ((sum(float(logp[b, j, s]) for j, s in enumerate(a)), list(a)) for a in itertools.product(*top)),
            reverse=True,
        )
        assert [a for _, a in brute] == seqs[b].tolist()
        assert torch.allclose(scores[b], torch.tensor([s for s, _ in brute]))
    few, _ = alignment_beams(logp, width=2, beams=3)
    assert torch.equal(few, seqs[:, :3])  # a narrower beam keeps the best ones


def test_candidate_tree_is_the_trie_of_distinct_collapses_cut_to_the_budget():
    aligns = torch.tensor(
        [[1, 1, 2], [1, BLANK, 2], [BLANK, BLANK, BLANK], [1, 2, 2], [3, BLANK, 3], [1, 2, 4]]
    )
    tree = candidate_tree(aligns, BLANK, budget=10)
    # [1, 2] twice (once merged, once through a blank), nothing, [1, 2] again, [3, 3], [1, 2, 4]
    assert tree.tokens.tolist() == [1, 2, 3, 3, 4] and tree.parents.tolist() == [-1, 0, -1, 2, 1]
    assert tree.sources == ("ctc",) * 5
    cut = candidate_tree(aligns, BLANK, budget=3)
    assert cut.tokens.tolist() == [1, 2, 3] and cut.parents.tolist() == [-1, 0, -1]
    assert candidate_tree(torch.full((2, 3), BLANK), BLANK, budget=4) is None


def test_block_mask():
    m = block_mask(3, 2, torch.tensor([[1, -1]]))[0].int()
    assert m.tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],  # block 0 (anchor pair 1): pairs 0..1 and its own slots
        [1, 1, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],  # block 1: padding, its own slots only
        [0, 0, 0, 0, 0, 1, 1],
    ]


@pytest.fixture(scope="module")
def data(tiny_pipe):
    return target_answers(tiny_pipe, random_prompts([4, 9, 6, 12], seed=21), max_new_tokens=16, batch_size=2)


def _model(tiny_pipe, head, slots=4):
    torch.manual_seed(0)
    model = CTCDraftLM(
        depth_prune(tiny_pipe.target.model, [1]), head, slots=slots, labels=2, fc=torch.randn(64, 128) * 0.1
    )
    with torch.no_grad():  # a live blank
        model.ctc["blank_w"].normal_(0, 0.3)
        model.ctc["blank_b"].fill_(0.5)
    return model.eval()


def _drafter(tiny_pipe, model, head, **kw):
    w = draft_weights(model.draft, tiny_pipe.runtime.w, head, torch.float32)
    rt = SubsetHeadRuntime(LlamaRuntime(w), head, 256) if head is not None else LlamaRuntime(w)
    ctc = {k: v.detach() for k, v in model.ctc.items()}
    return CTCDrafter(rt, model.fc.weight.detach(), ctc, tiny_pipe.runtime.w.embed, "ctc", **kw)


@pytest.mark.parametrize("subset", [False, True])
def test_slots_match_the_training_model(tiny_pipe, data, subset):
    head = head_subset(96) if subset else None
    model = _model(tiny_pipe, head)
    drafter = _drafter(tiny_pipe, model, head)
    i, c = 1, 5  # sequence 1; the target verified c positions (P-1 .. P+c-2)
    P, hid, tokens = data.prompt_lens[i], data.hidden[i].float(), data.tokens[i]
    state = drafter.new_state(1, 64)
    state.start = [P - 1]
    pos = torch.arange(P - 1, P - 1 + c).unsqueeze(0)
    drafter._forward(state, drafter.inputs(hid[:c].unsqueeze(0), tokens[P : P + c].unsqueeze(0)), pos)
    got = drafter.slot_logprobs(state, hid[c].unsqueeze(0), torch.tensor([P + c]))[0]  # (S, V + 1)

    T = c + 3  # three pairs past the anchor, which its slots must not see
    batch = model.make_batch(data, [i], 64)
    batch.anchor_rows, batch.anchor_block = torch.tensor([0]), torch.tensor([0])
    batch.anchor_cols, batch.anchor_feat = torch.tensor([c - 1]), hid[c].unsqueeze(0)
    with torch.no_grad():
        _, hs = model.features(batch.feats[:, :T], batch.ids[:, :T], batch.positions[:, :T], batch)
        want = model.slot_logprobs(hs)[0]  # (S, N + 1) over the head, blank last
    ids = model.head_tokens
    assert torch.allclose(got[:, ids], want[:, :-1], atol=1e-4)
    assert torch.allclose(got[:, -1], want[:, -1], atol=1e-4)
    if subset:
        outside = torch.ones(256, dtype=torch.bool)
        outside[ids] = False
        assert bool(torch.isinf(got[:, :256][:, outside]).all())


def test_bad_ctc_tensors_are_refused(tiny_pipe):
    model = _model(tiny_pipe, None)
    ctc = {k: v.detach() for k, v in model.ctc.items()}
    rt = LlamaRuntime(draft_weights(model.draft, tiny_pipe.runtime.w, None, torch.float32))
    with pytest.raises(SpecdraftError, match="ctc.blank_b"):
        CTCDrafter(
            rt, model.fc.weight.detach(), {"slots": ctc["slots"], "blank_w": ctc["blank_w"]}, None, "x"
        )
    with pytest.raises(SpecdraftError, match="invalid"):
        CTCDrafter(rt, model.fc.weight.detach(), {**ctc, "slots": ctc["slots"][:, :8]}, None, "x")


class OracleSlots(CTCDrafter):
    """Slots whose best symbol is junk and whose second best is the target's own next token (read
    from a plain decode), so that accepted paths leave the tree's first branch; records the real
    pairs' features and positions."""

    def __init__(self, *a, reference=None, **kw):
        super().__init__(*a, **kw)
        self.reference, self.seen, self.paths = reference, [], []

    def propose(self, state, ctx, k):
        self.ctx = ctx
        return super().propose(state, ctx, k)

    def observe(self, state, num_accepted, verified=None):
        super().observe(state, num_accepted, verified)
        if verified is not None:
            self.paths += accepted_columns(verified, num_accepted)

    def _real_pairs(self, state, ctx):
        pairs = super()._real_pairs(state, ctx)
        if pairs is not None:
            self.seen.append((pairs.feats, pairs, ctx.tokens.clone(), ctx.lengths.clone()))
        return pairs

    def slot_logprobs(self, state, g, L):
        B, S, V = g.shape[0], self.slots.shape[0], self.vocab_size
        logp = torch.full((B, S, V + 1), -30.0)
        for b in range(B):
            true = self.reference[b][int(L[b]) : int(L[b]) + S]
            for j, t in enumerate(true):
                logp[b, j, (t + 1) % V] = -0.1
                logp[b, j, t] = -0.5
        return logp


def test_tree_decoding_is_lossless_and_the_next_pairs_follow_the_accepted_path(tiny_pipe):
    prompts = random_prompts([6, 9], seed=4)
    plain = decode(Engine(tiny_pipe.runtime), prompts, 24)
    reference = [p + o for p, o in zip(prompts, plain)]
    model = _model(tiny_pipe, None, slots=3)
    drafter = _drafter(tiny_pipe, model, None, width=2, beams=8)
    oracle = OracleSlots(
        drafter.runtime,
        drafter.fc,
        {k: v.detach() for k, v in model.ctc.items()},
        drafter.embed,
        "oracle",
        width=2,
        beams=8,
        reference=reference,
    )
    engine = Engine(tiny_pipe.runtime, oracle, FixedK(16), hidden_layers=oracle.hidden_layers)
    assert decode(engine, prompts, 24) == plain
    assert engine.stats.accepted > 0
    assert any(p != list(range(len(p))) for p in oracle.paths)  # accepted nodes off the first branch
    # every real pair read the target's feature at its position (a full forward over the context)
    checked = 0
    for feats, pairs, tokens, lengths in oracle.seen:
        for b in range(feats.shape[0]):
            if not bool(pairs.have[b]):
                continue
            L = int(lengths[b])
            st = tiny_pipe.runtime.new_state(1, 64)
            full = tiny_pipe.runtime.forward(
                st, tokens[b : b + 1, :L], torch.arange(L).unsqueeze(0), hidden_layers=(-1,)
            )
            n = int(pairs.last[b, 0]) + 1
            want = full.hidden[-1][0, pairs.positions[b, :n]]
            assert torch.allclose(feats[b, :n], want, atol=1e-4)
            checked += n
    assert checked > 10
    # and the random draft (no oracle) is lossless too
    engine = Engine(tiny_pipe.runtime, drafter, FixedK(6), hidden_layers=drafter.hidden_layers)
    assert decode(engine, prompts, 24) == plain and engine.stats.drafted > 0


def test_saved_draft_loads_by_kind_and_stays_lossless(tiny_pipe, tmp_path):
    head = head_subset(128)
    model = _model(tiny_pipe, head)
    meta = DraftMeta.for_target(
        tiny_pipe.target.model,
        "tiny",
        kind="ctc",
        head=VocabSubset(head, 0.0),
        init_layers=[1],
        arch={"slots": 4, "labels": 2},
    )
    extra = {k: v for k, v in model.own_state().items() if k == "fc.weight" or k.startswith("ctc.")}
    save_draft(tmp_path / "d", model.draft, meta, extra=extra)
    pipe = api.load("tiny", draft=f"designed:{tmp_path / 'd'}", dtype="fp32")
    assert isinstance(pipe.drafter, CTCDrafter) and pipe.drafter.slots.shape == (4, 64)
    prompts = random_prompts([5, 11, 8], seed=9)
    engine = pipe.engine(3)
    assert decode(engine, prompts, 20) == decode(Engine(pipe.runtime), prompts, 20)
    assert engine.stats.drafted > 0


def test_rows_that_leave_and_join_keep_their_paths(tiny_pipe):
    """Requests of different lengths leave the batch and a new one joins mid-way (the state's
    rows are selected and appended): every output is still plain decoding's."""
    from specdraft.engine import Request

    prompts = random_prompts([6, 9, 5], seed=8)
    lengths = [20, 7, 14]
    plain = [decode(Engine(tiny_pipe.runtime), [p], n)[0] for p, n in zip(prompts, lengths)]
    reference = [p + o for p, o in zip(prompts, plain)]
    model = _model(tiny_pipe, None, slots=3)
    oracle = OracleSlots(
        LlamaRuntime(draft_weights(model.draft, tiny_pipe.runtime.w, None, torch.float32)),
        model.fc.weight.detach(),
        {k: v.detach() for k, v in model.ctc.items()},
        tiny_pipe.runtime.w.embed,
        "oracle",
        beams=8,
        reference=[],
    )
    engine = Engine(tiny_pipe.runtime, oracle, FixedK(8), hidden_layers=oracle.hidden_layers)
    out: dict[int, list[int]] = {}
    ids = engine.add([Request(prompts[i], lengths[i]) for i in (0, 1)])
    rid = dict(zip(ids, (0, 1)))
    joined = False
    while engine.active:
        oracle.reference = [reference[rid[r.id]] for r in engine.requests]  # the rows' order now
        for ev in engine.step():
            out.setdefault(rid[ev.request_id], []).extend(ev.tokens)
        if not joined and 1 in out and len(out[1]) >= lengths[1]:
            (new,) = engine.add([Request(prompts[2], lengths[2])])
            rid[new], joined = 2, True
    assert joined and [out[i] for i in range(3)] == plain
    assert engine.stats.accepted > 0
