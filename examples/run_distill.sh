#!/usr/bin/env bash
# bash examples/run_distill.sh
# On-policy distillation on the hard toy task at 2 CPU ranks: the GRPO-trained policy of
# examples/run_grpo.sh (run first when $TEACHER is missing) taught to a fresh student half its
# width and depth, against SFT of the same student on the same budget (the same steps, rows,
# schedule); held-out exact match of each from a fresh-process reload of its export.
# Env: OUT (default outputs/distill), TEACHER (default outputs/grpo/model), DATA (default
# outputs/grpo/data), SKIP_SETUP=1 (already installed), MASTER_PORT, LMBDA, BETA.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash .ci/setup default
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 PYTHONPATH="$PWD"
OUT=${OUT:-outputs/distill}
TEACHER=${TEACHER:-outputs/grpo/model}
DATA=${DATA:-outputs/grpo/data}
PORT=${MASTER_PORT:-29534}
[ -f "$TEACHER/config.json" ] || SKIP_SETUP=1 bash examples/run_grpo.sh
rm -rf "$OUT" && mkdir -p "$OUT"
paths=(--tokenizer "$DATA/tokenizer" --dataset "$DATA/train.jsonl"
       --eval_dataset "$DATA/test.jsonl")
python -m strategy.demos.toy_task evaluate "$TEACHER" "$DATA/test.jsonl" | tee "$OUT/teacher.txt"
start=$SECONDS
strategy distill --nproc 2 --master_port "$PORT" --config distill_toy "${paths[@]}" \
    --teacher_pretrain "$TEACHER" --lmbda "${LMBDA:-0.5}" --beta "${BETA:-0.5}" \
    --save_path "$OUT/model" --ckpt_path "$OUT/ckpt" --log_dir "$OUT/logs"
distill_s=$((SECONDS - start))
python -m strategy.demos.toy_task evaluate "$OUT/model" "$DATA/test.jsonl" | tee "$OUT/distilled.txt"
start=$SECONDS  # the same student, steps, rows and schedule, on the dataset's completions
strategy sft --nproc 2 --master_port "$PORT" --config grpo_sft "${paths[@]}" \
    --model_config configs/tiny_llama_student.json \
    --save_path "$OUT/sft" --ckpt_path "$OUT/sft_ckpt" --log_dir "$OUT/sft_logs"
sft_s=$((SECONDS - start))
python -m strategy.demos.toy_task evaluate "$OUT/sft" "$DATA/test.jsonl" | tee "$OUT/sft.txt"
score() { grep -o "accuracy: [0-9.]*%" "$1" | sed 's/accuracy: //'; }
echo "[distill run] teacher $(score "$OUT/teacher.txt"); student distilled in ${distill_s} s:" \
     "$(score "$OUT/distilled.txt"); the same student by SFT in ${sft_s} s: $(score "$OUT/sft.txt")"
