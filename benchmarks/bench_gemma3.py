"""Gemma-3-270M on the compact runtime against the transformers adapter (issue 20).

In one run, on the same chat-templated token ids and thread count:

- greedy agreement: the first ``--new-tokens`` greedy tokens of each prompt from the compact
  runtime (bf16 weights, fp32 arithmetic through the native kernels) and from the transformers
  adapter (fp32): prompts with identical outputs, mean common prefix, position-wise agreement;
- decode rate: plain greedy decoding by both runtimes, and the compact runtime with prompt lookup
  (``--k auto``), methods rotating prompt by prompt; tokens after the first over the time after the
  first (prefill excluded), and end to end; the lookup run's output is checked equal to plain;
- T(n) / T(1), n = 1..5: one forward of n new tokens at a ``--context``-token cache, medians;
- load time and peak RSS: a fresh Python process per runtime (warm conversion cache) running
  ``api.load("gemma3-270m", "none", runtime=...)`` (what ``specdraft generate`` loads) and one
  prefill; peak RSS is the process's VmHWM. The compact runtime is loaded twice: from the weight
  files alone (the default, issue 20) and with the transformers model kept (``needs=("hf",)``, as
  a run with ``--baselines hf`` loads it, and as every load did before).

    .venv/bin/python benchmarks/bench_gemma3.py --threads 2
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

from specdraft import api
from specdraft.bench import harness, profile
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.models import loading
from specdraft.models.gemma3 import Gemma3Runtime, Gemma3Weights
from specdraft.models.hf import HFRuntime
from specdraft.policy import make_policy

TARGET = "gemma3-270m"
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five tips for staying focused while studying.",
    "Explain why the sky is blue in two short paragraphs.",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for a simple tomato soup.",
]

CHILD = """
import time, torch
t = time.perf_counter()
from specdraft import api
pipe = api.load({target!r}, "none", runtime={runtime!r}, threads={threads}, needs={needs!r})
ids = torch.tensor([pipe.encode("Hello")])
rt = pipe.runtime
out = rt.forward(rt.new_state(1, 64), ids, torch.arange(ids.shape[1]).unsqueeze(0))
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0]  # this process's peak
seconds = time.perf_counter() - t
print(type(rt).__name__, int(out.logits[0, -1].argmax()), seconds, int(hwm.split()[1]) // 1024)
"""


def startup(runtime: str, threads: int, needs: tuple[str, ...] = ()) -> tuple[str, float, int]:
    """The runtime's class, seconds from import to the first token's logits, peak RSS (MB)."""
    code = CHILD.format(target=TARGET, runtime=runtime, threads=threads, needs=needs)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parents[1],
    )
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    name, _, seconds, rss = r.stdout.split()[-4:]
    return name, float(seconds), int(rss)


def decode(methods, prompts, new_tokens: int, report: dict) -> dict[str, list[list[int]]]:
    """Greedy decoding of every prompt by every method, rotating; prints and records the rates."""
    totals = harness.run_prompts(methods, prompts, new_tokens)
    print(f"\ngreedy decoding, {len(prompts)} prompts x {new_tokens} new tokens")
    for n, t in totals.items():
        dec, e2e = t.after_first_tokens_per_s, t.tokens_per_s
        report.setdefault("decode_tokens_per_s", {})[n] = dec
        report.setdefault("end_to_end_tokens_per_s", {})[n] = e2e
        print(f"  {n:22s} decode {dec:6.2f} tok/s   end to end {e2e:6.2f} tok/s")
    rates = report["decode_tokens_per_s"]
    print(f"  compact / hf decode (plain): {rates['compact'] / rates['hf']:.2f}x", flush=True)
    return {n: t.outputs for n, t in totals.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5, help="T(n) rounds per runtime")
    p.add_argument("--startup-runs", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    print(
        "command: .venv/bin/python benchmarks/bench_gemma3.py "
        + " ".join(sys.argv[1:] if argv is None else argv)
    )
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    loaded = loading.load_model(TARGET, torch.float32)  # converts once, if not cached
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    compact = Gemma3Runtime(Gemma3Weights.from_hf(loaded.model, torch.bfloat16))
    runtimes = {"compact": compact, "hf": HFRuntime(loaded.model)}
    print(
        f"threads {args.threads}; {loaded.source}; loaded in {load_s:.1f} s, compact weights in "
        f"{time.perf_counter() - t:.1f} s; {compact!r}",
        flush=True,
    )
    eos = loaded.eos_ids()
    encode = api.Pipeline(loaded, compact, None, "none").encode  # the chat template where there is one
    prompts = [encode(q) for q in PROMPTS[: args.prompts]]
    methods = [harness.engine_method(n, rt, eos_ids=eos) for n, rt in runtimes.items()]
    methods.append(
        harness.Method("compact + lookup k=auto", lambda rt=compact: _lookup_engine(rt), eos_ids=eos)
    )
    harness.warm_up(methods, prompts[0], 4)

    report: dict = {"threads": args.threads, "load_seconds": load_s}
    outs = decode(methods, prompts, args.new_tokens, report)
    agree = report["agreement"] = harness.agreement(outs["compact"], outs["hf"])
    lossless_ok = report["lookup_equals_plain"] = outs["compact + lookup k=auto"] == outs["compact"]
    print(
        f"\ngreedy agreement compact vs hf: {agree['identical_outputs']}/{agree['prompts']} identical, "
        f"mean common prefix {agree['mean_common_prefix']:.1f} of {args.new_tokens}, "
        f"position-wise {agree['positionwise']:.3f}; compact + lookup equals compact plain: {lossless_ok}"
    )

    print(f"\nT(n) / T(1) at a {args.context}-token context, medians of {args.rounds} rounds, alternating")
    times = profile.compare_forwards(runtimes, range(1, 6), args.context, args.rounds)
    report["step_ms"] = {n: {k: s * 1e3 for k, s in ts.items()} for n, ts in times.items()}
    for k in range(1, 6):
        cells = "".join(
            f"  {n} {times[n][k] * 1e3:8.1f} ms {times[n][k] / times[n][1]:5.2f}x" for n in runtimes
        )
        print(f"  n={k}{cells}")

    del runtimes, methods, compact, loaded
    print(
        f"\nload to first token (fresh process, warm cache, api.load(runtime=...)) and peak RSS, "
        f"{args.startup_runs} run(s) each"
    )
    report["startup"] = {}
    loads = {"compact": ("compact", ()), "compact + hf model": ("compact", ("hf",)), "hf": ("hf", ())}
    for name, (kind, needs) in loads.items():
        runs = [startup(kind, args.threads, needs) for _ in range(args.startup_runs)]
        s, rss = min(r[1] for r in runs), max(r[2] for r in runs)
        report["startup"][name] = {"runtime": runs[0][0], "seconds_min": s, "peak_rss_mb": rss}
        print(f"  {name:18s} {runs[0][0]:14s} {s:6.1f} s (best)   peak RSS {rss} MB", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _lookup_engine(runtime):
    from specdraft.engine import Engine

    return Engine(runtime, PromptLookupDrafter(), make_policy("auto"))


if __name__ == "__main__":
    raise SystemExit(main())
