"""Start to first token and peak memory of ``specdraft generate``, beside llama.cpp's (issue 15).

Each figure is the median of ``--runs`` fresh processes, after one unmeasured run of each (a warm
cache: the conversion cache, the GGUF index, the built kernels, the page cache):

- ``specdraft generate``: ``specdraft generate --target T --dtype D --draft none --max-new-tokens 8
  PROMPT``, timed from the spawn to the first byte it writes to stdout (the first token's text);
  its peak RSS is the process's ``ru_maxrss`` (torch included; this script imports neither torch
  nor specdraft, so no child inherits a large peak through fork).
- inside: a process doing what ``generate`` does, with its own timer: seconds from the spawn to
  the end of the imports, of ``api.load`` and to the first token.
- llama.cpp: a process that imports ``llama_cpp``, loads the same GGUF (llama-cpp-python, same
  threads) and evaluates the same chat-templated ids up to one new token, timed and measured the same
  way (needs ``make peers``; skipped without it).

    .venv/bin/python benchmarks/bench_start.py --threads 2 --runs 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "What is speculative decoding?"

INSIDE = r"""
import json, sys, time
t0 = float(sys.argv[1])
marks = {}
from specdraft import api
marks["imports"] = time.time() - t0
pipe = api.load(sys.argv[2], "none", dtype=sys.argv[3], threads=int(sys.argv[4]))
marks["load"] = time.time() - t0
for delta in pipe.stream(sys.argv[5], max_new_tokens=1):
    pass
marks["first token"] = time.time() - t0
print(json.dumps(marks))
"""

LLAMACPP = r"""
import sys
from llama_cpp import Llama
threads = int(sys.argv[2])
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
ids = [int(t) for t in sys.argv[3].split(",")]
for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
    print(token, flush=True)
    break
"""


def measure(argv: list[str]) -> tuple[float, float, str]:
    """Seconds from spawning ``argv`` to its first stdout byte, its peak RSS in MB, and its stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - t0
    out = first + proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{argv[:4]}... failed ({proc.returncode}): {err.decode()[-500:]}")
    return ttft, usage.ru_maxrss / 1024, out.decode()


def medians(argv: list[str], runs: int) -> tuple[float, float, str]:
    measure(argv)  # warm: not counted
    results = [measure(argv) for _ in range(runs)]
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results), results[-1][2]


def inside(args) -> dict[str, float]:
    """Median per mark of the inside timer over ``args.runs`` processes."""
    runs = []
    for _ in range(args.runs + 1):
        argv = [
            sys.executable,
            "-c",
            INSIDE,
            repr(time.time()),
            args.target,
            args.dtype,
            str(args.threads),
            PROMPT,
        ]
        runs.append(json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout))
    return {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}


IDS = r"""
import sys
from specdraft.api import Pipeline
from specdraft.models.loading import load_tokenizer
from specdraft.models.quant import gguf_path
ids = Pipeline(load_tokenizer(sys.argv[1]), None, None).encode(sys.argv[2])
print(gguf_path(sys.argv[1]), ",".join(map(str, ids)))
"""


def llamacpp_argv(args) -> list[str] | None:
    """The llama.cpp process's argv (same GGUF, same chat-templated ids), or None without llama_cpp.

    The ids come from a child process: this one stays small, so that no child's peak RSS can
    carry this process's over through fork."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    out = subprocess.run(
        [sys.executable, "-c", IDS, args.target, PROMPT], capture_output=True, text=True, check=True
    )
    path, ids = out.stdout.rsplit(maxsplit=1)
    return [sys.executable, "-c", LLAMACPP, path, str(args.threads), ids]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    print("command: .venv/bin/python benchmarks/bench_start.py " + " ".join(sys.argv[1:]), flush=True)
    specdraft = Path(sys.executable).with_name("specdraft")
    gen = [str(specdraft), "generate", "--target", args.target, "--dtype", args.dtype, "--draft", "none"]
    gen += ["--threads", str(args.threads), "--max-new-tokens", "8", PROMPT]
    rows = [("specdraft generate", *medians(gen, args.runs)[:2])]
    lc = llamacpp_argv(args)
    if lc is not None:
        rows.append(("llama.cpp (llama-cpp-python load + first token)", *medians(lc, args.runs)[:2]))
    print(f"\n{args.target}, --dtype {args.dtype}, {args.threads} threads, median of {args.runs} processes")
    print("| process | start to first token s | peak RSS MB |\n|---|---|---|")
    for name, ttft, rss in rows:
        print(f"| {name} | {ttft:.2f} | {rss:.0f} |")
    if lc is None:
        print("llama.cpp: llama-cpp-python not installed (make peers)")
    marks = inside(args)
    print("inside specdraft (s from spawn): " + ", ".join(f"{k} {v:.2f}" for k, v in marks.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
