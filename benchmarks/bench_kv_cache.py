"""The quantized runtime with an fp16 key/value cache (the default) against an fp32 one, in one run.

Two :class:`~specdraft.models.quant.QuantRuntime` over the same GGUF weights (shared in memory), one
caching keys and values in fp16, one in fp32. In one process, rounds alternating:

- step time: one-token forwards (``--steps`` of them) after a prefill of ``--contexts`` tokens, the
  two caches in turn, medians; what a decode step costs at each context length;
- Spec-Bench first turns (``--limit`` per category, greedy, batch 1, ``--max-new-tokens``): plain
  decoding and ``--draft`` with ``--k``, the four methods in a rotating order per prompt; decode
  tokens per second (prefill excluded) overall and per category, each method's speculative speedup
  over its own plain decoding, and the greedy agreement of the two caches' plain outputs (two
  roundings of one model: not identical, and not meant to be);
- teacher-forced perplexity of each prompt's own text under both caches (the quality check).

Ratios compare methods of this run only (a shared host's speed drifts); the CPU is printed.

    .venv/bin/python benchmarks/bench_kv_cache.py --threads 2 --limit 2 --json results/kv16/bench.json

Spec-Bench is evaluation-only here; nothing is tuned on it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench import harness
from specdraft.bench.profile import cpu_name
from specdraft.bench.prompts import load_prompts
from specdraft.models.quant import QuantRuntime
from specdraft.policy import make_policy

CACHES = {"fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="lookup")
    p.add_argument("--k", default="auto")
    p.add_argument("--limit", type=int, default=2, help="prompts per Spec-Bench category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--contexts", default="128,512,1024,2048", help="step-time contexts")
    p.add_argument("--steps", type=int, default=32, help="one-token forwards per context and round")
    p.add_argument("--rounds", type=int, default=3, help="step-time rounds")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def step_ms(rt: QuantRuntime, context: int, steps: int) -> float:
    """Median milliseconds of a one-token forward after a ``context``-token prefill."""
    state = rt.new_state(1, context + steps)
    ids = torch.randint(0, rt.vocab_size, (1, context + steps), generator=torch.Generator().manual_seed(0))
    for c0 in range(0, context, 256):  # prefill in chunks, as the engine does
        c1 = min(c0 + 256, context)
        rt.forward(state, ids[:, c0:c1], torch.arange(c0, c1).view(1, -1))
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        rt.forward(state, ids[:, context + i : context + i + 1], torch.tensor([[context + i]]))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def step_times(runtimes: dict, contexts: list[int], steps: int, rounds: int) -> dict:
    """``{context: {cache: median ms}}`` over ``rounds`` alternating rounds."""
    out = {c: {name: [] for name in runtimes} for c in contexts}
    for r in range(rounds):
        for c in contexts:
            for name in harness.interleave(list(runtimes), r):
                out[c][name].append(step_ms(runtimes[name], c, steps))
    return {c: {name: statistics.median(v) for name, v in row.items()} for c, row in out.items()}


def perplexity(rt: QuantRuntime, prompts: list[list[int]]) -> float:
    """Teacher-forced perplexity of the prompts' own tokens (one forward each)."""
    nll, n = 0.0, 0
    for ids in prompts:
        t = torch.tensor([ids])
        logits = rt.forward(rt.new_state(1, len(ids)), t, torch.arange(len(ids)).view(1, -1)).logits[0]
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], t[0, 1:], reduction="sum"))
        n += len(ids) - 1
    return math.exp(nll / n)


def decode_rates(methods: list, prompts: list, max_new: int) -> dict:
    """Every method on every prompt, interleaved: decode tok/s per method, overall and by category,
    and each method's outputs."""
    per = {m.name: {"tokens": 0, "seconds": 0.0, "by_category": {}, "outputs": []} for m in methods}
    for i, (category, ids) in enumerate(prompts):
        for name, run in harness.run_prompt(methods, ids, i, max_new).items():
            decode_s = run.seconds - run.prefill_seconds
            rec = per[name]
            rec["tokens"] += len(run.tokens) - 1
            rec["seconds"] += decode_s
            rec["outputs"].append(run.tokens)
            cat = rec["by_category"].setdefault(category, [0, 0.0])
            cat[0], cat[1] = cat[0] + len(run.tokens) - 1, cat[1] + decode_s
    for rec in per.values():
        rec["tok_s"] = rec["tokens"] / rec["seconds"]
        rec["by_category"] = {c: t / s for c, (t, s) in rec["by_category"].items()}
    return per


