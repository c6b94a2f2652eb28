#!/bin/bash
# Issue 15 item 4 (drafts on GGUF blocks, --draft-dtype q): the runs to quote, on a quiet machine.
# From the repository root: bash results/quant-draft-2026-12-02/quotable.sh   (~10 min, 2 threads)
set -e
R=results/quant-draft-2026-12-02
# 1. draft step ms, q against bf16, timed in turn in one process (what --draft-dtype auto follows)
.venv/bin/python benchmarks/bench_quant_draft.py --threads 2 --rounds 30 \
    --drafts "designed:smollm2-135m-l2;prune:0,1,2,29,head=8192" --json $R/quant_draft_t2.json | tee $R/quant_draft_t2.txt
# 2. the same through specdraft profile, one process per draft and precision, in turn
for r in 1 2; do
  for d in designed:smollm2-135m-l2 prune:0,1,2,29,head=8192; do
    for dd in q bf16; do
      n=${d%%:*}
      .venv/bin/specdraft profile --draft $d --draft-dtype $dd --batch 1 --new-tokens 1 --threads 2 \
          --repeats 15 --no-breakdown --json $R/profile_${n}_${dd}_$r.json | grep '^| 1 ' | sed "s/^/$n $dd: /"
    done
  done
done | tee $R/profile_t2.txt
# 3. end to end against plain decoding, each draft precision (bf16 makes a prune: draft's target bf16)
for dd in auto q bf16; do
  .venv/bin/python benchmarks/bench_drafters.py --limit 1 --max-new-tokens 64 --threads 2 --draft-dtype $dd \
      --drafts "designed:smollm2-135m-l2@auto;prune:0,1,2,29,head=8192@auto" --json $R/drafters_$dd.json \
      | tee $R/drafters_$dd.txt
done
# 4. peak RSS of specdraft generate per draft and precision
bash $R/rss.sh 2 | tee $R/rss_t2.txt
