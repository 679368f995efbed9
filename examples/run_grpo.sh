#!/usr/bin/env bash
# bash examples/run_grpo.sh
# GRPO on the hard toy task (reverse 7-12 letters) at 2 CPU ranks: make the data, a short SFT run
# that gets part of the held-out set right, GRPO from it with a rule-based reward, and held-out
# exact match before and after, each from a fresh-process reload of the export.
# Env: OUT (default outputs/grpo), SKIP_SETUP=1 (already installed), MASTER_PORT, GRPO_CONFIG
# (a shipped config's name or a path; default grpo_toy; reinforce_pp_toy runs REINFORCE++), TRAINER
# (grpo, or ppo with GRPO_CONFIG=ppo_toy: strategy ppo, a critic beside the policy), GRPO_FLAGS
# (more flags for it, e.g. "--rollout_engine vllm --vllm_enforce_eager": rollouts on vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash .ci/setup default
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 PYTHONPATH="$PWD"
OUT=${OUT:-outputs/grpo}
PORT=${MASTER_PORT:-29533}
rm -rf "$OUT"
python -m strategy.demos.toy_task make "$OUT/data" --hard
paths=(--dataset "$OUT/data/train.jsonl" --eval_dataset "$OUT/data/test.jsonl")
start=$SECONDS
strategy sft --nproc 2 --master_port "$PORT" \
    --config grpo_sft --tokenizer "$OUT/data/tokenizer" "${paths[@]}" \
    --save_path "$OUT/sft" --ckpt_path "$OUT/sft_ckpt" --log_dir "$OUT/sft_logs"
sft_s=$((SECONDS - start))
python -m strategy.demos.toy_task evaluate "$OUT/sft" "$OUT/data/test.jsonl" | tee "$OUT/before.txt"
start=$SECONDS
strategy "${TRAINER:-grpo}" --nproc 2 --master_port "$PORT" \
    --config "${GRPO_CONFIG:-grpo_toy}" --pretrain "$OUT/sft" "${paths[@]}" \
    --save_path "$OUT/model" --ckpt_path "$OUT/ckpt" --log_dir "$OUT/logs" ${GRPO_FLAGS:-}
grpo_s=$((SECONDS - start))
python -m strategy.demos.toy_task evaluate "$OUT/model" "$OUT/data/test.jsonl" | tee "$OUT/after.txt"
before=$(grep -o "accuracy: [0-9.]*%" "$OUT/before.txt")
after=$(grep -o "accuracy: [0-9.]*%" "$OUT/after.txt")
echo "[${TRAINER:-grpo} run] SFT ${sft_s} s: held-out exact match ${before#accuracy: }; ${TRAINER:-grpo} ${grpo_s} s:" \
     "${after#accuracy: } (logs: $OUT/logs)"
