"""Serving benchmark: N concurrent streaming clients against ``specdraft serve``, speculation on vs off.

One server process runs the whole benchmark. Each round sends the same requests (first turns of
Spec-Bench questions, greedy, chat endpoint) from ``--clients`` concurrent clients, each client
sending its share one after another (closed loop). Rounds alternate between the server's speculation
policy ("spec": no per-request setting) and ``"speculation": "off"`` in A B B A order, so both modes
see the same machine drift. Because decoding is greedy and speculation is lossless, both modes must
produce the same texts; the script checks that.

Reported per mode: aggregate output tokens/s (all completion tokens of a round / the round's wall
time), time to first token (send -> first content chunk), inter-token latency (gap between
consecutive content chunks, as vLLM's benchmark counts it: a speculative step that delivers several
tokens at once is one gap) and time per output token ((e2e - TTFT) / (tokens - 1)), p50 and p99
over all requests of all rounds of that mode. Acceptance comes from the server's /metrics.

    python benchmarks/bench_server.py --target smollm2-135m --draft lookup --k auto --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specdraft.bench.prompts import load_prompts, parse_categories  # noqa: E402


@dataclass
class RequestResult:
    text: str
    tokens: int
    ttft: float
    e2e: float
    gaps: list[float] = field(default_factory=list)


@dataclass
class Round:
    mode: str
    wall: float
    results: list[RequestResult]
    spec: dict[str, float]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall


# ------------------------------------------------------------------------------------ the server
def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    log = Path(tempfile.mkstemp(prefix="bench_server_", suffix=".log")[1])
    cmd = [
        sys.executable, "-m", "specdraft.cli", "serve", "--host", "127.0.0.1", "--port", "0",
        "--target", args.target, "--draft", args.draft, "--k", args.k, "--dtype", args.dtype,
        "--threads", str(args.threads), "--max-batch", str(args.clients), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()}")
        m = re.search(r"listening on (http://\S+?) ", log.read_text())
        if m:
            try:
                if httpx.get(f"{m.group(1)}/health", timeout=2).status_code == 200:
                    return proc, m.group(1), log
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server not ready after {args.start_timeout} s:\n{log.read_text()}")


def spec_counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in (
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
            "engine_steps",
        ):
            if line.startswith(f"specdraft:{name}_total "):
                out[name] = float(line.split()[-1])
    return out


# ------------------------------------------------------------------------------------ the clients
async def one_request(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, mode: str
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if mode == "off":
        body["speculation"] = "off"
    t0 = time.perf_counter()
    first = last = None
    parts, gaps, tokens = [], [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if content:
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                parts.append(content)
    end = time.perf_counter()
    return RequestResult("".join(parts), tokens, (first or end) - t0, end - t0, gaps)


async def run_round(
    url: str, model: str, prompts: list[str], clients: int, max_tokens: int, mode: str
) -> Round:
    before = spec_counters(url)
    shares = [prompts[i::clients] for i in range(clients)]
    results: dict[int, RequestResult] = {}

    async def client_loop(c: int, http: httpx.AsyncClient):
        for j, prompt in enumerate(shares[c]):
            results[c + j * clients] = await one_request(http, model, prompt, max_tokens, mode)

    limits = httpx.Limits(max_connections=clients * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c, http) for c in range(clients)))
        wall = time.perf_counter() - t0
    after = spec_counters(url)
    spec = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return Round(mode, wall, [results[i] for i in range(len(prompts))], spec)


# ------------------------------------------------------------------------------------ reporting
def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def summarize(rounds: list[Round], mode: str) -> dict:
    mine = [r for r in rounds if r.mode == mode]
    reqs = [x for r in mine for x in r.results]
    gaps = [g for x in reqs for g in x.gaps]
    tpot = [(x.e2e - x.ttft) / (x.tokens - 1) for x in reqs if x.tokens > 1]
    spec = {k: sum(r.spec.get(k, 0.0) for r in mine) for k in mine[0].spec}
    drafts = spec.get("spec_decode_num_drafts", 0.0)
    return {
        "tokens_per_s_median": statistics.median(r.tokens_per_s for r in mine),
        "tokens_per_s_rounds": [round(r.tokens_per_s, 2) for r in mine],
        "ttft_p50_ms": 1e3 * pct([x.ttft for x in reqs], 50),
        "ttft_p99_ms": 1e3 * pct([x.ttft for x in reqs], 99),
        "itl_p50_ms": 1e3 * pct(gaps, 50),
        "itl_p99_ms": 1e3 * pct(gaps, 99),
        "tpot_p50_ms": 1e3 * pct(tpot, 50),
        "drafts": drafts,
        "mean_accepted_length": 1 + spec.get("spec_decode_num_accepted_tokens", 0.0) / drafts
        if drafts
        else 1.0,
        "acceptance_rate": spec.get("spec_decode_num_accepted_tokens", 0.0)
        / spec["spec_decode_num_draft_tokens"]
        if spec.get("spec_decode_num_draft_tokens")
        else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="lookup")
    p.add_argument("--k", default="auto", help="the server's draft-length policy for the 'spec' rounds")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="server torch threads")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests per round (split across clients)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=2, help="(spec, off) round pairs, run A B B A ...")
    p.add_argument("--categories", default=None, help="Spec-Bench categories (default: all)")
    p.add_argument(
        "--max-prompt-chars", type=int, default=400, help="skip longer prompts (CPU prefill would dominate)"
    )
    p.add_argument("--url", default=None, help="use a running server instead of starting one")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    questions = [
        q.turns[0]
        for q in load_prompts(categories=parse_categories(args.categories))
        if len(q.turns[0]) <= args.max_prompt_chars
    ]
    # round-robin over categories so a small request count still mixes kinds of prompts
    prompts = questions[:: max(len(questions) // args.requests, 1)][: args.requests]
    proc, log = None, None
    if args.url:
        url = args.url
    else:
        proc, url, log = start_server(args)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(run_round(url, model, prompts[: args.clients], args.clients, 8, "spec"))  # warm-up
        asyncio.run(run_round(url, model, prompts[: args.clients], args.clients, 8, "off"))
        rounds = []
        for i in range(args.pairs):
            for mode in ("spec", "off") if i % 2 == 0 else ("off", "spec"):
                r = asyncio.run(run_round(url, model, prompts, args.clients, args.max_tokens, mode))
                rounds.append(r)
                print(
                    f"round {len(rounds)}: {mode:4s} {r.tokens} tokens in {r.wall:.1f} s = "
                    f"{r.tokens_per_s:.1f} tok/s",
                    flush=True,
                )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
            if rc != 0:
                print(f"warning: server exited with {rc}; log: {log}", file=sys.stderr)

    spec, off = summarize(rounds, "spec"), summarize(rounds, "off")
    pairs = list(zip([r for r in rounds if r.mode == "spec"], [r for r in rounds if r.mode == "off"]))
    ratios = [a.tokens_per_s / b.tokens_per_s for a, b in pairs]
    same = sum(a.text == b.text for s, o in pairs for a, b in zip(s.results, o.results))
    total = sum(len(s.results) for s, _ in pairs)
    print()
    print(
        f"server: {args.target}, draft {args.draft}, k {args.k}, threads {args.threads}; {args.clients} "
        f"concurrent clients, {len(prompts)} requests/round, max_tokens {args.max_tokens}, greedy"
    )
    print(
        "(shared, slow CPU: absolute figures drift between runs; the ratio from interleaved rounds is "
        "the figure to compare)"
    )
    print(f"{'':18s}{'spec':>12s}{'off':>12s}")
    for key, label in (
        ("tokens_per_s_median", "tok/s (median)"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("itl_p50_ms", "ITL p50 ms"),
        ("itl_p99_ms", "ITL p99 ms"),
        ("tpot_p50_ms", "TPOT p50 ms"),
    ):
        print(f"{label:18s}{spec[key]:12.1f}{off[key]:12.1f}")
    print(
        f"spec/off tok/s per pair: {', '.join(f'{x:.3f}' for x in ratios)}; median "
        f"{statistics.median(ratios):.3f}"
    )
    print(
        f"spec rounds: {spec['drafts']:.0f} row-steps drafted, mean accepted length "
        f"{spec['mean_accepted_length']:.2f} (bonus included), acceptance {spec['acceptance_rate']:.1%}"
    )
    print(f"identical outputs spec vs off: {same}/{total}")
    print(
        "reproduce: python "
        + " ".join(
            shlex.quote(a)
            for a in [str(Path(__file__).relative_to(REPO))] + (argv if argv is not None else sys.argv[1:])
        )
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "spec": spec, "off": off, "ratios": ratios, "identical": [same, total]},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
