# The smollm2-135m draft family (drafts/train_family.sh reads this). Widths: full is the target's
# (9 query heads in 3 key/value groups, FFN 1536: 3.54 M parameters a layer); half keeps 4 query
# heads in 2 groups and FFN 768 (1.77 M); quarter 2 query heads in 1 group and FFN 384 (0.88 M).
# Two parameter budgets: 3.5 M (d1-full, d2-half, d4-quarter) and 7.1 M (d2-full, d4-half,
# d8-quarter), each with a 16384-token head, and the whole 49152-token head for four of them.
# Recipe: 400 distillation steps of 8 answers (lr 1e-3, 1 torch thread) on the cached bf16 target's
# answers to 1600 GSM8K / HellaSwag / self-written prompts (48 held out).
# shellcheck disable=SC2034
target=smollm2-135m
width=([full]="" [half]="--kv-heads 2 --q-per-kv 2 --ffn 768" [quarter]="--kv-heads 1 --q-per-kv 2 --ffn 384")
grid="d1-full-h16k d2-half-h16k d4-quarter-h16k d2-full-h16k d4-half-h16k d8-quarter-h16k
      d1-full-hfull d4-quarter-hfull d2-full-hfull d8-quarter-hfull"
recipe="--dtype auto --threads 1 --prompts 1600 --val-prompts 48 --sources gsm8k,hellaswag,self
        --gen-dtype bf16 --max-new-tokens 160 --gen-batch 16 --steps 400 --batch-size 8 --lr 1e-3
        --checkpoint-every 25 --eval-every 100 --save-dtype bf16"
