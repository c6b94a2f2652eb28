#!/bin/bash
# Under attack (benchmarks/bench_collapse.py: WrongRows spoils the last --attacked rows' drafts):
# batch 8 with 4 attacked rows, and batch 1 attacked (one prompt: median of 9 rounds), for prompt
# lookup and the designed draft.
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
step() {  # step LOG cmd...: header first
  local log=$1; shift
  { echo "# $(date -u +%FT%TZ) $(lscpu | grep 'Model name' | sed 's/  */ /g'); load: $(cut -d' ' -f1-3 /proc/loadavg); commit $(git rev-parse --short HEAD)"
    echo "\$ $*"; "$@" 2>/dev/null </dev/null; echo "exit $?"; } > "$log"
}
# drafter, batch, rows attacked, rounds; ONLY=b1 (or b8) runs those lines only
while read -r d B A R; do
  [ -n "${ONLY:-}" ] && [ "$ONLY" != "b$B" ] && continue
  step "$OUT/collapse_${d%%:*}_b$B.txt" .venv/bin/python benchmarks/bench_collapse.py --draft "$d" --batch "$B" \
    --attacked "$A" --max-new-tokens 128 --threads 2 --rounds "$R"
done <<'END'
lookup 8 4 3
designed:smollm2-135m-l2 8 4 3
lookup 1 1 9
designed:smollm2-135m-l2 1 1 9
END
