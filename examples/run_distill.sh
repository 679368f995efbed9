#!/usr/bin/env bash
# bash examples/run_distill.sh
# On-policy distillation on the hard toy task at 2 CPU ranks: a student half the width and depth
# of the GRPO-trained policy of examples/run_grpo.sh (run first when $TEACHER is missing) gets a
# short SFT run, then the same budget (steps, rows, schedule) either distilled from that teacher
# or by more SFT; held-out exact match of each from a fresh-process reload of its export.
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
score() { python -m strategy.demos.toy_task evaluate "$1" "$DATA/test.jsonl" | tee "$2" |
          grep -o "accuracy: [0-9.]*%" | sed 's/accuracy: //'; }
teacher=$(score "$TEACHER" "$OUT/teacher.txt")
strategy sft --nproc 2 --master_port "$PORT" --config grpo_sft "${paths[@]}" \
    --model_config configs/tiny_llama_student.json \
    --save_path "$OUT/student" --ckpt_path "$OUT/student_ckpt" --log_dir "$OUT/student_logs"
student=$(score "$OUT/student" "$OUT/student.txt")
start=$SECONDS
strategy distill --nproc 2 --master_port "$PORT" --config distill_toy "${paths[@]}" \
    --pretrain "$OUT/student" --teacher_pretrain "$TEACHER" \
    --lmbda "${LMBDA:-0.5}" --beta "${BETA:-0.5}" \
    --save_path "$OUT/model" --ckpt_path "$OUT/ckpt" --log_dir "$OUT/logs"
distill_s=$((SECONDS - start))
distilled=$(score "$OUT/model" "$OUT/distilled.txt")
start=$SECONDS  # the same start, steps, rows and schedule, on the dataset's completions
strategy sft --nproc 2 --master_port "$PORT" --config grpo_sft "${paths[@]}" \
    --pretrain "$OUT/student" \
    --save_path "$OUT/sft" --ckpt_path "$OUT/sft_ckpt" --log_dir "$OUT/sft_logs"
sft_s=$((SECONDS - start))
sft=$(score "$OUT/sft" "$OUT/sft.txt")
echo "[distill run] teacher $teacher; student after its SFT $student; then distilled" \
     "(${distill_s} s): $distilled; or more SFT (${sft_s} s): $sft"
