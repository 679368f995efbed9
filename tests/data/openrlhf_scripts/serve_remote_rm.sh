# From OpenRLHF v0.11.0 (examples/scripts/serve_remote_rm.sh), Apache License 2.0 (https://github.com/OpenRLHF/OpenRLHF/blob/v0.11.0/LICENSE); unchanged below this line.
set -x

python -m openrlhf.cli.serve_rm \
    --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k \
    --port 5000 \
    --ds.param_dtype bf16 \
    --ds.attn_implementation flash_attention_2 \
    --reward.normalize_enable \
    --data.max_len 8192 \
    --batch_size 16