"""Per-row vs batch-wide ``--k auto`` under a collapse attack on half a batch (issue 17), in counts.

A batch of ``--batch`` Spec-Bench first turns decoded together, greedy, the rows of ``--attacked``
of them spoiled by :class:`specdraft.drafters.adversarial.WrongRows` (their drafts shifted by one
token: rejected), three ways: plain decoding, the cost-aware policy watching each row (the
default) and the same policy for the whole batch (``CostAwareK(watch=None)``, before issue 17).
Counts, not times: target forwards, tokens fed to the target (rows x (k + 1) per forward), the
attacked rows' steps that verified drafts, the clean rows' output tokens per forward they took
part in, and the rows flagged as collapsed. Every output is checked against plain decoding.

    .venv/bin/python benchmarks/bench_collapse.py --batch 8 --attacked 4 --max-new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
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


def decode(
    method: harness.Method, policy: Counted | None, prompts: list[list[int]], max_new: int, attacked: set[int]
) -> dict:
    """Decode the batch to the end, counting target work (``policy``: the method's, or None for plain
    decoding); the figures and the outputs."""
    run = method.run_batch(prompts, max_new)
    drafted = [policy.drafted.get(i, 0) if policy is not None else 0 for i in run.request_ids]
    clean = [i for i in range(len(prompts)) if i not in attacked]
    return {
        "outputs": run.outputs,
        "forwards": run.stats.target_forwards,
        "tokens_fed": run.tokens_fed,
        "attacked_steps_with_drafts": sum(drafted[i] for i in attacked),
        "attacked_steps": sum(run.steps[i] for i in attacked),
        "clean_tokens_per_forward": sum(len(run.outputs[i]) for i in clean)
        / max(1, sum(run.steps[i] for i in clean)),
        "collapsed": run.collapsed,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    print("command: python benchmarks/bench_collapse.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"cpu: {profile.cpu_name()}, threads {args.threads}", flush=True)
    pipe = api.load(args.target, args.draft, threads=args.threads)
    every = load_prompts(None, None, args.batch)  # up to batch per category: spread over categories
    texts = [p.turns[0] for p in every[:: max(1, len(every) // args.batch)]][: args.batch]
    prompts = [pipe.encode(t)[-args.max_prompt_tokens :] for t in texts]
    attacked = set(range(args.batch - args.attacked, args.batch))
    V = pipe.runtime.vocab_size
    spoiled = WrongRows(pipe.drafter, [prompts[i] for i in attacked], V)
    clean_drafter = pipe.drafter

    rt, n = pipe.runtime, args.max_new_tokens
    results = {"plain": decode(harness.engine_method("plain", rt), None, prompts, n, attacked)}
    for name, watch in (("per-row", True), ("batch", False)):
        policy = Counted() if watch else Counted(watch=None)
        method = harness.engine_method(name, rt, spoiled, policy)
        results[name] = decode(method, policy, prompts, n, attacked)
        policy = Counted() if watch else Counted(watch=None)
        method = harness.engine_method(f"{name} unattacked", rt, clean_drafter, policy)
        clean = decode(method, policy, prompts, n, set())
        results[name]["unattacked_clean_tokens_per_forward"] = clean["clean_tokens_per_forward"]
    plain = results["plain"]
    print(
        f"batch {args.batch}, {args.attacked} rows attacked, {args.max_new_tokens} new tokens, {args.draft}"
    )
    print("method    forwards  tokens fed  attacked steps w/ drafts  clean tok/fwd (unattacked)  flagged")
    for name, r in results.items():
        same = "" if r["outputs"] == plain["outputs"] else "  OUTPUT DIFFERS FROM PLAIN"
        ref = r.get("unattacked_clean_tokens_per_forward")
        ref_s = f" ({ref:.2f})" if ref is not None else ""
        print(
            f"{name:9s} {r['forwards']:8d}  {r['tokens_fed']:10d}  "
            f"{r['attacked_steps_with_drafts']:6d} / {r['attacked_steps']:<6d}          "
            f"{r['clean_tokens_per_forward']:.2f}{ref_s:10s}         {r['collapsed']}{same}"
        )
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
