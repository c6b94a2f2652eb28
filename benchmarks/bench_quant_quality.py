r"""How close the quantized runtime computes the model: teacher-forced top-1 agreement and logit RMS
difference against the exactly de-quantized fp32 model, over the prompt positions of Spec-Bench
first turns (one prompt per category, at most 200 tokens each).

    .venv/bin/python benchmarks/bench_quant_quality.py --prompts 8

Greedy outputs of two implementations split at the first near-tie and never rejoin, so their
position-wise agreement says little; this compares next-token predictions on the same prefixes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.bench.prompts import load_prompts


def prompt_logits(pipe, ids: torch.Tensor) -> torch.Tensor:
    """``(T, V)`` fp32 logits of one prefill over ``ids`` ``(1, T)``."""
    T = ids.shape[1]
    state = pipe.runtime.new_state(1, T + 8)
    return pipe.runtime.forward(state, ids, torch.arange(T).unsqueeze(0)).logits[0].float()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ref = api.load(args.target, None, dtype="fp32", threads=args.threads)
    quant = api.load(args.target, None, dtype="q", threads=args.threads)
    agree = positions = 0
    rms = []
    for prompt in load_prompts(None, None, 1)[: args.prompts]:
        ids = torch.tensor([ref.encode(prompt.turns[0])[: args.max_tokens]])
        a, b = prompt_logits(ref, ids), prompt_logits(quant, ids)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += ids.shape[1]
        rms.append(float((a - b).pow(2).mean().sqrt()))
    print(
        f"{quant.runtime} vs fp32: top-1 agreement {agree / positions:.4f} over {positions} positions; "
        f"mean logit RMS difference {sum(rms) / len(rms):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
