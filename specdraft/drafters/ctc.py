"""CTC drafting: one pass of the draft emits a blank-augmented token sequence; CTC collapse turns
its likeliest alignments into variable-length candidates, verified together as a token tree.

After Wen et al., "Speculative Decoding with CTC-based Draft Model for LLM Inference
Acceleration" (NeurIPS 2024, arXiv 2412.00061; code ZhuofanWen/CTC-drafter). The draft is the
EAGLE-style feature draft of :mod:`specdraft.drafters.feature` (pairs ``(f_p, token p + 1)``
through ``fc`` and its own decoder layer(s), with its own KV cache, on the shared base
:mod:`specdraft.drafters.feature_base`), plus what makes it a CTC drafter:

- **S slots in one pass.** After the step's real pairs (the last one at position ``L - 2``
  predicts the feature ``g`` at ``L - 1``), S slot inputs ``fc([g; s_j])`` (``s_j``: a learned
  slot embedding in place of a token's) go through the draft at positions ``L - 1 .. L - 2 + S``
  in one forward: they attend to the draft's cache over the real pairs and, causally, to each
  other. Slot j's output feature gives, through the target's frozen head plus a learned blank
  logit (``h . blank_w + blank_b``), a distribution over the vocabulary and a blank (index V).
- **CTC collapse.** An *alignment* is one symbol per slot; collapsing it (merge repeats, then
  drop blanks, :func:`ctc_collapse`) gives a candidate continuation of 0 .. S tokens, so one
  pass proposes continuations of several lengths.
- **Candidates as a tree.** A beam search over slots (:func:`alignment_beams`: the ``beams``
  likeliest alignments from each slot's top ``width`` symbols) gives alignments; their distinct
  non-empty collapses, likeliest first, are merged into a trie and cut to the step's k nodes in
  that order (:func:`candidate_tree`), which the engine verifies in one target forward
  (:mod:`specdraft.tree`).

Every node is a point mass (no q): the candidates are chosen deterministically from the draft's
distributions, and the tree rule for point masses (accept a child with probability p(x), remove
x from p) keeps sampling exactly the target's (:mod:`specdraft.tree`), as greedy verification
keeps greedy output identical. The engine keeps the target's features along the accepted path
(:class:`~specdraft.drafters.base.TargetFeatures`), which the next step's real pairs read.

Training (``specdraft design build --kind ctc``, :mod:`specdraft.design.ctc`): SmoothL1 on the
pairs' features + 0.1 soft cross-entropy + 0.01 CTC loss of the slots against the target's next
tokens (the paper's weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdraft.drafters.base import DraftContext, Proposal
from specdraft.drafters.feature import FeatureDrafter
from specdraft.drafters.feature_base import FeatureDraftState
from specdraft.errors import SpecdraftError
from specdraft.tree import TokenTree

CTC_KEYS = ("slots", "blank_w", "blank_b")  # stored as ``ctc.<key>``


def ctc_collapse(symbols: torch.Tensor, blank: int) -> torch.Tensor:
    """CTC's collapse of alignments: merge runs of a repeated symbol, then drop blanks.

    Args:
        symbols: ``(..., S)`` alignments.
        blank: the blank symbol.

    Returns:
        ``(..., S)`` bool: which symbols the collapsed sequence keeps (in order).
    """
    new = torch.ones_like(symbols, dtype=torch.bool)
    new[..., 1:] = symbols[..., 1:] != symbols[..., :-1]  # the first of each run
    return new & (symbols != blank)


def alignment_beams(logp: torch.Tensor, width: int, beams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam search over alignments: each slot extends the ``beams`` best prefixes with its ``width``
    likeliest symbols.

    Args:
        logp: ``(B, S, V + 1)`` per-slot log-probabilities (blank included).

    Returns:
        ``(B, beams', S)`` alignments and ``(B, beams')`` their log-probabilities, best first
        (``beams' = min(beams, width ** S)``).
    """
    top_v, top_i = logp.topk(width, dim=-1)  # (B, S, w)
    seqs, scores = top_i[:, 0].unsqueeze(-1), top_v[:, 0]  # (B, w, 1), (B, w)
    for j in range(1, logp.shape[1]):
        cand = (scores.unsqueeze(-1) + top_v[:, j].unsqueeze(1)).flatten(1)  # (B, b * w)
        scores, pick = cand.topk(min(beams, cand.shape[1]), dim=-1)  # (B, b')
        parent, choice = pick // width, pick % width
        seqs = torch.cat(
            [
                seqs.gather(1, parent.unsqueeze(-1).expand(-1, -1, j)),
                top_i[:, j].gather(1, choice).unsqueeze(-1),
            ],
            -1,
        )
    return seqs, scores


