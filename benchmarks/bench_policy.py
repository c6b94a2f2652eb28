"""Draft-length policies against each other and against plain decoding, in one process.

One drafter (prompt lookup by default), several policies (``--policies auto,2,4,heuristic``: the
cost-aware policy, fixed k, transformers' heuristic; ``auto-batch`` without its per-row watch,
``auto-padded`` on the runtime without ragged steps, ``auto-off3`` with the row watch before 1d59d9d
(a row off after any three rejections in a row), ``auto-window`` with the safe arm's verdict before
its CUSUM (a decayed ratio judged at every step), ``auto-blind`` without the first-token outcomes a
feature draft reads back in hindsight, ``auto-before`` without them and with the safe arm judging
probes too, ``auto-unguarded`` without its safe arm, the
check of realised speed against plain decoding: ``auto`` against it is that check's cost or gain,
``auto-undefended`` without both, issue 17's undefended engine: ``auto`` against it on clean prompts is
the defense's cost),
Spec-Bench first turns, greedy, batch 1 (or ``--batch N``: the prompts decoded N rows at a time,
overall figures only).
After an untimed warm-up of every method, each prompt runs every method once in a rotating order
(A B C, then B C A, ...: :mod:`specdraft.bench.harness`), so slow phases of a shared machine hit
all methods alike. Each method
keeps one policy for the whole run (as ``specdraft bench`` and the server do). tokens/s is
total new tokens / total wall time (prefill included); every speculative output is checked
against plain decoding token for token (:func:`specdraft.bench.harness.equality` classifies a
difference). Prints overall and per-category speedups over plain, and
the overall speedup of the decode phase alone (prefill, the same work for every method, left out).

    .venv/bin/python benchmarks/bench_policy.py --limit 4 --max-new-tokens 64 --threads 2

Spec-Bench is evaluation-only here; nothing is tuned on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench import harness
from specdraft.bench.prompts import fit_context, load_prompts, parse_categories
from specdraft.policy import CostAwareK, RealisedRate, RowWatch, SafeArm, make_policy


class Padded:
    """A runtime seen without ragged steps (its forward takes no ``lengths``): every row of a chain
    step is padded to the longest row's tokens, as before ragged verification (issue 17)."""

    def __init__(self, runtime):
        self.runtime = runtime

    def forward(
        self, state, tokens, positions, *, hidden_layers=(), attn_mask=None, logits_index=None, slots=None
    ):
        kw = {"attn_mask": attn_mask, "logits_index": logits_index, "slots": slots}
        return self.runtime.forward(state, tokens, positions, hidden_layers=hidden_layers, **kw)

    def __getattr__(self, name):  # vocab_size, new_state, precision, ...
        return getattr(self.runtime, name)


class WindowVerdict(RealisedRate):
    """The safe arm's verdict before its CUSUM: once ``evidence`` speculative steps are in (or
    ``max_loss`` plain steps lost), fall back whenever the decayed realised speed is below plain's."""

    def _verdict(self, band, plain):
        if band.steps < self.arm.evidence and band.spent - band.saved <= self.arm.max_loss * plain:
            return None
        return band.saved < (1 - self.arm.margin) * band.spent


class Blind(CostAwareK):
    """The cost-aware policy before 9f84c7a: it asks no row for outcomes in hindsight."""

    def hindsight_rows(self, rows):
        return None


class CountedProbes(RealisedRate):
    """The safe arm before probes were left out of its verdict: a probe is speculation it judges."""

    def chose(self, k, probe=False):
        super().chose(k, False)


def before_policy() -> CostAwareK:
    """The cost-aware policy at the start of 2026-12-05's last session (a5819de): no hindsight, probes
    counted by the safe arm."""
    policy = Blind()
    policy.rate = CountedProbes(SafeArm())
    return policy


def window_policy() -> CostAwareK:
    policy = CostAwareK()
    policy.rate = WindowVerdict(SafeArm())
    return policy


