#!/bin/bash
# Peak RSS of one short `specdraft generate` per draft and draft precision (issue 15 item 4).
# Usage: bash results/quant-draft-2026-12-02/rss.sh [THREADS]   (from the repository root)
T=${1:-2}
P="What is speculative decoding? Answer in two sentences."
for args in "none auto" "prune:0,1,2,29,head=8192 auto" "prune:0,1,2,29,head=8192 bf16" \
            "designed:smollm2-135m-l2 q" "designed:smollm2-135m-l2 bf16"; do
  set -- $args
  err=$(mktemp)
  /usr/bin/time -v .venv/bin/specdraft generate --target smollm2-135m --draft "$1" --draft-dtype "$2" \
      --k 3 --threads "$T" --max-new-tokens 32 "$P" > /dev/null 2> "$err"
  rss=$(grep "Maximum resident" "$err" | awk '{print $NF}')
  line=$(grep "^generated" "$err")
  keep=$(grep -c "dtype auto: bf16" "$err")
  echo "draft $1 --draft-dtype $2: peak RSS $((rss / 1024)) MB; bf16 target: $keep; $line"
  rm -f "$err"
done
