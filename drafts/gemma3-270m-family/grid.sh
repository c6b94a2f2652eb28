# The gemma3-270m draft family (drafts/train_family.sh reads this). Widths: full is the target's
# (4 query heads sharing 1 key/value head of 256, FFN 2048: 5.57 M parameters a layer); half keeps
# 2 query heads and FFN 896 (2.70 M); quarter 1 query head and FFN 384 (1.39 M). One parameter
# budget, 5.4-5.6 M (d1-full, d2-half, d4-quarter), with a 16384-token head, and d1-full with the
# whole 262144-token head.
# Recipe: 400 distillation steps of 8 answers (lr 1e-3, 1 torch thread) on the bf16 target's
# answers (128 tokens) to 480 GSM8K / HellaSwag prompts (32 held out).
# shellcheck disable=SC2034
target=gemma3-270m
width=([full]="" [half]="--q-per-kv 2 --ffn 896" [quarter]="--q-per-kv 1 --ffn 384")
grid="d1-full-h16k d2-half-h16k d4-quarter-h16k d1-full-hfull"
recipe="--dtype bf16 --threads 1 --prompts 480 --val-prompts 32 --sources gsm8k,hellaswag
        --gen-dtype bf16 --max-new-tokens 128 --gen-batch 16 --steps 400 --batch-size 8 --lr 1e-3
        --checkpoint-every 25 --eval-every 100 --save-dtype bf16"
