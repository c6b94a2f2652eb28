"""Training prompts: sources, the target's self-written requests (Magpie-style), generation dtype."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.design import data as D
from specdraft.errors import SpecdraftError


def test_sources_are_checked():
    assert D.parse_sources("gsm8k, self") == ("gsm8k", "self")
    for bad in ("", "gsm8k,foo", "self,self"):
        with pytest.raises(SpecdraftError, match="prompt sources"):
            D.parse_sources(bad)
    with pytest.raises(SpecdraftError, match="needs the target"):
        D.training_prompts(4, sources=("self",))


def test_default_sources_keep_the_old_prompts_and_round_robin():
    default = D.training_prompts(10)
    assert default == D.training_prompts(10, sources=("gsm8k", "hellaswag"))
    swapped = D.training_prompts(10, sources=("hellaswag", "gsm8k"))
    assert swapped[0::2] == default[1::2] and swapped[1::2] == default[0::2]
    assert D.training_prompts(3, sources=("gsm8k",)) == default[0:6:2]


def test_task_prompts_wrap_training_texts_and_keep_validation_texts_out():
    """``tasks``: each prompt is one of the TASKS instructions around a GSM8K question or HellaSwag
    context of the same split; the same seed gives the same prompts; no validation text is trained on."""
    train, val = (
        D.training_prompts(60, sources=("tasks",)),
        D.training_prompts(60, split="val", sources=("tasks",)),
    )
    assert train == D.training_prompts(60, sources=("tasks",)) and len(set(train)) == 60

    def text(prompt: str) -> str:
        task = next(t for t in D.TASKS if prompt.startswith(t.split("{text}")[0]))
        return prompt[len(task.split("{text}")[0]) :]

    texts = {
        split: {t for s in D.TASK_TEXTS for t in D._split(s, split, 0, None)} for split in ("train", "val")
    }
    assert all(text(p) in texts["train"] for p in train) and all(text(p) in texts["val"] for p in val)
    assert not texts["train"] & texts["val"]
    assert len({p.split("\n\n")[0] for p in train}) >= 4  # several instructions in use


def _self(pipe, n, cache, **kw):
    return D.self_prompts(pipe, n, cache=cache, **{"min_words": 1, "max_tokens": 16, "progress": False, **kw})


def test_self_prompts_do_not_depend_on_the_batch_and_resume_from_the_cache(tiny_pipe, tmp_path, monkeypatch):
    a = _self(tiny_pipe, 5, tmp_path / "a", batch_size=8)
    assert len(a) == 5 and len(set(a)) == 5 and all(x.strip() for x in a)
    assert _self(tiny_pipe, 5, tmp_path / "b", batch_size=3) == a  # one seed per request
    assert _self(tiny_pipe, 5, tmp_path / "a", split="val", batch_size=8) != a  # held-out requests differ
    monkeypatch.setattr(D, "Engine", None)  # from the cache: no decoding at all
    assert _self(tiny_pipe, 3, tmp_path / "a") == a[:3]


def test_self_prompts_resume_after_a_kill_mid_line(tiny_pipe, tmp_path):
    """A kill leaves the cache's last line half-written: it is dropped (and cut), the run goes on."""
    a = _self(tiny_pipe, 6, tmp_path / "a", batch_size=4)
    b = _self(tiny_pipe, 3, tmp_path / "b", batch_size=4)
    (path,) = (tmp_path / "b").glob("self-prompts-*.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # the last record, cut short
    assert _self(tiny_pipe, 6, tmp_path / "b", batch_size=4) == a and b == a[:3]
    recs = [json.loads(line) for line in path.read_text().splitlines()]  # every line whole again
    assert [r["i"] for r in recs] == list(range(len(recs)))  # each sample once, none lost
    path.write_text('{"i": 0, "text": "ok"}\n{"i": 1}\n')
    with pytest.raises(SpecdraftError, match="record 2"):
        _self(tiny_pipe, 6, tmp_path / "b")


def test_self_prompts_give_up_with_a_clear_error(tiny_pipe, tmp_path):
    with pytest.raises(SpecdraftError, match="usable requests"):
        _self(tiny_pipe, 3, tmp_path, min_words=10_000, max_tries=8, batch_size=4)


def _short_self_prompts(monkeypatch, tmp_path) -> None:
    """``self`` prompts of a few tokens, cached under ``tmp_path / "p"``."""
    real = D.self_prompts
    monkeypatch.setattr(
        D,
        "self_prompts",
        lambda pipe, n, **kw: real(
            pipe,
            n,
            cache=tmp_path / "p",
            min_words=1,
            max_tokens=16,
            split=kw["split"],
            runtime=kw["runtime"],
            progress=False,
        ),
    )


def test_target_data_from_self_prompts_with_bf16_generation(tiny_pipe, tmp_path, monkeypatch):
    _short_self_prompts(monkeypatch, tmp_path)
    rt = D.generation_runtime(tiny_pipe, torch.bfloat16)
    assert rt is not tiny_pipe.runtime and rt.w.dtype == torch.bfloat16
    assert D.generation_runtime(tiny_pipe, None) is tiny_pipe.runtime
    assert D.generation_runtime(tiny_pipe, torch.float32) is tiny_pipe.runtime  # already fp32
    d = D.target_data(
        tiny_pipe,
        n_prompts=4,
        sources=("self",),
        gen_dtype=torch.bfloat16,
        max_new_tokens=6,
        batch_size=4,
        topk=4,
        cache=tmp_path / "data",
        progress=False,
    )
    assert len(d) == 4 and all(len(t) > p for t, p in zip(d.tokens, d.prompt_lens))
    (key,) = [x.name for x in (tmp_path / "data").iterdir()]
    meta = (tmp_path / "data" / key / "meta.json").read_text()
    assert '"sources"' in meta and '"gen_dtype": "bfloat16"' in meta


def test_a_cache_with_the_prompts_hidden_states_serves_a_run_without_them(tiny_pipe, tmp_path, monkeypatch):
    """Answers recorded with the prompt's hidden states are read (not generated again) by a run that
    asks for the answers' hidden states only, which gets no prompt states; a run without any hidden
    state still has its own cache."""
    _short_self_prompts(monkeypatch, tmp_path)
    kw = {"n_prompts": 3, "sources": ("self",), "max_new_tokens": 5, "batch_size": 3, "topk": 4}
    kw["cache"] = tmp_path / "data"
    wide = D.target_data(tiny_pipe, hidden=True, prompt_hidden=True, progress=False, **kw)
    assert wide.prompt_hidden is not None
    monkeypatch.setattr(D, "generate_target_data", lambda *a, **k: pytest.fail("generated again"))
    narrow = D.target_data(tiny_pipe, hidden=True, progress=False, **kw)
    assert narrow.prompt_hidden is None and len(narrow) == 3
    assert all(torch.equal(a, b) for a, b in zip(narrow.hidden, wide.hidden, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(narrow.tokens, wide.tokens, strict=True))
    assert len(list((tmp_path / "data").iterdir())) == 1
    with pytest.raises(pytest.fail.Exception, match="generated again"):
        D.target_data(tiny_pipe, hidden=False, progress=False, **kw)
