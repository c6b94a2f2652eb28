"""Shared fixtures: tiny random Llamas as compact runtimes (built once per session), and the real
SmolLM2 (loaded once per session, from the converted cache after the first run).

Tests run with one torch thread: the machine has two shared cores, and two OpenMP threads next to
another busy process stall far more than they gain.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.tiny import tiny_llama
from tests.helpers import compact


def pytest_configure(config):
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module whose tests may change it (``pytestmark =
    pytest.mark.usefixtures("one_thread")``), the count restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Tiny:
    """Tiny random models (vocab 256, 2 layers, fp32) for equality tests.

    Attributes:
        model: the transformers target (seed 0).
        weights: its extracted weights.
        target: compact runtime over all of the target's layers.
        other: an independently seeded model of the same shape (seed 1): a draft that is almost
            never accepted.
    """

    model: object
    weights: LlamaWeights
    target: LlamaRuntime
    other: LlamaRuntime


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    model = tiny_llama(seed=0)
    weights = LlamaWeights.from_hf(model, torch.float32)
    return Tiny(model=model, weights=weights, target=LlamaRuntime(weights), other=compact(tiny_llama(seed=1)))


@pytest.fixture(scope="session")
def tiny_pipe():
    """The tiny target (vocab 256, 2 layers, fp32) through the public API, with no drafter."""
    from specdraft import api

    return api.load("tiny", draft="none", dtype="fp32", threads=1)


@dataclass
class Smol:
    """The real SmolLM2-135M-Instruct (fp32), through the public API."""

    pipe: object  # specdraft.api.Pipeline with no drafter

    @property
    def runtime(self):
        return self.pipe.runtime


@pytest.fixture(scope="session")
def smollm2() -> Smol:
    from specdraft import api

    return Smol(api.load("smollm2-135m", draft="none", dtype="fp32"))
