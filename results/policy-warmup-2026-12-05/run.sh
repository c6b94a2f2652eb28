#!/bin/bash
# k = auto for the feature draft after two policy fixes: runtimes pack their weights when built
# (6345177), and a row goes off only after a run of rejections rare for its drafter (1d59d9d).
# Each bench runs at this checkout and at every checkout named in BEFORE (space-separated dirs, e.g.
# git worktrees of e8ce3c1 and 6345177), one after the other: ratios compare within a file.
# usage: [BEFORE='DIR ...'] results/policy-warmup-2026-12-05/run.sh bench|policy|designed|collapse|detection|replay|tasks-build|tasks
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
cd "$OUT/../.."
. results/step.sh  # step LOG cmd...
ROOT=$PWD
at() {  # at DIR NAME cmd...: run cmd in checkout DIR, log to $OUT/NAME-<commit>.txt
  local dir=$1 name=$2; shift 2
  local c; c=$(git -C "$dir" rev-parse --short HEAD)
  (cd "$dir" && step "$OUT/$name-$c.txt" "$@")
}
F=designed:smollm2-135m-feature-4k-second
W=${W:-/work/train}
case "${1:-}" in
  bench)  # Spec-Bench and the held-out training-distribution prompts of results/feature-data-2026-12-04
    for dir in $ROOT ${BEFORE:-}; do
      at "$dir" specbench .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --limit 2 --max-new-tokens 64 \
        --threads 2 --drafts "$F@1;$F@auto;lookup@auto;designed:smollm2-135m-l2@auto"
      at "$dir" heldout .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --limit 8 --max-new-tokens 64 \
        --threads 2 --prompts "$ROOT/results/feature-data-2026-12-04/heldout.jsonl" --drafts "$F@1;$F@2;$F@auto"
    done ;;
  policy)  # the row watch's rule, old (auto-off3) against new (auto), in one process (bench_policy.py)
    c=$(git rev-parse --short HEAD)
    while read -r d B; do
      [ -n "${ONLY:-}" ] && [[ "$d" != *"$ONLY"* ]] && continue  # ONLY=feature: that drafter's lines
      step "$OUT/policy_${d##*:}_b$B-$c.txt" .venv/bin/python benchmarks/bench_policy.py --draft "$d" --batch "$B" \
        --policies auto,auto-off3,auto-unguarded --limit 2 --max-new-tokens 128 --threads 2 \
        --json "$OUT/policy_${d##*:}_b$B-$c.json" </dev/null
    done <<END
lookup 1
$F 1
lookup 8
END
    ;;
  designed)  # every committed SmolLM2 draft at k = 1 and auto on Spec-Bench: what designed:auto ranks
    # (drafts/auto.json: a draft's best row)
    D=""; for d in drafts/smollm2-135m-*/specdraft.json; do n=designed:${d#drafts/}; n=${n%/specdraft.json}; D="$D;$n@1;$n@auto"; done
    step "$OUT/designed.txt" .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --limit 2 --max-new-tokens 64 \
      --threads 2 --drafts "${D#;}" --json "$OUT/designed.json" --plot "$OUT/designed.png" ;;
  collapse)  # under attack (bench_collapse.py: WrongRows spoils the attacked rows' drafts): drafter, batch,
    # rows attacked, rounds (median decode seconds)
    for dir in $ROOT ${BEFORE:-}; do
      while read -r d B A R; do
        [ -n "${ONLY:-}" ] && [[ "$d" != *"$ONLY"* ]] && continue
        at "$dir" "collapse_${d##*:}_b$B" .venv/bin/python benchmarks/bench_collapse.py --draft "$d" --batch "$B" \
          --attacked "$A" --max-new-tokens 128 --threads 2 --rounds "$R" </dev/null
      done <<END
lookup 8 4 3
lookup 1 1 9
$F 1 1 9
END
    done ;;
  detection)  # recorded clean acceptance replayed with always-wrong requests (bench_detection.py)
    for dir in $ROOT ${BEFORE:-}; do
      at "$dir" detection .venv/bin/python benchmarks/bench_detection.py --drafts "lookup;$F" --limit 52 --gsm8k 20 \
        --max-new-tokens 128 --threads 2
    done ;;
  tasks-build)  # a fine-tune with the tasks source added (summarize / translate / rewrite / list / read over
    # the training texts); W: where the build goes (not committed: no gain, see tasks)
    step "$OUT/tasks/build.log" .venv/bin/specdraft design build --target smollm2-135m --dtype bf16 --threads 2 \
      --kind feature --init-from smollm2-135m-feature-4k-second --layers 0 --head 8192 --prompts 2000 \
      --val-prompts 48 --sources gsm8k,hellaswag,self,tasks --gen-dtype bf16 --max-new-tokens 160 --gen-batch 16 \
      --steps 1500 --batch-size 8 --lr 3e-4 --second-weight 0.5 --checkpoint-every 25 --eval-every 500 \
      --save-dtype bf16 --quiet --work "$W/feature-tasks-work" --out "$W/feature-tasks"
    cp "$W/feature-tasks/RECIPE.md" "$OUT/tasks/RECIPE.md" ;;
  tasks)  # that fine-tune against the draft it started from
    step "$OUT/tasks/specbench.txt" .venv/bin/python benchmarks/bench_drafters.py --dtype bf16 --limit 2 \
      --max-new-tokens 64 --threads 2 --drafts "$F@1;$F@2;designed:$W/feature-tasks@1;designed:$W/feature-tasks@2" ;;
  replay)  # the recorded clean lookup requests the detection test replays (a collapsed one after every
    # fourth), through the row watch before 1d59d9d (off after any three rejections) and now
    step "$OUT/replay.txt" .venv/bin/python - <<'PY'
import json
from specdraft.attack.detection import rates, replay
from specdraft.policy import RowWatch
doc = json.load(open("tests/attack/data/lookup_hits.json"))
requests, attacked = [], []
for i, hits in enumerate([h for h in doc["hits"]["lookup"] if h], 1):
    requests, attacked = requests + [hits], attacked + [False]
    if i % 4 == 0:
        requests, attacked = requests + [[0] * doc["max_new_tokens"]], attacked + [True]
for name, watch in (("before 1d59d9d (off_max=3)", RowWatch(off_max=3)), ("now", RowWatch())):
    print(name, rates(replay(requests, watch, tokens=doc["max_new_tokens"]), attacked))
PY
    ;;
  *) echo "usage: $0 bench|policy|designed|collapse|detection|replay|tasks-build|tasks" >&2; exit 2 ;;
esac
