#!/usr/bin/env bash
# bash examples/run_default.sh
# The main job on a fresh machine: install, make the toy data, train at 2 CPU ranks, then reload
# the export in a fresh process and print held-out exact-match accuracy and a few generations.
# Env: OUT (output dir, default outputs/default), SKIP_SETUP=1 (already installed), MASTER_PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
[ "${SKIP_SETUP:-0}" = 1 ] || bash .ci/setup default
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 PYTHONPATH="$PWD"
OUT=${OUT:-outputs/default}
rm -rf "$OUT"
python -m strategy.demos.toy_task make "$OUT/data"
# --log-dir /dev/null: torchrun would leave a torchelastic_* folder in the temp folder each run
torchrun --nproc_per_node 2 --log-dir /dev/null --master_port "${MASTER_PORT:-29531}" \
    -m strategy.demos.train_default \
    --config default --tokenizer "$OUT/data/tokenizer" \
    --dataset "$OUT/data/train.jsonl" --eval_dataset "$OUT/data/test.jsonl" \
    --save_path "$OUT/model" --ckpt_path "$OUT/ckpt" --log_dir "$OUT/logs"
python -m strategy.demos.toy_task evaluate "$OUT/model" "$OUT/data/test.jsonl" \
    --compare "$OUT/answers.jsonl" --min_accuracy "${MIN_ACCURACY:-0.5}"
echo "logs: $OUT/logs (TensorBoard events, metrics.jsonl, loss_curve.png)"
echo "[default run] done in $((SECONDS - start)) s (install, ops, data, training, reload)"
