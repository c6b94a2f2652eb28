"""Draft-length policies against each other and against plain decoding, in one process.

One drafter (prompt lookup by default), several policies (``--policies auto,2,4,heuristic``: the
cost-aware policy, fixed k, transformers' heuristic), Spec-Bench first turns, batch 1, greedy.
After an untimed warm-up of every method, each prompt runs every method once in a rotating order
(A B C, then B C A, ...), so slow phases of a shared machine hit all methods alike. Each method
keeps one policy for the whole run (as ``specdraft bench`` and the server do). tokens/s is
total new tokens / total wall time (prefill included); every speculative output is checked
against plain decoding token for token. Prints overall and per-category speedups over plain, and
the overall speedup of the decode phase alone (prefill, the same work for every method, left out).

    .venv/bin/python benchmarks/bench_policy.py --limit 4 --max-new-tokens 64 --threads 2

Spec-Bench is evaluation-only here; nothing is tuned on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api  # noqa: E402
from specdraft.bench.prompts import fit_context, load_prompts, parse_categories  # noqa: E402
from specdraft.engine import Engine, Request, generate  # noqa: E402
from specdraft.policy import make_policy  # noqa: E402
from specdraft.verify import SamplingParams  # noqa: E402

# name -> policy factory; a name not here goes to make_policy ("auto", "heuristic", "4")
POLICIES: dict = {}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="lookup")
    p.add_argument("--policies", default="auto,2,4,heuristic")
    p.add_argument("--limit", type=int, default=4, help="Spec-Bench questions per category")
    p.add_argument("--categories", default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are cut in the middle")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_policy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print("command:", command, flush=True)
    pipe = api.load(args.target, args.draft, threads=args.threads)
    prompts = load_prompts(None, parse_categories(args.categories), args.limit)
    ids = [fit_context(pipe.encode(p.turns[0]), args.max_prompt_tokens).ids for p in prompts]
    names = ["plain"] + [x.strip() for x in args.policies.split(",") if x.strip()]

    # one policy per method for the whole run, as `specdraft bench` and the server keep one: an
    # adaptive policy goes on learning across requests
    policies = {n: POLICIES[n]() if n in POLICIES else make_policy(n) for n in names[1:]}

    def run(name: str, prompt: list[int], max_new: int) -> tuple[list[int], float, float, int]:
        if name == "plain":
            engine = Engine(pipe.runtime, None)
        else:
            engine = Engine(pipe.runtime, pipe.drafter, policies[name])
        t0 = time.perf_counter()
        out = [t for ev in generate(engine, [Request(prompt, max_new, SamplingParams(), pipe.eos_ids)]) for t in ev.tokens]
        return out, time.perf_counter() - t0, engine.stats.prefill_time, engine.stats.target_forwards

    for name in names:  # warm-up
        run(name, ids[0][:64], 16)
    tokens, secs, forwards = defaultdict(lambda: defaultdict(int)), defaultdict(lambda: defaultdict(float)), defaultdict(int)
    decode_secs = defaultdict(float)  # overall, prefill left out
    mismatches = defaultdict(int)
    for i, (prompt, p) in enumerate(zip(ids, prompts)):
        order = names[i % len(names):] + names[: i % len(names)]
        outs = {}
        for name in order:
            out, s, prefill, f = run(name, prompt, args.max_new_tokens)
            outs[name] = out
            for key in (p.category, "overall"):
                tokens[name][key] += len(out)
                secs[name][key] += s
            decode_secs[name] += s - prefill
            forwards[name] += f
        for name in names[1:]:
            mismatches[name] += outs[name] != outs["plain"]
        print(f"\r{i + 1}/{len(ids)} prompts", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    cats = list(dict.fromkeys(p.category for p in prompts)) + ["overall"]
    rate = {n: {c: tokens[n][c] / secs[n][c] for c in cats} for n in names}
    print(f"\n{args.target}, draft {args.draft}, {torch.get_num_threads()} threads, {len(ids)} Spec-Bench first turns, "
          f"{args.max_new_tokens} new tokens; speedup = tokens/s over plain decoding in the same run")
    print("| category | plain tok/s | " + " | ".join(f"k {n}" for n in names[1:]) + " |")
    print("|---|---|" + "---|" * (len(names) - 1))
    for c in cats:
        cells = [f"{rate['plain'][c]:.1f}"] + [f"{rate[n][c] / rate['plain'][c]:.2f}x" for n in names[1:]]
        print(f"| {'**overall**' if c == 'overall' else c} | " + " | ".join(cells) + " |")
    decode = {n: tokens[n]["overall"] / decode_secs[n] for n in names}
    print(f"decode only (prefill left out): plain {decode['plain']:.1f} tok/s, "
          + ", ".join(f"k {n} {decode[n] / decode['plain']:.2f}x" for n in names[1:]))
    for n in names[1:]:
        print(f"k {n}: {tokens[n]['overall'] / forwards[n]:.2f} tokens per target forward, "
              f"{mismatches[n]} of {len(ids)} outputs differ from plain")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": command, "tokens_per_s": rate, "decode_tokens_per_s": decode, "mismatches": mismatches,
                                               "tokens_per_forward": {n: tokens[n]["overall"] / forwards[n] for n in names[1:]}}, indent=2))
    print(f"\nreproduce: {command}")
    return 1 if any(mismatches.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
