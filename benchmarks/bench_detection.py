"""The collapse detection's false-positive and detection rates on recorded acceptance (issue 17).

Records, per drafter, the first-draft-token outcome of every proposal of every clean request
(Spec-Bench first turns and GSM8K train questions, greedy, fixed ``--k``; one request at a time,
:class:`specdraft.attack.detection.HitRecorder`), then replays them through a fresh cost-aware
policy (:func:`specdraft.attack.detection.replay`) in file order, with an always-wrong request
(every proposal rejected: what a collapse attack aims at) after every ``--every``-th clean one; a
drafter whose proposals are free (prompt lookup) has its off requests watched at every step.
Prints per drafter the mean first-token acceptance, the share of clean requests flagged
(false positives), of always-wrong ones flagged, and the median steps to the flag; ``--out``
writes the recorded outcomes (the distribution tests/attack/test_detection.py replays).

    .venv/bin/python benchmarks/bench_detection.py --drafts 'lookup;designed:auto;prune:0-14' \\
        --limit 52 --gsm8k 20 --max-new-tokens 128 --threads 2 --out results/attack-2026-12-01/hits.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.attack.detection import HitRecorder, rates, replay
from specdraft.bench import harness, profile
from specdraft.bench.prompts import default_prompts_path, read_prompts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafts", default="lookup;designed:auto", help="draft specs separated by ';'")
    p.add_argument("--limit", type=int, default=52, help="Spec-Bench prompts (first turns)")
    p.add_argument("--gsm8k", type=int, default=20, help="GSM8K train questions")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--every", type=int, default=4, help="an always-wrong request after every N clean")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON file for the recorded outcomes")
    return p.parse_args(argv)


def prompt_texts(limit: int, gsm8k: int) -> list[str]:
    texts = [p.turns[0] for p in read_prompts(default_prompts_path())[:limit]]
    path = default_prompts_path().parents[1] / "gsm8k" / "train.jsonl"
    with path.open(encoding="utf-8") as f:
        texts += [json.loads(line)["question"] for line, _ in zip(f, range(gsm8k))]
    return texts


def record(pipe, texts: list[str], k: int, max_new: int) -> list[list[int]]:
    """Each clean request's first-token outcomes under a fixed k, one request at a time."""
    out = []
    for text in texts:
        recorder = HitRecorder(k)
        method = harness.engine_method("rec", pipe.runtime, pipe.drafter, recorder, pipe.eos_ids)
        method.run(pipe.encode(text), max_new)
        out.append(next(iter(recorder.hits.values()), []))
    return out


def with_attacks(clean: list[list[int]], every: int, length: int) -> tuple[list[list[int]], list[bool]]:
    requests, adversarial = [], []
    for i, hits in enumerate(clean, 1):
        requests.append(hits)
        adversarial.append(False)
        if i % every == 0:
            requests.append([0] * length)
            adversarial.append(True)
    return requests, adversarial


def main(argv=None) -> int:
    args = parse_args(argv)
    print("command: python benchmarks/bench_detection.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"cpu: {profile.cpu_name()}, threads {args.threads}", flush=True)
    texts = prompt_texts(args.limit, args.gsm8k)
    recorded = {}
    print("drafter            requests  first-token acc.  false positives  detected  median steps to flag")
    for spec in [s for s in args.drafts.split(";") if s]:
        pipe = api.load(args.target, spec, threads=args.threads)
        clean = record(pipe, texts, args.k, args.max_new_tokens)
        recorded[spec] = clean
        requests, adversarial = with_attacks(clean, args.every, args.max_new_tokens)
        free = getattr(pipe.drafter, "proposes_free", False)  # off rows are watched at every step
        r = rates(replay(requests, tokens=args.max_new_tokens, shadow=free), adversarial)
        hits = [h for req in clean for h in req]
        acc = sum(hits) / len(hits) if hits else float("nan")
        print(
            f"{spec:18s} {len(clean):8d}  {acc:16.3f}  {r['false_positive_rate']:15.3f}  "
            f"{r['detected_rate']:8.3f}  {r['median_steps_to_flag']}",
            flush=True,
        )
    if args.out:
        doc = {"command": " ".join(sys.argv), "k": args.k, "max_new_tokens": args.max_new_tokens}
        Path(args.out).write_text(json.dumps(doc | {"hits": recorded}) + "\n")
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
