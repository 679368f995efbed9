"""Short GPU checks that benchmarks/gpu_check.py runs one per process; each prints one JSON line.

python benchmarks/gpu_probes.py optim|resume|rollout [--tiny]

optim: DeepSpeed's FusedAdam on CUDA parameters and DeepSpeedCPUAdam on CPU parameters (the op
built on the GPU machine), 5 AdamW steps each against ``torch.optim.AdamW`` from the same start.
resume: ``test_exact_resume_bf16``'s body (``tests/test_checkpoint.py::train``) at ZeRO-2 and 3 on
ONE rank (the test runs 2; NCCL cannot put 2 ranks on one GPU): an uninterrupted run, a run
saved at step 4, a run resumed from other weights; bit-exact losses, data order, learning rates,
fp32 masters, bf16 weights and RNG streams.
rollout: greedy ``generate`` (KV cache) of 64 prompts x 128 new tokens from a ~0.2B LLaMA, bf16,
through the strategy's ZeRO-3 engine at world size 1 and from the bare model; tokens/s of each
(``--tiny``: a small model and few tokens, to check the probe on a CPU).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.* (the resume probe runs the test's own training body)


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)


def _device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _sync() -> None:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


# ------------------------------------------------------------ optim


def _adam_gap(make, device: str, steps: int = 5) -> float:
    """Largest |ours - torch AdamW| over the parameters after ``steps`` steps."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen) for n in (4099, 1 << 16, 77)]
    grads = [[torch.randn(t.shape, generator=gen) for t in start] for _ in range(steps)]
    ours = [torch.nn.Parameter(t.clone().to(device)) for t in start]
    ref = [torch.nn.Parameter(t.clone().to(device)) for t in start]
    settings = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    optimizers = (make(ours, **settings), torch.optim.AdamW(ref, **settings))
    for step in grads:
        for params, opt in zip((ours, ref), optimizers):
            for p, g in zip(params, step):
                p.grad = g.to(device)
            opt.step()
    return max((a - b).abs().max().item() for a, b in zip(ours, ref))


def optim() -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    device = _device()
    fused = _adam_gap(lambda p, **kw: FusedAdam(p, adam_w_mode=True, **kw), device)
    cpu = _adam_gap(lambda p, **kw: DeepSpeedCPUAdam(p, adamw_mode=True, **kw), "cpu")
    tol = 1e-5
    emit({"device": device, "fused_adam_max_gap": fused, "cpu_adam_max_gap": cpu,
          "tolerance": tol, "ok": fused <= tol and cpu <= tol})


# ------------------------------------------------------------ resume


def _exact(full: dict, first: dict, second: dict) -> dict:
    """Which of the test's bit-exact comparisons hold for one rank."""
    return {
        "losses": {**first["losses"], **second["losses"]} == full["losses"],
        "data_order": {**first["seen"], **second["seen"]} == full["seen"],
        "lrs": {**first["lrs"], **second["lrs"]} == full["lrs"],
        "fp32_master": bool(full["master"]) and len(full["master"]) == len(second["master"])
        and all(torch.equal(a, b) for a, b in zip(full["master"], second["master"])),
        "bf16_weights": all(torch.equal(v, second["weights"][k])
                            for k, v in full["weights"].items()),
        "rng": full["rng"] == second["rng"],
        "trains_in_bf16": full["dtype"] == second["dtype"] == torch.bfloat16,
    }


def resume() -> None:
    import tempfile

    from tests.support.ranks import Ranks
    from tests.test_checkpoint import STEPS, train

    pool, out = Ranks(), {}
    try:
        for stage in (2, 3):
            ckpt = os.path.join(tempfile.mkdtemp(prefix=f"gpu_resume{stage}_"), "ckpt")
            runs = [pool.run(train, stage, ckpt, bf16=True, world_size=1, **kw)[0]
                    for kw in ({}, {"stop_at": STEPS // 2},
                               {"resume": True, "init_seed": 123})]
            checks = _exact(*runs)
            point = runs[2]["resume"]
            checks["resume_point"] = (point.global_step, point.epoch_consumed) == (STEPS // 2, 32)
            checks["loss_falls"] = runs[0]["losses"][STEPS] < runs[0]["losses"][1]
            out[f"zero{stage}"] = {"bit_exact": all(checks.values()), **checks,
                                   "final_loss": runs[0]["losses"][STEPS]}
    finally:
        pool.close()
    emit({"world_size": 1, "device": _device(), **out,
          "ok": all(v["bit_exact"] for v in out.values())})


# ------------------------------------------------------------ rollout

ROLLOUT_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 64, 128
if "--tiny" in sys.argv:  # a CPU check of the probe itself
    ROLLOUT_MODEL.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 8, 8


def _tokens_per_s(model, prompts: torch.Tensor) -> float:
    from transformers import GenerationConfig

    settings = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
    short = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)
    mask = torch.ones_like(prompts)
    model.eval()
    model.generate(input_ids=prompts, attention_mask=mask, generation_config=short)  # warm-up
    _sync()
    start = time.perf_counter()
    out = model.generate(input_ids=prompts, attention_mask=mask, generation_config=settings,
                         use_cache=True)
    _sync()
    generated = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    return generated / (time.perf_counter() - start)


def rollout() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig

    config = LlamaConfig(**ROLLOUT_MODEL, max_position_embeddings=PROMPT_LEN + NEW_TOKENS)
    prompts = torch.randint(3, config.vocab_size, (PROMPTS, PROMPT_LEN),
                            generator=torch.Generator().manual_seed(0)).to(_device())
    torch.manual_seed(0)
    with torch.device(_device()):
        bare = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                attn_implementation="sdpa")
    params = sum(p.numel() for p in bare.parameters())
    bare_rate = _tokens_per_s(bare, prompts)
    del bare
    strategy_config = StrategyConfig(zero_stage=3, bf16=True, micro_train_batch_size=1,
                                     train_batch_size=1)
    with DeepSpeedStrategy(strategy_config, OptimConfig(learning_rate=1e-5)) as strategy:
        strategy.setup_distributed()
        model = strategy.from_pretrained(config, attn_implementation="sdpa")
        engine = strategy.prepare((model, strategy.create_optimizer(model), None))
        ours = _tokens_per_s(engine.module, prompts)  # as GRPO's rollout calls it
    emit({"model_params": params, "prompts": PROMPTS, "prompt_len": PROMPT_LEN,
          "new_tokens": NEW_TOKENS, "zero_stage": 3, "world_size": 1, "dtype": "bf16",
          "decoding": "greedy, KV cache", "zero3_tokens_per_s": round(ours, 1),
          "bare_model_tokens_per_s": round(bare_rate, 1),
          "zero3_over_bare": round(ours / bare_rate, 3), "ok": ours > 0})


if __name__ == "__main__":
    {"optim": optim, "resume": resume, "rollout": rollout}[sys.argv[1]]()
