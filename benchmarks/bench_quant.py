"""The quantized runtime (the GGUF's own Q4_1 / Q8_0 blocks) against today's bf16 compact runtime.

In one run, on the same chat-templated token ids and thread count:

- decode rate: greedy generation, plain and with the default drafter (prompt lookup, ``--k auto``),
  runtimes alternating prompt by prompt (A B, then B A), tokens after the first over the time
  after the first (prefill excluded), and end to end;
- T(n) / T(1), n = 1..9: one forward of n new tokens at a ``--context``-token cache, rounds
  alternating between the runtimes, medians; the verification cost T(k + 1) / T(1), k = 1..8,
  is the curve ``--k auto`` measures online (:meth:`specdraft.policy.CostAwareK.latency`); beside
  it, in the same rounds, a token-tree step of the same n tokens (the root and n - 1 nodes, a
  binary tree) against the chain step: what tree verification costs over a chain of n;
- greedy agreement: the fraction of prompts whose outputs are identical, the mean common prefix,
  and the position-wise token agreement;
- prefill and decode-only rates beside llama.cpp's (``--sections llamacpp``, needs ``make peers``):
  each runtime's prefill of the prompt and one-token forwards, and llama-cpp-python's low-level
  ``eval`` of the same ids on the same GGUF (prefill, then one token at a time, greedy), every
  method in turn per prompt (:mod:`specdraft.bench.llamacpp_baselines`, :class:`StepTimes`); the
  ratios quantized / llama.cpp are the issue's decode (>= 1.5x) and prefill (>= 2x) targets;
- llama.cpp's own ``llama-bench`` (``--sections llama-bench``, built by ``make llama-bench``): its
  ``pp256`` and ``tg64`` rates on the same GGUF and threads, each run between two measurements of the
  quantized runtime's prefill of 256 ids and 64 one-token forwards after them (the same shape), so
  that the ratios come from one run; llama-bench has no Python between tokens, llama-cpp-python's
  ``eval`` has;
- kernel variants and weight layouts (``--sections variants``): the quantized runtime's forward of
  n new tokens (n = 1, 2, 5, 9 and a 64-token prefill chunk) with each kernel variant this CPU runs
  (avx2, and avxvnni / avx512vnni where it has them: the same bits, the integer products by
  ``vpdpbusd``) on the x8 layout the runtime loads, and with avx2 and the fastest variant on the
  file's own blocks, rounds alternating, medians, each over avx2 on the file's blocks;
- ragged steps (``--sections ragged``): B = 1..8 rows, plain and with draft tokens in one row or
  every row (each row feeds only its own tokens), and what a draft token adds to the step;
- start to first token and peak RSS: a fresh Python process per runtime (warm caches), each
  running ``api.load(..., dtype="bf16" | "q")`` (what ``specdraft generate --dtype ...`` loads:
  for ``q`` the tokenizer only) and one prefill; peak RSS is the process's VmHWM (ru_maxrss
  would carry over the parent's peak through fork and exec).

    .venv/bin/python benchmarks/bench_quant.py --threads 2
    .venv/bin/python benchmarks/bench_quant.py --threads 2 --sections llamacpp --new-tokens 128
    .venv/bin/python benchmarks/bench_quant.py --threads 2 --sections llama-bench
    .venv/bin/python benchmarks/bench_quant.py --threads 2 --sections variants
    .venv/bin/python benchmarks/bench_quant.py --threads 2 --sections ragged
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft.bench import harness, llamacpp_baselines, profile
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine
from specdraft.models import loading, quant
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.quant import QuantRuntime, QuantWeights
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
LLAMA_BENCH = Path(__file__).resolve().parents[1] / "peers" / "build" / "bin" / "llama-bench"
SECTIONS = ("decode", "agreement", "steps", "startup", "llamacpp", "llama-bench", "variants", "ragged")
VARIANT_STEPS = (1, 2, 5, 9, 64)  # new tokens per forward in the variants section


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


def llamacpp_rates(runtimes, prompts, new_tokens: int, threads: int, report: dict) -> None:
    """Prefill and decode-only rates of each runtime and of llama.cpp (llama-cpp-python's ``eval``)
    on the same ids, every method in turn per prompt (rotated: A B C, B C A, ...); prints them and
    the quantized runtime's ratios to llama.cpp, records them in ``report``."""
    lc = llamacpp_baselines.LlamaCppBaselines(str(loading._smollm2_gguf()), threads, eos_ids=())
    lc.load(max(len(p) for p in prompts) + new_tokens + lc.lookup_tokens + 1)
    steps = {
        name: lambda ids, rt=rt: llamacpp_baselines.runtime_step_times(rt, ids, new_tokens)
        for name, rt in runtimes.items()
    }
    steps["llama.cpp"] = lambda ids: lc.step_times(ids, new_tokens)
    names = list(steps)
    for name in names:  # warm-up, untimed
        steps[name](prompts[0])
    runs = {name: [] for name in names}
    for i, ids in enumerate(prompts):
        for name in harness.interleave(names, i):
            runs[name].append(steps[name](ids))
    print(
        f"\nprefill and decode-only rates, {len(prompts)} prompts x {new_tokens} new tokens, greedy, "
        "methods in turn per prompt"
    )
    print(f"  {lc.note}")
    rates = {}
    for name in names:
        prefill = sum(r.prompt_tokens for r in runs[name]) / sum(r.prefill_s for r in runs[name])
        decode = sum(len(r.decode_s) for r in runs[name]) / sum(sum(r.decode_s) for r in runs[name])
        rates[name] = (prefill, decode)
        print(f"  {name:14s} prefill {prefill:7.1f} tok/s   decode-only {decode:6.1f} tok/s")
    (qp, qd), (lp, ld) = rates["quantized"], rates["llama.cpp"]
    print(
        f"  quantized / llama.cpp: decode-only {qd / ld:.2f}x (target >= 1.5x), "
        f"prefill {qp / lp:.2f}x (target >= 2x)"
    )
    agree = harness.agreement([r.tokens for r in runs["quantized"]], [r.tokens for r in runs["llama.cpp"]])
    print(
        f"  greedy outputs identical to llama.cpp's: {agree['identical_outputs']}/{len(prompts)}, "
        f"position-wise {agree['positionwise']:.3f}"
    )
    report.update(
        {
            "llamacpp_note": lc.note,
            "prompt_tokens": [len(p) for p in prompts],
            "prefill_tokens_per_s": {n: r[0] for n, r in rates.items()},
            "decode_only_tokens_per_s": {n: r[1] for n, r in rates.items()},
            "quantized_decode_only_vs_llamacpp": qd / ld,
            "quantized_prefill_vs_llamacpp": qp / lp,
            "agreement_quantized_vs_llamacpp": agree,
        }
    )


def llama_bench_rates(runtime, prompt: list[int], args, report: dict) -> None:
    """llama-bench's pp256 / tg64 against the quantized runtime's prefill of 256 ids and 64
    one-token forwards after them, alternating (ours, llama-bench, ours, ...); medians."""
    ids = (prompt * (256 // len(prompt) + 1))[:256]
    cmd = [str(args.llama_bench), "-m", str(loading._smollm2_gguf()), "-t", str(args.threads)]
    cmd += ["-p", "256", "-n", "64", "-r", "3", "-o", "json"]
    ours, theirs = [], []
    for _ in range(args.rounds):
        r = llamacpp_baselines.runtime_step_times(runtime, ids, 64)
        ours.append((256 / r.prefill_s, len(r.decode_s) / sum(r.decode_s)))
        rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        theirs.append(tuple(next(x["avg_ts"] for x in rows if x[key]) for key in ("n_prompt", "n_gen")))
    (op, od), (lp, ld) = (tuple(statistics.median(v) for v in zip(*m)) for m in (ours, theirs))
    print(
        f"\nllama-bench ({args.llama_bench}), {args.rounds} rounds alternating, medians, "
        f"{args.threads} threads"
    )
    print(
        f"  prefill 256 ids: quantized {op:7.1f} tok/s   llama-bench pp256 {lp:7.1f} tok/s   {op / lp:.2f}x"
    )
    print(
        f"  decode 64:       quantized {od:7.1f} tok/s   llama-bench tg64  {ld:7.1f} tok/s   {od / ld:.2f}x"
    )
    report.update(
        {
            "quantized_prefill256_tokens_per_s": op,
            "quantized_decode64_tokens_per_s": od,
            "llama_bench_pp256_tokens_per_s": lp,
            "llama_bench_tg64_tokens_per_s": ld,
            "quantized_vs_llama_bench_prefill": op / lp,
            "quantized_vs_llama_bench_decode": od / ld,
        }
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7, help="T(n) rounds per runtime")
    p.add_argument("--startup-runs", type=int, default=2)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts")
    p.add_argument(
        "--sections",
        default=",".join(s for s in SECTIONS if s not in ("llamacpp", "llama-bench")),
        help=f"comma-separated, of {', '.join(SECTIONS)} (llamacpp needs make peers)",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--llama-bench", type=Path, default=LLAMA_BENCH, help="llama-bench binary (make llama-bench)"
    )
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        p.error(f"--sections: unknown {', '.join(sorted(sections - set(SECTIONS)))}")
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
    prompts = [chat_ids(tok, q) for q in PROMPTS[: args.prompts]]
    harness.warm_up(decode_methods(runtimes, speculative=False), prompts[0], 8)

    report = {"threads": args.threads}
    if sections & {"decode", "agreement"}:
        outs = {}
        for speculative in (False, True) if "decode" in sections else (False,):
            label = "prompt lookup, --k auto" if speculative else "plain"
            outs[label] = decode_rates(
                runtimes, prompts, args.new_tokens, speculative, report.setdefault(label, {})
            )
        agreement(outs["plain"], report, args.new_tokens)
    if "steps" in sections:
        verification_cost(runtimes, args, report)
    if "variants" in sections:
        kernel_variants(gguf, args, report)
    if "ragged" in sections:
        ragged_steps(runtimes["quantized"], args, report)
    if "startup" in sections:
        startup_section(list(runtimes), args, report)
    if "llamacpp" in sections:
        llamacpp_rates(runtimes, prompts, args.new_tokens, args.threads, report.setdefault("llamacpp", {}))
        if "plain" in report:
            engine = report["plain"]["decode_tokens_per_s"]["quantized"]
            ratio = report["llamacpp"]["plain_engine_decode_vs_llamacpp_decode_only"] = (
                engine / report["llamacpp"]["decode_only_tokens_per_s"]["llama.cpp"]
            )
            print(
                f"  plain decoding through the engine (quantized, after the first token) / "
                f"llama.cpp decode-only: {ratio:.2f}x"
            )
    if "llama-bench" in sections:
        if not args.llama_bench.is_file():
            p.error(f"--llama-bench: {args.llama_bench} not found (make llama-bench builds it)")
        llama_bench_rates(runtimes["quantized"], prompts[0], args, report.setdefault("llama_bench", {}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def agreement(outs: dict, report: dict, new_tokens: int) -> None:
    agree = report["agreement"] = harness.agreement(outs["quantized"], outs["bf16 compact"])
    print(
        f"\ngreedy agreement quantized vs bf16: {agree['identical_outputs']}/{agree['prompts']} outputs "
        f"identical, mean common prefix {agree['mean_common_prefix']:.1f} of {new_tokens} tokens, "
        f"position-wise {agree['positionwise']:.3f}"
    )


def verification_cost(runtimes: dict, args, report: dict) -> None:
    names = list(runtimes)
    print(
        f"\nT(n) / T(1) at a {args.context}-token context "
        f"(medians of {args.rounds} rounds, runtimes alternating)"
    )
    times = profile.compare_forwards(runtimes, range(1, 10), args.context, args.rounds, trees=True)
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
    tree_steps(times, names, report)


def kernel_variants(gguf: Path, args, report: dict) -> None:
    """Each kernel variant's forward time (x8 layout, as the runtime loads it) and avx2's and the
    fastest variant's on the file's own layout, over avx2 on the file layout, in the same rounds."""
    variants = [v for v in quant.variants() if v != "ref"]
    x8, file = QuantWeights.from_gguf(gguf), QuantWeights.from_gguf(gguf, repack=False)
    runtimes = {f"{v} file": QuantRuntime(file, v) for v in dict.fromkeys(["avx2", variants[-1]])}
    runtimes |= {f"{v} x8": QuantRuntime(x8, v) for v in variants}
    print(
        f"\nkernel variants and weight layouts at a {args.context}-token context "
        f"(medians of {args.rounds} rounds, alternating); ratio: time over avx2 on the file layout"
    )
    times = profile.compare_forwards(runtimes, VARIANT_STEPS, args.context, args.rounds)
    report["variant_step_ms"] = {r: {n: times[r][n] * 1e3 for n in VARIANT_STEPS} for r in runtimes}
    print("  n  " + "".join(f"{r:>22s}" for r in runtimes))
    for n in VARIANT_STEPS:
        cells = [f"{times[r][n] * 1e3:7.2f} ms {times[r][n] / times['avx2 file'][n]:5.2f}x" for r in runtimes]
        print(f"  {n:<3d}" + "".join(f"{c:>22s}" for c in cells))


def ragged_steps(runtime, args, report: dict) -> None:
    """Ragged steps of B rows (each row feeds its own 1 + k_b tokens): plain, one row with 1 or 3
    draft tokens, every row with 1; what a draft token adds, over a plain step's time per row, is
    what --k auto's batch cut weighs (CostAwareK.slope)."""
    print(f"\nragged steps, quantized, {args.context}-token context (medians of {args.rounds} rounds)")
    report["ragged_step_ms"] = {}
    for B in (1, 2, 3, 4, 8):
        shapes = {"plain": [0] * B, "one row +1": [1] + [0] * (B - 1), "one row +3": [3] + [0] * (B - 1)}
        shapes["every row +1"] = [1] * B
        times = profile.ragged_forwards(runtime, shapes, args.context, args.rounds)
        report["ragged_step_ms"][B] = {n: t * 1e3 for n, t in times.items()}
        plain = times["plain"]
        cells = [
            f"{n} {t * 1e3:.2f} ms ({(t - plain) / max(sum(shapes[n]), 1) / (plain / B):.2f})"
            for n, t in times.items()
        ]
        print(f"  B = {B}: " + ", ".join(cells))
    print("  (in brackets: the time a draft token adds, over a plain step's time per row)")


def tree_steps(times: dict, names: list[str], report: dict) -> None:
    """A token-tree step of n tokens against the chain step of n, timed in the same rounds."""
    print("\n  token-tree step of n tokens (root + n - 1 nodes, binary) vs the chain step of n")
    print("  n  " + "".join(f"{n + ': chain, tree, ratio':>40s}" for n in names))
    report["tree_step_ms"] = {n: {k: times[f"{n} tree"][k] * 1e3 for k in range(2, 10)} for n in names}
    for k in range(2, 10):
        cells = []
        for n in names:
            chain, tree = times[n][k], times[f"{n} tree"][k]
            cells.append(f"{chain * 1e3:8.2f} {tree * 1e3:8.2f} ms {tree / chain:5.2f}x")
        print(f"  {k}  " + "".join(f"{c:>40s}" for c in cells))


def startup_section(names: list[str], args, report: dict) -> None:
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


if __name__ == "__main__":
    raise SystemExit(main())
