import json

import pytest
import torch

from specdraft import api, cli, lossless
from specdraft.bench.harness import Run
from specdraft.bench.hf_baselines import build_hf_baselines, pruned_hf_model
from specdraft.bench.prompts import BenchPrompt, read_prompts
from specdraft.bench.runner import BenchOptions, MethodRun, _classify, converse, markdown_table, run_bench
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime

CONTRACT = [
    "tokens_per_s",
    "plain_tokens_per_s",
    "speedup",
    "mean_accepted_tokens",
    "identical",
    "tie_divergent",
    "divergent",
]
HF = ["hf_plain_tokens_per_s", "hf_assisted_tokens_per_s", "hf_prompt_lookup_tokens_per_s"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe():
    return api.load("tiny", "prune:0", dtype="fp32", draft_dtype="fp32")


@pytest.fixture
def prompt_file(tmp_path):
    lines = [
        {
            "question_id": 1,
            "category": "writing",
            "turns": ["Write a poem about the sea.", "Now make it shorter."],
        },
        {"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]},
        {"prompt": "abc abc abc abc abc abc", "category": "qa"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def quick(**kw) -> BenchOptions:
    kw.setdefault("k", 3)
    kw.setdefault("max_new_tokens", 8)
    return BenchOptions(progress=False, **kw)


def test_cli_json_contract_with_hf_baselines(prompt_file, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "--target",
        "tiny",
        "--draft",
        "prune:0",
        "--k",
        "3",
        "--dtype",
        "fp32",
        "--draft-dtype",
        "int8",
        "--prompts",
        str(prompt_file),
        "--max-new-tokens",
        "8",
        "--baselines",
        "hf",
        "--no-progress",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    d = json.loads(out.read_text())
    for key in CONTRACT + HF:
        assert key in d["overall"], key
        assert d["overall"][key] is not None, key
    assert set(d["categories"]) == {"writing", "qa"}
    assert d["categories"]["qa"]["prompts"] == 2
    for cat in d["categories"].values():
        assert set(CONTRACT + HF) <= set(cat)
    assert [r["id"] for r in d["prompts"]] == ["1", "2", "3"]
    row = d["prompts"][0]
    assert row["turns"] == 2 and row["equality"] == "identical"
    assert row["new_tokens"] == row["plain_new_tokens"] == row["hf_plain_new_tokens"]
    # fp32 greedy: speculative output is plain output, prompt for prompt
    assert d["overall"]["identical"] == 3 and d["overall"]["divergent"] == 0
    assert d["overall"]["speedup"] == pytest.approx(
        d["overall"]["tokens_per_s"] / d["overall"]["plain_tokens_per_s"], rel=1e-3
    )
    assert "layers [0]" in d["config"]["hf_assistant"] and d["config"]["draft_dtype"] == "int8"
    assert d["config"]["command"].startswith(
        "specdraft bench --target tiny --draft prune:0 --k 3 --dtype fp32 --draft-dtype int8"
    )
    table = capsys.readouterr().out
    assert "| **overall** | 3 |" in table and "HF assisted tok/s" in table


def test_cli_bad_prompt_file_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    assert cli.main(["bench", "--target", "tiny", "--prompts", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{bad}:2: malformed JSON" in err


def test_cli_unknown_category_and_empty_file(prompt_file, tmp_path, capsys):
    assert (
        cli.main(["bench", "--target", "tiny", "--prompts", str(prompt_file), "--categories", "qa,poetry"])
        == 2
    )
    assert "unknown category poetry" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert cli.main(["bench", "--target", "tiny", "--prompts", str(empty)]) == 2
    assert "has no prompts" in capsys.readouterr().err


def test_second_turn_follows_the_methods_own_first_answer(pipe):
    prompt = BenchPrompt("1", "writing", ("first question", "second question"))
    answers = iter([[104, 105], [33]])  # "hi", "!"
    seen = []

    def decode(ids):
        seen.append(ids)
        return Run(next(answers), 0.5)

    run = converse(pipe, prompt, decode, budget=400, mode="truncate")
    assert run.turns == [[104, 105], [33]] and run.new_tokens == 3 and run.seconds == 1.0
    conversation = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "second question"},
    ]
    assert seen[1] == pipe.encode(conversation, chat=True)
    assert run.prompt_ids == seen


def test_self_draft_accepts_everything_and_matches_plain(pipe, prompt_file):
    self_pipe = api.Pipeline(
        pipe.target, pipe.runtime, api.make_drafter("self", pipe.target, pipe.runtime, torch.float32), "self"
    )
    result = run_bench(self_pipe, read_prompts(prompt_file), quick(k=4))
    assert result.overall["acceptance_rate"] == 1.0
    assert result.overall["identical"] == 3
    assert all(r["new_tokens"] == r["plain_new_tokens"] for r in result.prompts)
    assert result.overall["mean_accepted_tokens"] > 2.0


def test_classify_reports_divergence_at_confident_and_tie_positions(pipe):
    ids = pipe.encode("Who wrote Hamlet?")
    ref, _ = lossless.plain_greedy_margins(pipe.runtime, ids, 8, pipe.eos_ids)
    changed = list(ref)
    changed[3] = (changed[3] + 1) % 256
    plain = MethodRun(turns=[ref], prompt_ids=[ids])
    spec = MethodRun(turns=[changed], prompt_ids=[ids])
    assert _classify(pipe, plain, spec, 8, tol=0.0) == (lossless.DIVERGENT, 3)
    assert _classify(pipe, plain, spec, 8, tol=1e9) == (lossless.TIE_DIVERGENT, 3)
    assert _classify(pipe, plain, MethodRun(turns=[ref], prompt_ids=[ids]), 8, tol=0.0) == (
        lossless.IDENTICAL,
        None,
    )


def test_long_prompts_are_truncated_or_skipped(pipe, prompt_file):
    prompts = read_prompts(prompt_file)
    notes = []
    cut = run_bench(pipe, prompts, quick(max_prompt_tokens=40), log=notes.append)
    assert all(r["prompt_tokens"] <= 40 * r["turns"] for r in cut.prompts)
    assert cut.prompts[0]["truncated_tokens"] > 0 and "truncated" in cut.prompts[0]["notes"][0]
    assert any("truncated" in n for n in notes)

    short = [BenchPrompt("s", "qa", ("hi",)), *prompts]
    skipped = run_bench(pipe, short, quick(max_prompt_tokens=30, long_prompts="skip"), log=notes.append)
    assert [r["id"] for r in skipped.prompts] == ["s"]
    assert {s["id"] for s in skipped.skipped} == {"1", "2", "3"}
    assert "skipped" in skipped.skipped[0]["reason"]

    with pytest.raises(SpecdraftError, match="every prompt was skipped"):
        run_bench(pipe, prompts, quick(max_prompt_tokens=10, long_prompts="skip"), log=notes.append)


def test_sampling_runs_are_not_classified(pipe, prompt_file):
    result = run_bench(
        pipe, read_prompts(prompt_file)[1:], quick(params=api.SamplingParams(temperature=1.0, seed=3))
    )
    assert result.overall["identical"] is None and result.prompts[0]["equality"] is None
    assert result.overall["new_tokens"] > 0
    assert "n/a" in markdown_table(result)


def test_bad_options(pipe, prompt_file):
    prompts = read_prompts(prompt_file)
    plain_pipe = api.Pipeline(pipe.target, pipe.runtime, None, "none")
    with pytest.raises(SpecdraftError, match="give a draft"):
        run_bench(plain_pipe, prompts, quick())
    with pytest.raises(SpecdraftError, match="--k >= 1"):
        run_bench(pipe, prompts, quick(k=0))
    with pytest.raises(SpecdraftError, match="unknown baseline"):
        quick(baselines=("vllm",))
    with pytest.raises(SpecdraftError, match="max-new-tokens"):
        quick(max_new_tokens=0)


def test_pruned_hf_model_computes_the_same_logits_as_the_layer_subset(pipe):
    layers = [1, 0]
    small = pruned_hf_model(pipe.target.model, layers)
    assert small.config.num_hidden_layers == 2
    ids = torch.tensor([pipe.encode("The cat sat", chat=False)])
    sub = LlamaRuntime(pipe.runtime.w, layers)
    ours = sub.forward(sub.new_state(1, 32), ids, torch.arange(ids.shape[1]).unsqueeze(0)).logits
    with torch.inference_mode():
        theirs = small(ids).logits
    torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=1e-4)


def test_hf_baselines_match_plain_greedy(pipe):
    hf = build_hf_baselines(pipe, k=3)
    assert hf.methods == ("hf_plain", "hf_assisted", "hf_prompt_lookup")
    ids = pipe.encode("Who wrote Hamlet?")
    ref, _ = lossless.plain_greedy_margins(pipe.runtime, ids, 8, pipe.eos_ids)
    for method in hf.methods:
        assert hf.run(method, ids, 8, api.SamplingParams()) == ref, method
    lookup_pipe = api.Pipeline(
        pipe.target,
        pipe.runtime,
        api.make_drafter("lookup", pipe.target, pipe.runtime, torch.float32),
        "lookup",
    )
    hf = build_hf_baselines(lookup_pipe, k=3)
    assert hf.assistant is None and "hf_assisted" not in hf.methods


def test_designed_draft_is_the_transformers_assistant(pipe, tmp_path):
    from specdraft.design.artifact import DraftMeta, save_draft

    draft = pruned_hf_model(pipe.target.model, [1])  # any small Llama sharing the target's embedding
    path = save_draft(tmp_path / "d1", draft, DraftMeta.for_target(pipe.target.model, "tiny"))
    spec = f"designed:{path}"
    dpipe = api.Pipeline(
        pipe.target, pipe.runtime, api.make_drafter(spec, pipe.target, pipe.runtime, torch.float32), spec
    )
    hf = build_hf_baselines(dpipe, k=2)
    assert "hf_assisted" in hf.methods and "designed draft d1" in hf.assistant_note
    ids = pipe.encode("Who wrote Hamlet?")
    ref, _ = lossless.plain_greedy_margins(pipe.runtime, ids, 8, pipe.eos_ids)
    assert hf.run("hf_assisted", ids, 8, api.SamplingParams()) == ref
