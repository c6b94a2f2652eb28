"""The collapse defense under attack on half a batch (issue 17): counts and throughput.

A batch of ``--batch`` Spec-Bench first turns decoded together, greedy, the rows of ``--attacked``
of them spoiled by :class:`specdraft.drafters.adversarial.WrongRows` (their drafts shifted by one
token: rejected), by plain decoding and by the cost-aware policy in three settings: ``defended``
(the default: each row watched, :class:`specdraft.policy.RowWatch`, and the safe arm,
:class:`specdraft.policy.SafeArm`), ``watch-only`` (no safe arm) and ``undefended`` (one k for the
batch, unchecked: before issue 17). Each setting also decodes the batch unattacked (its own
policy), the reference for the clean rows. ``--rounds`` rounds, methods in a rotating order, one
policy per method for the whole run (as a server keeps one); times are medians over the rounds.

Counts (first round: a cold policy, the defense's worst case): target forwards, tokens fed to the
target, the attacked rows' steps that verified drafts, the clean rows' output tokens per forward,
the rows flagged as collapsed. Throughput, decode only (prefill left out): all rows' tokens/s
against plain decoding's (the issue's target under attack: >= 0.95x), and the clean rows' tokens/s
attacked against unattacked (>= 0.9x). Every output is checked against plain decoding.

    .venv/bin/python benchmarks/bench_collapse.py --batch 8 --attacked 4 --max-new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench import harness, profile
from specdraft.bench.prompts import load_prompts
from specdraft.drafters.adversarial import WrongRows
from specdraft.policy import CostAwareK


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="lookup")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--attacked", type=int, default=4, help="rows spoiled (the last ones of the batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="prompts cut to their last tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="runs of every method (median time)")
    return p.parse_args(argv)


class Counted(CostAwareK):
    """The cost-aware policy, counting per request the steps that verified drafts for it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.drafted: dict[int, int] = {}

    def trim(self, num_valid, bucket, rows=None):
        out = super().trim(num_valid, bucket, rows)
        for r, n in zip(rows, out.tolist()):
            self.drafted[r] = self.drafted.get(r, 0) + (n > 0)
        return out


# name -> CostAwareK settings
VARIANTS = {
    "defended": {},  # the default: per-row watch and safe arm
    "watch-only": {"guard": None},
    "undefended": {"watch": None, "guard": None},  # one k for the batch, unchecked (before issue 17)
}


def decode(
    method: harness.Method, policy: Counted | None, prompts: list[list[int]], max_new: int, attacked: set[int]
) -> dict:
    """Decode the batch to the end, counting target work (``policy``: the method's, or None for plain
    decoding); the figures and the outputs."""
    if policy is not None:
        policy.drafted = {}  # this run's (request ids restart with each engine)
    run = method.run_batch(prompts, max_new)
    drafted = [policy.drafted.get(i, 0) if policy is not None else 0 for i in run.request_ids]
    clean = [i for i in range(len(prompts)) if i not in attacked]
    return {
        "outputs": run.outputs,
        "seconds": run.seconds - run.stats.prefill_time,  # decode only
        "tokens": sum(len(o) for o in run.outputs),
        "clean_tokens": sum(len(run.outputs[i]) for i in clean),
        "forwards": run.stats.target_forwards,
        "tokens_fed": run.tokens_fed,
        "attacked_steps_with_drafts": sum(drafted[i] for i in attacked),
        "attacked_steps": sum(run.steps[i] for i in attacked),
        "clean_tokens_per_forward": sum(len(run.outputs[i]) for i in clean)
        / max(1, sum(run.steps[i] for i in clean)),
        "collapsed": run.collapsed,
    }


def measure(methods: list, prompts: list[list[int]], max_new: int, attacked: set[int], rounds: int) -> dict:
    """``methods``: (name, harness method, policy or None); ``attacked``: the rows spoiled in the
    attacked runs, counted apart from the clean ones in every run. Each run ``rounds`` times
    in rotating order: by name, the first round's figures with ``seconds`` the median over rounds."""
    results: dict[str, dict] = {}
    seconds: dict[str, list[float]] = {m[0]: [] for m in methods}
    for r in range(rounds):
        for name, method, policy in harness.interleave(methods, r):
            res = decode(method, policy, prompts, max_new, attacked)
            results.setdefault(name, res)
            seconds[name].append(res["seconds"])
    for name, res in results.items():
        res["seconds"] = statistics.median(seconds[name])
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    print("command: python benchmarks/bench_collapse.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"cpu: {profile.cpu_name()}, threads {args.threads}", flush=True)
    pipe = api.load(args.target, args.draft, threads=args.threads)
    every = load_prompts(None, None, args.batch)  # up to batch per category: spread over categories
    texts = [p.turns[0] for p in every[:: max(1, len(every) // args.batch)]][: args.batch]
    prompts = [pipe.encode(t)[-args.max_prompt_tokens :] for t in texts]
    attacked = set(range(args.batch - args.attacked, args.batch))
    spoiled = WrongRows(pipe.drafter, [prompts[i] for i in attacked], pipe.runtime.vocab_size)

    rt, n = pipe.runtime, args.max_new_tokens
    methods = [("plain", harness.engine_method("plain", rt), None)]
    for name, settings in VARIANTS.items():
        # the unattacked reference counts the same rows as clean (those it decodes with a sound draft too)
        for suffix, drafter in (("", spoiled), (" unattacked", pipe.drafter)):
            policy = Counted(**settings)
            methods.append((name + suffix, harness.engine_method(name, rt, drafter, policy), policy))
    harness.warm_up([m[1] for m in methods], prompts[0][:64], 16)
    results = measure(methods, prompts, n, attacked, args.rounds)
    report(args, results)
    return 0 if all(r["outputs"] == results["plain"]["outputs"] for r in results.values()) else 1


def rate(r: dict, key: str = "tokens") -> float:
    """Tokens (``key``: all rows' or the clean rows') per decode second."""
    return r[key] / r["seconds"]


def report(args, results: dict) -> None:
    plain = results["plain"]
    print(
        f"batch {args.batch}, {args.attacked} rows attacked, {args.max_new_tokens} new tokens, {args.draft}, "
        f"{args.rounds} rounds (median decode seconds)"
    )
    print(
        "method      forwards  tokens fed  attacked steps w/ drafts  clean tok/fwd (unattacked)  flagged  "
        "tok/s vs plain  clean rows vs unattacked"
    )
    for name, r in results.items():
        if name.endswith(" unattacked"):
            continue
        same = "" if r["outputs"] == plain["outputs"] else "  OUTPUT DIFFERS FROM PLAIN"
        ref = results.get(f"{name} unattacked")
        ref_s = f" ({ref['clean_tokens_per_forward']:.2f})" if ref is not None else ""
        # no clean row (every row attacked): nothing to compare
        clean = (
            f"{rate(r, 'clean_tokens') / rate(ref, 'clean_tokens'):.2f}x"
            if ref and ref["clean_tokens"]
            else ""
        )
        print(
            f"{name:11s} {r['forwards']:8d}  {r['tokens_fed']:10d}  "
            f"{r['attacked_steps_with_drafts']:6d} / {r['attacked_steps']:<6d}          "
            f"{r['clean_tokens_per_forward']:.2f}{ref_s:10s}         {r['collapsed']!s:8s} "
            f"{rate(r) / rate(plain):.2f}x           {clean}{same}"
        )
    unattacked = [f"{n} {rate(results[n + ' unattacked']) / rate(plain):.2f}x" for n in VARIANTS]
    print("unattacked, tok/s vs plain: " + ", ".join(unattacked))


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
