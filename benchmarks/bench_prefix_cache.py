"""A chat's second turn with and without the prompt prefix cache (:mod:`specdraft.prefix_cache`).

Spec-Bench's two-turn questions (the MT-Bench categories): the first turn is answered, then the
second is asked with the whole conversation as its prompt, as a chat client sends it. Two engines
over the same target and drafter decode every question in turn (the order alternating per question),
one keeping a prefix cache: its second turn finds the first turn's prompt and answer in the cache
and prefills only the new turn. Per engine: the second turn's time to first token (prefill and the
first step) and its whole decode time; both engines' outputs must be identical (the script exits 1
otherwise). Greedy, batch 1.

    .venv/bin/python benchmarks/bench_prefix_cache.py --limit 2 --max-new-tokens 128 --threads 2

Spec-Bench is evaluation-only here; nothing is tuned on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench.profile import cpu_name
from specdraft.bench.prompts import load_prompts
from specdraft.engine import Engine, Request
from specdraft.policy import make_policy
from specdraft.prefix_cache import PrefixCache


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="lookup")
    p.add_argument("--k", default="auto")
    p.add_argument("--limit", type=int, default=2, help="questions per two-turn category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def turn(engine: Engine, prompt: list[int], n: int, eos) -> tuple[list[int], float, float]:
    """Decode one turn: its tokens, seconds to the first token, seconds in all."""
    t0 = time.perf_counter()
    engine.add([Request(prompt, n, eos_ids=eos)])
    out, first = [], None
    while engine.active:
        for ev in engine.step():
            out += ev.tokens
        first = first or time.perf_counter() - t0
    return out, first, time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    print(
        "command: python benchmarks/bench_prefix_cache.py " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    pipe = api.load(args.target, args.draft, threads=args.threads)
    print(f"cpu: {cpu_name()}, threads {args.threads}, target {args.target}, draft {args.draft}, k {args.k}")
    questions = [q for q in load_prompts(None, None, None) if len(q.turns) > 1]
    by_cat: dict[str, list] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    questions = [q for qs in by_cat.values() for q in qs[: args.limit]]
    cache = PrefixCache(1 << 30)
    engines = {
        name: Engine(pipe.runtime, pipe.drafter, make_policy(args.k), prefix_cache=c)
        for name, c in (("whole", None), ("cached", cache))
    }
    warm = pipe.encode("Hello there")
    for e in engines.values():
        turn(e, warm, 8, pipe.eos_ids)
    rows, differ = {name: [] for name in engines}, 0
    for i, q in enumerate(questions):
        first = pipe.encode([{"role": "user", "content": q.turns[0]}])
        outs = {}
        for name in list(engines)[i % 2 :] + list(engines)[: i % 2]:
            e = engines[name]
            answer = turn(e, first, args.max_new_tokens, pipe.eos_ids)[0]
            chat = [
                {"role": "user", "content": q.turns[0]},
                {"role": "assistant", "content": pipe.tokenizer.decode(answer, skip_special_tokens=True)},
                {"role": "user", "content": q.turns[1]},
            ]
            second = pipe.encode(chat)
            out, ttft, total = turn(e, second, args.max_new_tokens, pipe.eos_ids)
            outs[name] = (answer, out)
            rows[name].append((len(second), ttft, total, len(out)))
        differ += outs["whole"] != outs["cached"]
        whole, cached = rows["whole"][-1], rows["cached"][-1]
        print(
            f"[{i + 1}/{len(questions)}] {q.category:11s} second turn {cached[0]} prompt tokens: time to "
            f"first token {whole[1] * 1e3:.0f} ms whole, {cached[1] * 1e3:.0f} ms cached",
            flush=True,
        )
    report(rows, cache, differ, len(questions))
    return 1 if differ else 0


def report(rows: dict, cache: PrefixCache, differ: int, n: int) -> None:
    ttft = {name: statistics.median(r[1] for r in rs) for name, rs in rows.items()}
    tps = {name: sum(r[3] for r in rs) / sum(r[2] for r in rs) for name, rs in rows.items()}
    prompt = statistics.median(r[0] for r in rows["cached"])
    print(f"\n{n} two-turn questions; second-turn prompts: median {prompt:.0f} tokens")
    print(f"prefix cache: {cache.hits} hits, {cache.reused_tokens} prompt tokens not prefilled again")
    print("second turn            whole prefill   prefix cache   ratio")
    print(
        f"time to first token    {ttft['whole'] * 1e3:10.0f} ms  {ttft['cached'] * 1e3:10.0f} ms  "
        f"{ttft['whole'] / ttft['cached']:5.2f}x"
    )
    ratio = tps["cached"] / tps["whole"]
    print(f"tokens/s (all of it)   {tps['whole']:13.1f}  {tps['cached']:13.1f}  {ratio:5.2f}x")
    print(f"outputs differing: {differ} of {n}")


if __name__ == "__main__":
    sys.exit(main())
