"""Small helpers shared by the tests (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import torch

from specdraft.drafters.base import TargetFeatures
from specdraft.engine import Engine, Request, decode_requests, generate
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.verify import SamplingParams

TINY_CLI = ["--target", "tiny", "--dtype", "fp32", "--threads", "1"]  # CLI flags: the tiny fp32 target


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``specdraft ARGV`` in this process: exit status, stdout, stderr."""
    from specdraft import cli

    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def compact(model, dtype: torch.dtype = torch.float32, layers: list[int] | None = None) -> LlamaRuntime:
    """The compact runtime over a transformers Llama."""
    return LlamaRuntime(LlamaWeights.from_hf(model, dtype), layers)


def head_subset(n: int, seed: int = 0, must: tuple[int, ...] = ()) -> torch.Tensor:
    """``n`` distinct random ids of the tiny models' 256-token vocabulary (plus ``must``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(256, generator=g)[:n].tolist()
    return torch.tensor(ids + [m for m in must if m not in ids])


def random_prompts(lengths: list[int], vocab: int = 254, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths with ids below ``vocab`` (254 keeps clear of the tiny EOS)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def decode(
    engine: Engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams | list[SamplingParams] = SamplingParams(),
    eos_ids: tuple[int, ...] = (),
) -> list[list[int]]:
    """Run ``prompts`` together through ``engine`` to the end; output tokens per prompt, in order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    return decode_requests(
        engine, [Request(list(p), max_new_tokens, pp, eos_ids) for p, pp in zip(prompts, plist)]
    )


def decode_logprobs(
    engine: Engine, prompts: list[list[int]], max_new_tokens: int, params: list[SamplingParams]
):
    """Run ``prompts`` together to the end; per prompt, its output tokens' ``StepEvent.logprobs``
    (None for a row whose params ask none)."""
    requests = [Request(list(p), max_new_tokens, pp) for p, pp in zip(prompts, params)]
    out: dict[int, list | None] = {}
    for ev in generate(engine, requests):
        got = out.setdefault(ev.request_id, None if ev.logprobs is None else [])
        assert (got is None) == (ev.logprobs is None)
        if got is not None:
            got.extend(ev.logprobs)
    return [out[r.id] for r in requests]


def assert_target_logprobs(model, prompt: list[int], got: list, top: int) -> None:
    """``got`` (a row's :class:`~specdraft.verify.TokenLogprob` s) against the transformers model's
    log-softmax over ``prompt + output`` in one forward: each token's, and the ``top`` best."""
    tokens = [g.token for g in got]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits.float(), dim=-1)  # (n, V): row j predicts output token j
    want = lp.gather(1, torch.tensor(tokens).unsqueeze(1))[:, 0]
    assert torch.allclose(torch.tensor([g.logprob for g in got]), want, atol=1e-4)
    for j, g in enumerate(got):
        assert len(g.top) == top
        ids, values = [t for t, _ in g.top], torch.tensor([v for _, v in g.top])
        assert torch.allclose(values, lp[j, ids], atol=1e-4)
        assert values.tolist() == sorted(values.tolist(), reverse=True)
        if top:
            assert values[0] >= lp[j].max() - 1e-4  # the most likely token first


def plain_greedy(runtime, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = ()) -> list[int]:
    """The reference: plain greedy decoding of one prompt (batch 1, no drafter)."""
    return decode(Engine(runtime), [prompt], max_new_tokens, eos_ids=eos_ids)[0]


def target_answers(
    pipe, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16, hidden: bool = True
):
    """The tiny target's greedy answers to ``prompts`` with its top-8 log-probs and (``hidden``) its
    final hidden states, the answer's and the prompt's: the cached training data of the feature
    drafters' tests."""
    from specdraft.design.data import generate_target_data

    return generate_target_data(
        pipe.runtime,
        prompts,
        eos_ids=(),
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        topk=8,
        hidden_layer=-1 if hidden else None,
        prompt_hidden=hidden,
        progress=False,
    )


def kept_features(hidden: dict, first: list[int], capacity: int) -> TargetFeatures:
    """What the engine keeps for feature drafters (:class:`TargetFeatures`): row b of each
    ``hidden[i] (B, T, C)`` written at positions ``first[b] .. first[b] + T - 1``, the answer's first
    pair at ``first[b]`` (for drafters that read no prompt pairs: the positions before are zeros)."""
    kept = {}
    for i, h in hidden.items():
        buf = h.new_zeros(h.shape[0], capacity, h.shape[2])
        for b, p in enumerate(first):
            buf[b, p : p + h.shape[1]] = h[b]
        kept[i] = buf
    return TargetFeatures(kept, torch.tensor(first))


def accepted_columns(verified, num_accepted: torch.Tensor) -> list[list[int]]:
    """Per row, the columns of a token-tree step's target forward ``[root, nodes]`` along the
    accepted path, root first (from the root, the first child carrying each accepted token)."""
    paths = []
    for b, (fed, parents, committed) in enumerate(zip(verified.inputs, verified.parents, verified.committed)):
        path = [0]
        for tok in committed[: int(num_accepted[b])]:
            nxt = [i for i, (t, p) in enumerate(zip(fed, parents)) if p == path[-1] and t == tok]
            if not nxt:
                break
            path.append(nxt[0])
        paths.append(path)
    return paths


# ``specdraft design build`` on the tiny target with the smallest data (6 prompts, 4 held out, 8 new
# tokens): the start of every end-to-end build test's command line
TINY_BUILD = [
    "design",
    "build",
    "--target",
    "tiny",
    "--threads",
    "1",
    "--prompts",
    "6",
    "--val-prompts",
    "4",
    "--max-new-tokens",
    "8",
    "--gen-batch",
    "4",
    "--quiet",
]
