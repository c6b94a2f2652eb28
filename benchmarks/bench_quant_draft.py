r"""Draft step time on GGUF blocks (``--draft-dtype q``) against bf16, beside the quantized target.

One process, the drafts' batch-1 steps (one token at a ``--context``-token cache, then the argmax)
timed in turn round after round with the target's 1-token step
(:func:`specdraft.bench.profile.measure_latency`), medians over the rounds. Each draft is built
twice through :func:`specdraft.api.make_drafter`: at ``q`` (a ``prune:`` draft: a view of the
quantized target's own blocks; a designed draft: its matrices as Q8_0 blocks made at load) and at
``bf16`` (a ``prune:`` draft: the target's layers de-quantized to bf16 in the compact runtime; a
designed draft: bf16 weights through the native kernels). What ``--draft-dtype auto`` picks beside
a quantized target (:data:`specdraft.dtypes.AUTO_QUANT_DRAFTS`) follows from these figures.

    .venv/bin/python benchmarks/bench_quant_draft.py --threads 2 --rounds 30 \
        --drafts "designed:smollm2-135m-l2;prune:0,1,2,29,head=8192" --json runs/quant_draft.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench.profile import cpu_name, measure_latency
from specdraft.models.loading import load_model
from specdraft.models.runtime import make_runtime


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument(
        "--drafts", default="designed:smollm2-135m-l2;prune:0,1,2,29,head=8192", help="';'-separated"
    )
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def draft_runtimes(args, pipe) -> dict[str, object]:
    """``{"SPEC @ q": runtime, "SPEC @ bf16": runtime}`` for each draft spec."""
    loaded = load_model(args.target, torch.float32)  # the bf16 drafts build from the transformers model
    dense = make_runtime(loaded, "compact", torch.bfloat16)  # a bf16 prune draft's layers come from here
    out = {}
    for spec in filter(None, (s.strip() for s in args.drafts.split(";"))):
        bf16_target = dense if api.model_kind(spec) == "prune" else pipe.runtime
        out[f"{spec} @ q"] = api.make_drafter(spec, pipe.target, pipe.runtime, "q").runtime
        out[f"{spec} @ bf16"] = api.make_drafter(spec, loaded, bf16_target, torch.bfloat16).runtime
    return out


def main() -> int:
    args = parse_args()
    pipe = api.load(args.target, "none", dtype="q", threads=args.threads)
    drafts = draft_runtimes(args, pipe)
    lat = measure_latency(pipe.runtime, drafts, ns=(1,), context=args.context, reps=args.rounds)
    cmd = "python " + " ".join(sys.argv)
    print(f"target {pipe.runtime}; context {args.context}, threads {args.threads}, CPU {cpu_name()}")
    print(f"target 1-token step: {lat.target[1] * 1e3:.2f} ms (median of {args.rounds} rounds)")
    print(f"{'draft':<42} {'step ms':>8}  q / bf16")
    rows = {}
    for name, t in lat.draft.items():
        spec, _, dt = name.rpartition(" @ ")
        rows.setdefault(spec, {})[dt] = t * 1e3
    for spec, r in rows.items():
        print(f"{spec + ' @ q':<42} {r['q']:8.2f}  {r['q'] / r['bf16']:.2f}")
        print(f"{spec + ' @ bf16':<42} {r['bf16']:8.2f}")
    print(f"reproduce: {cmd}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": cmd, "cpu": cpu_name(), "threads": args.threads, "context": args.context}
        doc |= {"rounds": args.rounds, "target_ms": lat.target[1] * 1e3, "draft_ms": rows}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
