"""The precision table: every option's choices and help come from it, and the API resolves its names."""

import argparse

import pytest
import torch

from specdraft import api, dtypes
from specdraft.commands import add_model_arguments
from specdraft.commands import design as design_command
from specdraft.commands import study as study_command
from specdraft.errors import SpecdraftError


def _option(add, dest: str, *args) -> argparse.Action:
    p = argparse.ArgumentParser()
    add(p, *args)
    return next(a for a in p._actions if a.dest == dest)


def _study_action(dest):
    return _option(study_command.add_arguments, dest)


def _gen_action():
    p = argparse.ArgumentParser()
    design_command._data_args(p, 8)
    return next(a for a in p._actions if a.dest == "gen_dtype")


@pytest.mark.parametrize(
    "action, role",
    [
        (lambda: _option(add_model_arguments, "dtype"), "target"),
        (lambda: _option(add_model_arguments, "draft_dtype"), "draft"),
        (_gen_action, "gen"),
        (lambda: _study_action("dtype"), "study-target"),
        (lambda: _study_action("draft_dtype"), "study-draft"),
    ],
)
def test_options_take_choices_and_help_from_the_table(action, role):
    a = action()
    assert list(a.choices) == dtypes.choices(role)
    assert a.help == dtypes.help_text(role)
    assert a.default in a.choices


def test_roles_accept_what_the_runtimes_can_do():
    assert dtypes.choices("target") == ["auto", "bf16", "fp32", "q"]  # int8 would not be lossless
    assert dtypes.choices("draft") == ["auto", "bf16", "fp32", "int8", "q"]  # q: GGUF blocks
    assert dtypes.choices("gen") == ["same", "bf16", "fp32"]
    assert "int8" in dtypes.choices("study-draft") and "q" not in dtypes.choices("study-target")
    with pytest.raises(ValueError, match="unknown dtype role"):
        dtypes.choices("save")


def test_the_api_resolves_every_name_with_a_torch_dtype():
    for name, d in dtypes.DTYPES.items():
        if d.torch is None:
            continue
        draft = d.torch == torch.qint8
        assert api.resolve_dtype(name, draft=draft) == d.torch
    assert dtypes.torch_dtype("same") is None and dtypes.torch_dtype("bf16") == torch.bfloat16
    with pytest.raises(SpecdraftError, match="unknown dtype 'fp8': use auto, bf16, fp32$"):
        api.resolve_dtype("fp8")
