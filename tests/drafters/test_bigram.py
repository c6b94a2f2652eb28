"""The README's example drafter: it proposes chains of most frequent successors, is registered as
``--draft bigram``, and keeps greedy output equal to plain decoding (its sampling TV check is a
case of tests/test_tv_all_drafters.py)."""

from pathlib import Path

import pytest
import torch

from specdraft import api
from specdraft.drafters.base import DraftContext
from specdraft.drafters.bigram import BigramDrafter
from specdraft.errors import SpecdraftError
from specdraft.registry import DraftSpec
from specdraft.verify import SamplingParams
from tests.helpers import random_prompts


def _propose(rows: list[list[int]], k: int):
    L = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (L - len(r)) for r in rows])
    B = len(rows)
    ctx = DraftContext(tokens, torch.tensor([len(r) for r in rows]), [SamplingParams()] * B, [None] * B)
    d = BigramDrafter()
    return d.propose(d.new_state(B, L + k), ctx, k)


def test_proposes_the_chain_of_most_frequent_successors():
    # 5 was followed by 6 twice and by 9 once; 6 by 7; 7 by 5. Row 2: 3 was never followed
    prop = _propose([[5, 6, 7, 5, 9, 5, 6, 7, 5], [1, 2, 3]], k=4)
    assert prop.num_valid.tolist() == [4, 0] and prop.probs is None
    assert prop.tokens[0].tolist() == [6, 7, 5, 6]
    short = _propose([[4, 8, 4]], k=3)  # 4 -> 8, and 8 -> 4 -> 8
    assert short.tokens[0].tolist() == [8, 4, 8] and short.num_valid.tolist() == [3]
    assert _propose([[3, 1, 3, 2]], k=2).num_valid.tolist() == [0]  # 2 was never followed


def test_registered_and_greedy_output_equals_plain_decoding():
    assert DraftSpec.parse("bigram").kind == "bigram"
    pipe = api.load("tiny", draft="bigram", dtype="fp32")
    assert isinstance(pipe.drafter, BigramDrafter)
    prompts = [p * 3 for p in random_prompts([4, 7, 5], seed=2)]  # repeated text: bigrams to follow
    spec_tokens, stats = api.run_batch(pipe, prompts, max_new_tokens=24, k=3)
    plain_tokens, _ = api.run_batch(pipe, prompts, max_new_tokens=24, k=0)
    assert spec_tokens == plain_tokens
    assert stats.drafted > 0
    with pytest.raises(SpecdraftError, match="takes no argument"):
        DraftSpec.parse("bigram:2")


def test_the_readme_shows_this_file():
    """The README's "Add a drafter" section shows the file as it is (less docstring and imports)."""
    from specdraft.drafters import bigram

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### Add a drafter") :]
    shown = section.split("```python\n", 1)[1].split("```", 1)[0]
    source = Path(bigram.__file__).read_text()
    assert shown.strip() and shown.strip() in source
    assert source.rstrip().endswith(shown.strip())
    registry_line = section.split("```python\n", 2)[2].split("```", 1)[0].splitlines()[-1]
    assert registry_line in Path(bigram.__file__).parents[1].joinpath("registry.py").read_text()