# name -> policy factory; a name not here goes to make_policy ("auto", "heuristic", "4").
# auto-batch: the cost-aware policy without its per-row watch (one acceptance record for the batch);
# auto-padded: the cost-aware policy on the runtime without ragged steps (Padded); auto-unguarded:
# without the safe arm (SafeArm: the model's choice unchecked by the clock); auto-undefended: without
# both (issue 17's undefended engine); auto-off3: a row goes off
# after three rejected proposals in a row whatever the drafter's average (RowWatch before 1d59d9d);
# auto-window: the safe arm's verdict before its CUSUM (WindowVerdict); auto-blind: no row asked for
# the outcomes a feature draft reads back at its catch-up (Blind); auto-before: Blind with probes counted
# by the safe arm (before_policy)
POLICIES: dict = {
    "auto-before": before_policy,
    "auto-blind": Blind,
    "auto-batch": lambda: CostAwareK(watch=None),
    "auto-off3": lambda: CostAwareK(watch=RowWatch(off_max=3)),
    "auto-padded": CostAwareK,
    "auto-unguarded": lambda: CostAwareK(guard=None),
    "auto-undefended": lambda: CostAwareK(watch=None, guard=None),
    "auto-window": window_policy,
}
RUNTIMES: dict = {"auto-padded": Padded}  # name -> the runtime a method decodes with


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="lookup")
    p.add_argument("--dtype", default="auto", help="the target's precision (auto: the quantized runtime)")
    p.add_argument("--policies", default="auto,2,4,heuristic")
    p.add_argument("--limit", type=int, default=4, help="Spec-Bench questions per category")
    p.add_argument("--categories", default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are cut in the middle")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="decode the prompts in batches of N rows (N > 1: overall figures only, categories mix)",
    )
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_policy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print("command:", command, flush=True)
    pipe = api.load(args.target, args.draft, dtype=args.dtype, threads=args.threads)
    prompts = load_prompts(None, parse_categories(args.categories), args.limit)
    names = ["plain"] + [x.strip() for x in args.policies.split(",") if x.strip()]

    # one policy per method for the whole run, as `specdraft bench` and the server keep one: an
    # adaptive policy goes on learning across requests
    policies = {n: POLICIES[n]() if n in POLICIES else make_policy(n) for n in names[1:]}
    methods = [harness.engine_method("plain", pipe.runtime, None, eos_ids=pipe.eos_ids)]
    for n in names[1:]:
        runtime = RUNTIMES[n](pipe.runtime) if n in RUNTIMES else pipe.runtime
        method = harness.engine_method(n, runtime, pipe.drafter, policies[n], eos_ids=pipe.eos_ids)
        methods.append(method)
    budget = harness.prompt_budget(pipe.runtime, methods, args.max_new_tokens, args.max_prompt_tokens)
    ids = [fit_context(pipe.encode(p.turns[0]), budget).ids for p in prompts]
    tol = harness.tolerance(pipe.runtime)

    harness.warm_up(methods, ids[0][:64], 16)
    totals = {n: defaultdict(harness.Totals) for n in names}  # by category, and "overall"
    B = max(1, args.batch)
    for i in range(0, len(ids), B):
        group, cats_i = ids[i : i + B], [p.category for p in prompts[i : i + B]]
        runs = run_group(methods, group, i // B, args.max_new_tokens)
        for name, (run, outputs) in runs.items():
            classes = []
            if name != "plain":  # each row against plain decoding's, counted per prompt
                pairs = zip(group, runs["plain"][1], outputs)
                check = (args.max_new_tokens, pipe.eos_ids, tol)
                classes = [harness.equality(pipe.runtime, x, a, b, *check)[0] for x, a, b in pairs]
            for key in ([cats_i[0]] if B == 1 else []) + ["overall"]:
                totals[name][key].add(run)
                for c in classes:
                    totals[name][key].classes[c] = totals[name][key].classes.get(c, 0) + 1
        print(f"\r{i + len(group)}/{len(ids)} prompts", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    overall = {n: totals[n]["overall"] for n in names}
    mismatches = {n: overall[n].mismatches for n in names[1:]}
    forwards = {n: overall[n].stats.target_forwards for n in names}

    cats = (list(dict.fromkeys(p.category for p in prompts)) if B == 1 else []) + ["overall"]
    rate = {n: {c: totals[n][c].tokens_per_s for c in cats} for n in names}
    print(
        f"\n{args.target}, draft {args.draft}, {torch.get_num_threads()} threads, {len(ids)} Spec-Bench "
        f"first turns, batch {B}, {args.max_new_tokens} new tokens; speedup = tokens/s over plain decoding "
        "in the same run"
    )
    print("| category | plain tok/s | " + " | ".join(f"k {n}" for n in names[1:]) + " |")
    print("|---|---|" + "---|" * (len(names) - 1))
    for c in cats:
        cells = [f"{rate['plain'][c]:.1f}"] + [f"{rate[n][c] / rate['plain'][c]:.2f}x" for n in names[1:]]
        print(f"| {'**overall**' if c == 'overall' else c} | " + " | ".join(cells) + " |")
    decode = {n: overall[n].decode_tokens_per_s for n in names}
    print(
        f"decode only (prefill left out): plain {decode['plain']:.1f} tok/s, "
        + ", ".join(f"k {n} {decode[n] / decode['plain']:.2f}x" for n in names[1:])
    )
    for n in names[1:]:
        print(
            f"k {n}: {overall[n].tokens / forwards[n]:.2f} tokens per target forward, "
            f"{mismatches[n]} of {len(ids)} outputs differ from plain"
        )
        rate_check = getattr(policies[n], "rate", None)
        if rate_check is not None:  # the safe arm's record (SafeArm)
            realised = rate_check.speedup(B)  # None: no speculative step judged in B's band
            print(
                f"k {n}: safe arm: {rate_check.fallbacks} fall-backs to plain, {rate_check.forced} plain "
                f"steps imposed, realised speedup at batch {B} "
                + ("n/a (no speculative step judged)" if realised is None else f"{realised:.2f}x")
            )
    if args.json:
        per_forward = {n: overall[n].tokens / forwards[n] for n in names[1:]}
        doc = {
            "command": command,
            "tokens_per_s": rate,
            "decode_tokens_per_s": decode,
            "mismatches": mismatches,
            "tokens_per_forward": per_forward,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    print(f"\nreproduce: {command}")
    return 1 if any(mismatches.values()) else 0


def run_group(methods, group: list[list[int]], i: int, max_new: int) -> dict:
    """Every method once on a group of prompts (one batch; interleaved order by group index):
    by method name, a :class:`harness.Run` over the whole group and each row's output."""
    out = {}
    for m in harness.interleave(methods, i):
        if len(group) == 1:
            run = m.run(group[0], max_new)
            out[m.name] = (run, [run.tokens])
            continue
        b = m.run_batch(group, max_new)
        flat = [t for row in b.outputs for t in row]
        out[m.name] = (harness.Run(flat, b.seconds, b.stats, b.first_token_seconds), b.outputs)
    return {m.name: out[m.name] for m in methods}


if __name__ == "__main__":
    sys.exit(main())
