#!/usr/bin/env bash
# bash examples/run_tools.sh
# Tool use at 2 CPU ranks: multiply two 3-4 digit numbers, which a tiny model cannot do in its
# head, with a calculator it may call (strategy.demos.toy_tools). A short SFT run on conversations
# that call the tool, then GRPO with --tools (each episode: the model's call, the tool's turn as
# context, the model's answer; rewarded 1 for the exact product), and the no-tool baseline (SFT on
# the answers alone). Held-out exact match of each, from a fresh-process reload of its export.
# Env: OUT (default outputs/tools), SKIP_SETUP=1 (already installed), MASTER_PORT, GRPO_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash .ci/setup default
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 PYTHONPATH="$PWD"
OUT=${OUT:-outputs/tools}
PORT=${MASTER_PORT:-29534}
rm -rf "$OUT"
python -m strategy.demos.toy_tools make "$OUT/data"
sft() {  # name, dataset
    strategy sft --nproc 2 --master_port "$PORT" --config tools_sft \
        --tokenizer "$OUT/data/tokenizer" --dataset "$OUT/data/$2.jsonl" \
        --save_path "$OUT/$1" --ckpt_path "$OUT/$1_ckpt" --log_dir "$OUT/$1_logs"
}
start=$SECONDS
sft sft tool_sft
sft_s=$((SECONDS - start))
sft direct direct_sft
evaluate() { python -m strategy.demos.toy_tools evaluate "$OUT/$1" "$OUT/data/test.jsonl" "${@:2}"; }
evaluate sft | tee "$OUT/before.txt"
evaluate direct --no_tools | tee "$OUT/direct.txt"
start=$SECONDS
strategy grpo --nproc 2 --master_port "$PORT" --config tools_grpo --pretrain "$OUT/sft" \
    --dataset "$OUT/data/train.jsonl" --eval_dataset "$OUT/data/test.jsonl" \
    --save_path "$OUT/model" --ckpt_path "$OUT/ckpt" --log_dir "$OUT/logs" ${GRPO_FLAGS:-}
grpo_s=$((SECONDS - start))
evaluate model | tee "$OUT/after.txt"
evaluate model --no_tools | tee "$OUT/after_no_tool.txt"
figure() { grep -o "exact match: [0-9.]*%" "$OUT/$1.txt" | cut -d' ' -f3; }
echo "[tools run] no tool (SFT on answers): $(figure direct); with the tool: SFT ${sft_s} s" \
     "$(figure before), GRPO ${grpo_s} s $(figure after) (the GRPO model without it:" \
     "$(figure after_no_tool)); logs: $OUT/logs"