def candidate_tree(alignments: torch.Tensor, blank: int, budget: int) -> TokenTree | None:
    """The trie of the distinct non-empty collapses of ``alignments (beams, S)`` (best first), cut to
    its first ``budget`` nodes (None when nothing is left).

    Nodes are created in the candidates' order, so each node's first candidate is the best one
    through it and the first ``budget`` nodes hold every kept node's ancestors."""
    keep = ctc_collapse(alignments, blank)
    chains, seen = [], set()
    for a, k in zip(alignments.tolist(), keep.tolist()):
        chain = tuple(s for s, kept in zip(a, k) if kept)
        if chain and chain not in seen:
            seen.add(chain)
            chains.append(list(chain))
    if not chains or budget < 1:
        return None
    tree = TokenTree.from_chains(chains)
    first = torch.arange(tree.num_nodes) < budget
    return TokenTree.from_candidates(tree.tokens, tree.parents, first, source="ctc")


class CTCDrafter(FeatureDrafter):
    """CTC drafting (module docstring) in the engine.

    Args:
        runtime: the draft's runtime (see :class:`FeatureDrafterBase`).
        fc: ``(C, 2C)`` input projection over ``[feature, token embedding]``.
        ctc: :data:`CTC_KEYS` -> ``slots (S, C)``, ``blank_w (C,)``, ``blank_b (1,)``.
        embed: ``(V, C)`` the target's token embedding.
        name: shown in statistics.
        width: symbols tried per slot in the beam search.
        beams: alignments kept (candidates before collapse).
    """

    proposes_trees = True

    def __init__(self, runtime, fc, ctc: dict, embed, name: str, width: int = 2, beams: int = 16):
        super().__init__(runtime, fc, embed, name)
        missing = [k for k in CTC_KEYS if k not in ctc]
        if missing:
            raise SpecdraftError(f"a CTC draft needs ctc.{missing[0]}")
        self.slots, self.blank_w, self.blank_b = (ctc[k].to(fc.dtype) for k in CTC_KEYS)
        if self.slots.dim() != 2 or self.slots.shape[1] != fc.shape[0] or width < 1 or beams < 1:
            raise SpecdraftError(
                f"CTC slots {tuple(self.slots.shape)}, width {width}, beams {beams}: invalid"
            )
        self.width, self.beams = width, beams

    def slot_logprobs(self, state: FeatureDraftState, g: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
        """The S slots after features ``g (B, C)`` at positions ``L - 1``, in one draft forward:
        ``(B, S, V + 1)`` log-probabilities, blank last. Near the end of the cache fewer slots run
        (the first ones: a slot sees only those before it, so their outputs are the same)."""
        B, C = g.shape
        S = min(self.slots.shape[0], state.kv.capacity - int(L.max()) + 1)
        dt = self.fc.dtype
        x = F.linear(
            torch.cat([g.to(dt).unsqueeze(1).expand(B, S, C), self.slots[:S].expand(B, S, C)], -1), self.fc
        )
        positions = (L - 1).unsqueeze(1) + torch.arange(S)  # (B, S)
        logits, h = self._run(state, x, positions, index=torch.arange(S).expand(B, S))
        blank = h.float() @ self.blank_w.float() + self.blank_b.float()  # (B, S)
        return torch.log_softmax(torch.cat([logits.float(), blank.unsqueeze(-1)], -1), -1)

    def propose(self, state: FeatureDraftState, ctx: DraftContext, k: int) -> Proposal:
        B, L = ctx.lengths.shape[0], ctx.lengths
        trees: list[TokenTree | None] = [None] * B
        begun = self.start(state, ctx)  # the real pairs; g: the feature at L - 1
        if begun is not None:
            alignments, _ = alignment_beams(
                self.slot_logprobs(state, begun.feature, L), self.width, self.beams
            )
            V = self.vocab_size
            trees = [candidate_tree(alignments[b], V, k) if begun.have[b] else None for b in range(B)]
        return Proposal(tokens=torch.zeros(B, 0, dtype=torch.int64), trees=trees)
