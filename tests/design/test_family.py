"""The committed draft family for smollm2-135m (issue 20, ``drafts/smollm2-135m-family``): each
draft is the shape its name says, fits the 20 MB budget, is one of the grid ``grid.sh`` lists for
``drafts/train_family.sh``, and speculates losslessly beside the real target with some of its
proposals accepted."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from specdraft import api
from specdraft.design.artifact import DRAFTS_DIR
from specdraft.policy import VerifyCost
from specdraft.study.latency import draft_shape
from tests.helpers import plain_greedy

FAMILY = DRAFTS_DIR / "smollm2-135m-family"
NAMES = sorted(p.name for p in FAMILY.iterdir() if (p / "specdraft.json").is_file())
WIDTH = {"full": (9, 3, 1536), "half": (4, 2, 768), "quarter": (2, 1, 384)}  # heads, groups, FFN
HEAD = {"h16k": 16384, "hfull": 49152}
PROMPTS = ["What is 12 times 7? Explain step by step.", "Write a short poem about the sea."]


def test_the_committed_drafts_are_the_grid_train_family_trains():
    grid = re.search(r'grid="([^"]*)"', (FAMILY / "grid.sh").read_text()).group(1).split()
    assert NAMES and set(NAMES) <= set(grid), (NAMES, grid)
    assert all(re.fullmatch(r"d\d+-(full|half|quarter)-h(16k|full)", n) for n in grid)


@pytest.mark.parametrize("name", NAMES)
def test_draft_is_its_name_small_and_lossless(name, smollm2):
    depth, width, head = name.split("-")
    stored = sum(f.stat().st_size for f in (FAMILY / name).iterdir())
    assert stored <= 20e6 and (FAMILY / name / "RECIPE.md").is_file()
    pipe = smollm2.pipe
    drafter = api.make_drafter(f"designed:{FAMILY.name}/{name}", pipe.target, pipe.runtime, torch.float32)
    s = draft_shape(drafter)
    assert (s["layers"], s["query_heads"], s["kv_heads"], s["ffn"]) == (int(depth[1:]), *WIDTH[width])
    assert s["head_rows"] == HEAD[head]
    drafter.cost = VerifyCost([1.0] * 9, 0.0)  # free verification: the gate lets every proposal through
    spec = dataclasses.replace(pipe, drafter=drafter, draft_spec=name)
    prompts = [pipe.encode(p) for p in PROMPTS]
    out, stats = api.run_batch(spec, prompts, max_new_tokens=24, k=3)
    assert out == [plain_greedy(pipe.runtime, p, 24, eos_ids=pipe.eos_ids) for p in prompts]
    assert stats.drafted > 0 and stats.accepted > 0