def main(argv=None) -> int:
    args = parse_args(argv)
    print("command: python benchmarks/bench_kv_cache.py " + " ".join(sys.argv[1:] if argv is None else argv))
    pipe = api.load(args.target, args.draft, dtype="q", threads=args.threads)
    print(f"cpu: {cpu_name()}, threads {torch.get_num_threads()}", flush=True)
    runtimes = {
        name: QuantRuntime(pipe.runtime.w, pipe.runtime.variant, kv_dtype=dt) for name, dt in CACHES.items()
    }
    contexts = [int(c) for c in args.contexts.split(",") if c]
    steps = step_times(runtimes, contexts, args.steps, args.rounds)
    print("\none-token step after a prefill of N tokens (median ms; fp32 / fp16 = what the fp16 cache saves)")
    print(f"  {'N':>6} {'fp16 ms':>9} {'fp32 ms':>9} {'fp32/fp16':>10}")
    for c, row in steps.items():
        print(f"  {c:>6} {row['fp16']:9.3f} {row['fp32']:9.3f} {row['fp32'] / row['fp16']:9.2f}x")

    bench = load_prompts(None, None, args.limit)
    prompts = [(p.category, pipe.encode(p.turns[0])[-args.max_prompt_tokens :]) for p in bench]
    eos = pipe.eos_ids
    policy = {name: make_policy(args.k) for name in CACHES}
    methods = []
    for name, rt in runtimes.items():
        methods.append(harness.engine_method(f"plain {name}", rt, eos_ids=eos))
        methods.append(
            harness.engine_method(f"{args.draft} {name}", rt, pipe.drafter, policy[name], eos_ids=eos)
        )
    harness.warm_up(methods, prompts[0][1][:64], 8)
    rates = decode_rates(methods, prompts, args.max_new_tokens)
    cats = sorted({c for c, _ in prompts})
    mean = statistics.mean(len(i) for _, i in prompts)
    print(
        f"\n{len(prompts)} Spec-Bench first turns ({args.limit} per category, prompts of {mean:.0f} tokens on"
    )
    print(f"average, at most {args.max_prompt_tokens}), {args.max_new_tokens} new tokens, greedy, batch 1:")
    print("decode tok/s (prefill excluded), and fp16 over fp32 for the same method")
    print(f"  {'method':<16} {'all':>7} " + " ".join(f"{c[:11]:>11}" for c in cats))
    for m in methods:
        r = rates[m.name]
        print(f"  {m.name:<16} {r['tok_s']:7.1f} " + " ".join(f"{r['by_category'][c]:11.1f}" for c in cats))
    for kind in ("plain", args.draft):
        a, b = rates[f"{kind} fp16"], rates[f"{kind} fp32"]
        ratio = " ".join(f"{a['by_category'][c] / b['by_category'][c]:10.2f}x" for c in cats)
        print(f"  {kind + ' fp16/fp32':<16} {a['tok_s'] / b['tok_s']:6.2f}x {ratio}")
    for name in CACHES:
        sp = rates[f"{args.draft} {name}"]["tok_s"] / rates[f"plain {name}"]["tok_s"]
        print(f"  {args.draft} over plain, {name} cache: {sp:.2f}x")
    same = harness.agreement(rates["plain fp16"]["outputs"], rates["plain fp32"]["outputs"])
    lossless = all(rates[f"{args.draft} {n}"]["outputs"] == rates[f"plain {n}"]["outputs"] for n in CACHES)
    print(
        f"  plain outputs, fp16 against fp32 cache: {same['identical_outputs']}/{same['prompts']} identical, "
        f"mean common prefix {same['mean_common_prefix']:.1f}, position-wise {same['positionwise']:.3f}"
    )
    print(f"  speculative outputs equal their own cache's plain outputs: {lossless}")
    ppl = {name: perplexity(rt, [ids for _, ids in prompts]) for name, rt in runtimes.items()}
    print(f"  teacher-forced perplexity of the prompts: fp16 {ppl['fp16']:.4f}, fp32 {ppl['fp32']:.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        for r in rates.values():
            r.pop("outputs")
        body = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "step_ms": steps, "decode": rates}
        body |= {
            "agreement": same,
            "lossless": lossless,
            "perplexity": ppl,
            "args": vars(args) | {"json": str(args.json)},
        }
        args.json.write_text(json.dumps(body, indent=1) + "\n")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
