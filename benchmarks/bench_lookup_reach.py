"""How far decoys in the prompt could lower prompt lookup's acceptance (issue 17's discrete lookup attack).

For each prompt: the target's greedy answer (plain decoding on the engine), then greedy prompt lookup with a
fixed ``--k`` replayed over it (:func:`specdraft.attack.lookup.out_of_reach`): its steps, its accepted draft
tokens, and those copied from a match inside the answer at the longest n-gram lookup tries, which no decoy
in the prompt can take over while the answer stays the same. The least mean accepted length decoys could
leave (every other accepted token rejected, :func:`~specdraft.attack.lookup.least_accepted_length`) bounds
the attack from below on that answer; the issue asks for >= 30% lower with ROUGE-L >= 0.5.

    .venv/bin/python benchmarks/bench_lookup_reach.py --prompts results/attack-2026-12-04/prompts20.jsonl \\
        --limit 20 --max-new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.attack.lookup import least_accepted_length, out_of_reach
from specdraft.bench.prompts import fit_context, load_prompts
from specdraft.engine import Engine, Request, decode_requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default=None, help="Spec-Bench-format JSONL (default: the Spec-Bench suite)")
    ap.add_argument("--limit", type=int, default=None, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5, help="the fixed draft length replayed (the attack's: 5)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    pipe = api.load(args.target, "lookup", threads=args.threads)
    prompts = load_prompts(args.prompts, None, args.limit)
    engine = Engine(pipe.runtime)
    rows = []
    print(
        "| category | steps | accepted | out of reach | mean accepted length | least after decoys | lowered |"
    )
    print("|---|---|---|---|---|---|---|")
    for p in prompts:
        ids = fit_context(pipe.encode(p.turns[0]), 1024).ids
        (y,) = decode_requests(engine, [Request(list(ids), args.max_new_tokens, eos_ids=pipe.eos_ids)])
        steps, accepted, fixed = out_of_reach(pipe.drafter, ids, y, args.k)
        mean, least = (steps + accepted) / steps, least_accepted_length(steps, accepted, fixed)
        row = {"category": p.category, "steps": steps, "accepted": accepted, "fixed": fixed}
        rows.append({**row, "mean": mean, "least": least, "lowered": 1 - least / mean})
        cells = [p.category, steps, accepted, fixed, f"{mean:.2f}", f"{least:.2f}", f"{1 - least / mean:.0%}"]
        print("| " + " | ".join(map(str, cells)) + " |")
    reach = sum(r["lowered"] >= 0.30 for r in rows)
    means = [sum(r[key] for r in rows) / len(rows) for key in ("mean", "least")]
    print(
        f"\n{len(rows)} prompts, k = {args.k}: on the same answers, decoys could lower the mean accepted "
        f"length by >= 30% on at most {reach} of {len(rows)}; over the prompts from {means[0]:.2f} to "
        f"{means[1]:.2f} at most ({1 - means[1] / means[0]:.0%}); accepted tokens out of reach "
        f"{sum(r['fixed'] for r in rows)} of {sum(r['accepted'] for r in rows)}"
    )
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "k": args.k, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
