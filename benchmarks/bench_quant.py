"""The quantized runtime (the GGUF's own Q4_1 / Q8_0 blocks) against today's bf16 compact runtime.

In one run, on the same chat-templated token ids and thread count:

- decode rate: greedy generation, plain and with the default drafter (prompt lookup, ``--k auto``),
  runtimes alternating prompt by prompt (A B, then B A), tokens after the first over the time
  after the first (prefill excluded), and end to end;
- T(n) / T(1), n = 1..9: one forward of n new tokens at a ``--context``-token cache, rounds
  alternating between the runtimes, medians; the verification cost T(k + 1) / T(1), k = 1..8,
  is the curve ``--k auto`` measures online (:meth:`specdraft.policy.CostAwareK.latency`);
- greedy agreement: the fraction of prompts whose outputs are identical, the mean common prefix,
  and the position-wise token agreement;
- start to first token and peak RSS: a fresh Python process per runtime (warm caches), each
  running ``api.load(..., dtype="bf16" | "q")`` (what ``specdraft generate --dtype ...`` loads:
  for ``q`` the tokenizer only) and one prefill; peak RSS is the process's VmHWM (ru_maxrss
  would carry over the parent's peak through fork and exec).

    .venv/bin/python benchmarks/bench_quant.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft.bench import harness, profile
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine
from specdraft.models import loading
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.quant import QuantRuntime
from specdraft.policy import make_policy

PROMPTS = [
    "Explain why the sky is blue in two short paragraphs.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five tips for staying focused while studying.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for a simple tomato soup.",
]

CHILD = """
import torch
from specdraft import api
pipe = api.load("smollm2-135m", "none", dtype={dtype!r}, threads={threads})
ids = torch.tensor([pipe.encode("Hello")])
rt = pipe.runtime
out = rt.forward(rt.new_state(1, 64), ids, torch.arange(ids.shape[1]).unsqueeze(0))
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0]  # this process's peak
print(int(out.logits[0, -1].argmax()), int(hwm.split()[1]) // 1024)
"""
DTYPE = {"bf16 compact": "bf16", "quantized": "q"}


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def startup(name: str, threads: int) -> tuple[float, int]:
    """Seconds from process start to the first token's logits, and peak RSS (MB)."""
    code = CHILD.format(dtype=DTYPE[name], threads=threads)
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    dt = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return dt, int(r.stdout.split()[-1])


def decode_methods(runtimes: dict, speculative: bool) -> list[harness.Method]:
    """One engine method per runtime: plain decoding, or the default drafter (prompt lookup) with
    ``--k auto``, a fresh policy per prompt (each prompt decoded as on its own)."""
    if not speculative:
        return [harness.engine_method(name, rt) for name, rt in runtimes.items()]
    return [
        harness.Method(name, lambda rt=rt: Engine(rt, PromptLookupDrafter(), make_policy("auto")))
        for name, rt in runtimes.items()
    ]


def decode_rates(
    runtimes, prompts, new_tokens: int, speculative: bool, report: dict
) -> dict[str, list[list[int]]]:
    """Greedy decoding of every prompt by each runtime, alternating (A B, then B A); prints and
    records tokens/s after the first token and end to end; returns the tokens."""
    totals = harness.run_prompts(decode_methods(runtimes, speculative), prompts, new_tokens)
    kind = "with the default drafter (prompt lookup, --k auto)" if speculative else "plain"
    print(f"\ngreedy decoding, {kind}, {len(prompts)} prompts x {new_tokens} new tokens")
    for n, t in totals.items():
        dec, e2e = t.after_first_tokens_per_s, t.tokens_per_s
        report.setdefault("decode_tokens_per_s", {})[n] = dec
        report.setdefault("end_to_end_tokens_per_s", {})[n] = e2e
        print(f"  {n:14s} decode {dec:6.1f} tok/s   end to end {e2e:6.1f} tok/s")
    q, b = report["decode_tokens_per_s"]["quantized"], report["decode_tokens_per_s"]["bf16 compact"]
    print(f"  quantized / bf16 decode: {q / b:.2f}x", flush=True)
    return {n: t.outputs for n, t in totals.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7, help="T(n) rounds per runtime")
    p.add_argument("--startup-runs", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    print(
        "command: .venv/bin/python benchmarks/bench_quant.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        flush=True,
    )
    torch.set_num_threads(args.threads)
    gguf = loading._smollm2_gguf()
    loaded = loading.load_model("smollm2-135m", torch.float32)  # converts once, if not cached
    tok = loaded.tokenizer
    runtimes = {
        "bf16 compact": LlamaRuntime(LlamaWeights.from_hf(loaded.model, torch.bfloat16)),
        "quantized": QuantRuntime(gguf),
    }
    del loaded
    print(f"threads {args.threads}; quantized runtime: {runtimes['quantized']!r}", flush=True)
    prompts = [chat_ids(tok, q) for q in PROMPTS]
    names = list(runtimes)
    harness.warm_up(decode_methods(runtimes, speculative=False), prompts[0], 8)

    report = {"threads": args.threads}
    outs = {}
    for speculative in (False, True):
        label = "prompt lookup, --k auto" if speculative else "plain"
        outs[label] = decode_rates(
            runtimes, prompts, args.new_tokens, speculative, report.setdefault(label, {})
        )
    outs = outs["plain"]

    agree = report["agreement"] = harness.agreement(outs["quantized"], outs["bf16 compact"])
    print(
        f"\ngreedy agreement quantized vs bf16: {agree['identical_outputs']}/{len(prompts)} outputs "
        f"identical, mean common prefix {agree['mean_common_prefix']:.1f} of {args.new_tokens} tokens, "
        f"position-wise {agree['positionwise']:.3f}"
    )

    print(
        f"\nT(n) / T(1) at a {args.context}-token context "
        f"(medians of {args.rounds} rounds, runtimes alternating)"
    )
    times = profile.compare_forwards(runtimes, range(1, 10), args.context, args.rounds)
    report["step_ms"] = {}
    print("  n  " + "".join(f"{n:>26s}" for n in names))
    for k in range(1, 10):
        cells = []
        for n in names:
            t, t1 = times[n][k], times[n][1]
            report["step_ms"].setdefault(n, {})[k] = t * 1e3
            cells.append(f"{t * 1e3:9.2f} ms  {t / t1:5.2f}x T1")
        print(f"  {k}  " + "".join(f"{c:>26s}" for c in cells))
    # what a verification of k drafts costs in one-token steps; --k auto measures this curve as it
    # decodes (CostAwareK.latency) on whichever runtime it runs
    cost = report["verification_cost"] = {
        n: {k: times[n][k + 1] / times[n][1] for k in range(1, 9)} for n in names
    }
    for n in names:
        print(f"  T(k + 1) / T(1), k = 1..8, {n}: " + " ".join(f"{cost[n][k]:.2f}" for k in range(1, 9)))

    print(
        f"\nstart to first token (fresh process, warm caches, api.load(dtype=bf16 | q)) and peak RSS, "
        f"{args.startup_runs} runs each"
    )
    report["startup"] = {}
    for n in names:
        runs = [startup(n, args.threads) for _ in range(args.startup_runs)]
        s, rss = min(r[0] for r in runs), max(r[1] for r in runs)
        report["startup"][n] = {"seconds_min": s, "peak_rss_mb": rss}
        print(f"  {n:14s} {s:5.2f} s (best)   peak RSS {rss} MB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
