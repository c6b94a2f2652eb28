"""The committed draft families (issue 20, ``drafts/<target>-family``): each draft is the shape its
name says, fits the 20 MB budget, is one of the grid its ``grid.sh`` lists for
``drafts/train_family.sh``, and speculates losslessly beside the real target with some of its
proposals accepted."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from specdraft import api
from specdraft.design.artifact import DRAFTS_DIR
from specdraft.policy import VerifyCost
from specdraft.study.latency import draft_shape
from tests.helpers import plain_greedy

# family -> (target fixture, {width: (query heads, key/value heads, FFN)}, {head: rows})
FAMILIES = {
    "smollm2-135m-family": (
        "smollm2",
        {"full": (9, 3, 1536), "half": (4, 2, 768), "quarter": (2, 1, 384)},
        {"h16k": 16384, "hfull": 49152},
    ),
    "gemma3-270m-family": (
        "gemma3",
        {"full": (4, 1, 2048), "half": (2, 1, 896), "quarter": (1, 1, 384)},
        {"h16k": 16384, "hfull": 262144},
    ),
}
DRAFTS = [
    (family, p.name)
    for family in FAMILIES
    for p in sorted((DRAFTS_DIR / family).iterdir())
    if (p / "specdraft.json").is_file()
]
PROMPTS = ["What is 12 times 7? Explain step by step.", "Write a short poem about the sea."]


@pytest.fixture(scope="session")
def gemma3():
    """The real Gemma-3-270M (fp32), through the public API."""
    return SimpleNamespace(pipe=api.load("gemma3-270m", draft="none", dtype="fp32"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_committed_drafts_are_the_grid_train_family_trains(family):
    grid = re.search(r'grid="([^"]*)"', (DRAFTS_DIR / family / "grid.sh").read_text()).group(1).split()
    assert all(re.fullmatch(r"d\d+-(full|half|quarter)-h(16k|full)", n) for n in grid)
    assert {name for f, name in DRAFTS if f == family} <= set(grid)


@pytest.mark.parametrize(("family", "name"), DRAFTS)
def test_draft_is_its_name_small_and_lossless(family, name, request):
    fixture, widths, heads = FAMILIES[family]
    depth, width, head = name.split("-")
    stored = sum(f.stat().st_size for f in (DRAFTS_DIR / family / name).iterdir())
    assert stored <= 20e6 and (DRAFTS_DIR / family / name / "RECIPE.md").is_file()
    pipe = request.getfixturevalue(fixture).pipe
    drafter = api.make_drafter(f"designed:{family}/{name}", pipe.target, pipe.runtime, torch.float32)
    s = draft_shape(drafter)
    assert (s["layers"], s["query_heads"], s["kv_heads"], s["ffn"]) == (int(depth[1:]), *widths[width])
    assert s["head_rows"] == heads[head]
    drafter.cost = VerifyCost([1.0] * 9, 0.0)  # free verification: the gate lets every proposal through
    spec = dataclasses.replace(pipe, drafter=drafter, draft_spec=name)
    prompts = [pipe.encode(p) for p in PROMPTS]
    out, stats = api.run_batch(spec, prompts, max_new_tokens=24, k=3)
    assert out == [plain_greedy(pipe.runtime, p, 24, eos_ids=pipe.eos_ids) for p in prompts]
    assert stats.drafted > 0 and stats.accepted > 0
