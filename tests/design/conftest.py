"""Tiny targets and drafts for the design tests (random init, vocab 256)."""

from __future__ import annotations

import pytest
import torch

from specdraft import api


@pytest.fixture(scope="module")
def tiny_pipe():
    """The tiny target (2 layers, vocab 256) with no drafter."""
    return api.load("tiny", draft="none", dtype="fp32")


def head_subset(n: int, seed: int = 0, must: tuple[int, ...] = ()) -> torch.Tensor:
    """``n`` distinct random ids of the 256-token vocabulary (plus ``must``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(256, generator=g)[:n].tolist()
    return torch.tensor(ids + [m for m in must if m not in ids])
