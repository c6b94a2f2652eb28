#!/bin/bash
# The cost-aware policy's k = auto against plain decoding (and without its safe arm), at this commit
# and, when BEFORE names a checkout of an earlier commit, there right after, config by config.
# usage: [CONFIGS='drafter:batch ...'] results/policy-catchup-2026-12-03/run.sh [BEFORE_DIR]
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
BEFORE=${1:-}
step() {  # step LOG DIR: bench_policy in checkout DIR, header first
  local log=$1 dir=$2; shift 2
  { echo "# $(date -u +%FT%TZ) $(lscpu | grep 'Model name' | sed 's/  */ /g'); load: $(cut -d' ' -f1-3 /proc/loadavg); commit $(git -C "$dir" rev-parse --short HEAD)"
    echo "\$ $*"; (cd "$dir" && "$@" 2>/dev/null); echo "exit $?"; } > "$log"
}
for DB in ${CONFIGS:-designed:smollm2-135m-l2:1 lookup:1 designed:smollm2-135m-l2:8 lookup:8}; do
  d=${DB%:*}; B=${DB##*:}; n=${d%%:*}
  args=(--draft "$d" --policies auto,auto-unguarded --batch "$B" --limit 2 --max-new-tokens 128 --threads 2)
  step "$OUT/${n}_b$B.txt" . .venv/bin/python benchmarks/bench_policy.py "${args[@]}" --json "$OUT/${n}_b$B.json"
  [ -n "$BEFORE" ] && step "$OUT/${n}_b${B}_before.txt" "$BEFORE" .venv/bin/python benchmarks/bench_policy.py "${args[@]}"
done
