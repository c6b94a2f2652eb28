"""The collapse detection's false-positive and detection rates on recorded acceptance (issue 17).

Records, per drafter, the first-draft-token outcome of every proposal of every clean request
(Spec-Bench first turns and GSM8K train questions, greedy, fixed ``--k``; one request at a time,
:class:`specdraft.attack.detection.HitRecorder`), then replays them through a fresh cost-aware
policy (:func:`specdraft.attack.detection.replay`) in file order, with an always-wrong request
(every proposal rejected: what a collapse attack aims at) after every ``--every``-th clean one; a
drafter whose proposals are free (prompt lookup) has its off requests watched at every step.
Prints per drafter the mean first-token acceptance, the share of clean requests flagged
(false positives), of always-wrong ones flagged, and the median steps to the flag.

``--out`` writes the recorded outcomes (tests/attack/test_detection.py replays such a file),
``--hits`` replays one instead of recording. ``--alphas`` and ``--concentrations`` replay the
same records once per ``RowWatch.detect_alpha`` and ``detect_concentration`` (``none``: a
binomial). ``--calibration N`` records training prompts instead of the evaluation set: the first
N / 2 HellaSwag contexts and N / 2 GSM8K train questions after those the evaluation set reads
(the detection thresholds are chosen on these, never on Spec-Bench). ``--hindsight``: a feature or
model drafter's outcomes are recorded with what its catch-ups read back (at ``--k 1``, one per
position) and replayed with its catch-ups (``replay(catch_up=read_back + 1)``; ``--read-back N``
replays them as a drafter reading back N would have been).

    .venv/bin/python benchmarks/bench_detection.py --drafts 'lookup;designed:auto;prune:0-14' \\
        --limit 52 --gsm8k 20 --max-new-tokens 128 --threads 2 --out results/attack-2026-12-01/hits.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import api
from specdraft.attack.detection import HitRecorder, rates, replay
from specdraft.bench import harness, profile
from specdraft.bench.prompts import data_file, default_prompts_path, read_prompts
from specdraft.policy import RowWatch


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
    p.add_argument("--hits", default=None, help="replay this --out file instead of recording")
    p.add_argument("--alphas", default=None, help="detect_alpha values to replay, comma-separated")
    p.add_argument("--concentrations", default=None, help="detect_concentration values ('none': binomial)")
    p.add_argument("--calibration", type=int, default=0, help="record N training prompts instead")
    p.add_argument("--hindsight", action="store_true", help="record and replay a draft's read-backs")
    p.add_argument("--read-back", type=int, default=None, help="replay N read-backs per catch-up at most")
    return p.parse_args(argv)


def gsm8k_questions(start: int, n: int) -> list[str]:
    with data_file("gsm8k/train.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line)["question"] for line in itertools.islice(f, start, start + n)]


def prompt_texts(limit: int, gsm8k: int) -> list[str]:
    """The evaluation set: the first ``limit`` Spec-Bench first turns, the first ``gsm8k`` questions."""
    return [p.turns[0] for p in read_prompts(default_prompts_path())[:limit]] + gsm8k_questions(0, gsm8k)


def calibration_texts(n: int, skip_gsm8k: int) -> list[str]:
    """Training prompts apart from the evaluation set (module docstring)."""
    hellaswag = [p.turns[0] for p in read_prompts(data_file("hellaswag_prompts.jsonl"))[: n // 2]]
    return hellaswag + gsm8k_questions(skip_gsm8k, n - n // 2)


def record(pipe, texts: list[str], k: int, max_new: int, hindsight: bool) -> list[list[int]]:
    """Each clean request's first-token outcomes under a fixed k, one request at a time (with
    ``hindsight``, the outcomes its catch-ups read back too)."""
    out = []
    for text in texts:
        recorder = HitRecorder(k, hindsight)
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


def recordings(args) -> tuple[dict[str, list[list[int]]], int, dict[str, bool], dict[str, int]]:
    """Outcomes by draft spec, new tokens per request, whether each spec's proposals are free (a
    free drafter's off rows are watched at every step) and its catch-up read back (``--hindsight``:
    its ``read_back + 1``, else 0): read from ``--hits``, or recorded on the evaluation prompts
    (``--calibration``: the training prompts)."""
    if args.hits:
        doc = json.loads(Path(args.hits).read_text())
        return doc["hits"], doc["max_new_tokens"], doc.get("proposes_free", {}), doc.get("catch_up", {})
    cal = args.calibration
    texts = calibration_texts(cal, args.gsm8k) if cal else prompt_texts(args.limit, args.gsm8k)
    recorded, free, catch_up = {}, {}, {}
    for spec in [s for s in args.drafts.split(";") if s]:
        pipe = api.load(args.target, spec, threads=args.threads)
        recorded[spec] = record(pipe, texts, args.k, args.max_new_tokens, args.hindsight)
        free[spec] = getattr(pipe.drafter, "proposes_free", False)
        catch_up[spec] = getattr(pipe.drafter, "read_back", -1) + 1 if args.hindsight else 0
    return recorded, args.max_new_tokens, free, catch_up


def main(argv=None) -> int:
    args = parse_args(argv)
    print("command: python benchmarks/bench_detection.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"cpu: {profile.cpu_name()}, threads {args.threads}", flush=True)
    recorded, max_new, free, catch_up = recordings(args)
    if args.read_back is not None:  # what a drafter reading back that many would have flagged
        catch_up = {spec: args.read_back + 1 for spec in catch_up}
    default = RowWatch()
    alphas = [float(a) for a in args.alphas.split(",")] if args.alphas else [default.detect_alpha]
    spreads = (
        [None if c == "none" else float(c) for c in args.concentrations.split(",")]
        if args.concentrations
        else [default.detect_concentration]
    )
    head = "drafter            requests  catch-up  concentration  alpha  first-token acc."
    print(head + "  false positives  detected")
    for spec, clean in recorded.items():
        requests, adversarial = with_attacks(clean, args.every, max_new)
        hits = [h for req in clean for h in req]
        acc = sum(hits) / len(hits) if hits else float("nan")
        # a feature drafter's read-backs replayed, and left out (its probes alone, as before them)
        for lag, spread, alpha in itertools.product(sorted({catch_up.get(spec, 0), 0}), spreads, alphas):
            watch = RowWatch(detect_alpha=alpha, detect_concentration=spread)
            r = rates(replay(requests, watch, max_new, free.get(spec, False), lag), adversarial)
            print(
                f"{spec:18s} {len(clean):8d}  {lag:8d}  {spread or 'none':>13}  {alpha:5g}  {acc:16.3f}  "
                f"{r['false_positive_rate']:15.3f}  {r['detected_rate']:8.3f}  "
                f"(median {r['median_steps_to_flag']} steps to flag)",
                flush=True,
            )
    if args.out:
        doc = {"command": " ".join(sys.argv), "k": args.k, "max_new_tokens": max_new, "proposes_free": free}
        doc["catch_up"] = catch_up
        Path(args.out).write_text(json.dumps(doc | {"hits": recorded}) + "\n")
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
