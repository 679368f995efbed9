"""A generation ahead that takes new weights mid-way (partial rollouts), on one vLLM engine
spanning 2 ranks, against transformers' greedy tokens and log-probs (for tests/test_vllm.py).

torchrun --nproc_per_node 2 tests/scripts/vllm_partial.py MODEL_DIR OUT.json STEPS

The engine, synced to the model's weights W0, starts generating held prompts greedily on a
thread of its own (``start_generate``); each rank's engine waits inside its engine step STEPS
(the main thread waits until it is there) until ``sync_in_flight`` has asked it to stop, so
the stop falls right after that step on both ranks; the policy's weights then move to W1 and
``sync_in_flight`` streams them in; the generation goes on. Rank 0 writes OUT.json: each
row's prompt, tokens and log-probs, the ``late`` count, and transformers' greedy tokens and
log-probs under W0 and (after the first STEPS tokens) W1.
"""

import json
import sys
import threading
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from strategy import DeepSpeedStrategy, StrategyConfig
from strategy.rollout.config import RolloutConfig

NEW = 12  # tokens per row (no end token: every row has them all)


def held_at(rollouts, steps: int) -> threading.Event:
    """The engine's ``steps``-th step waits until a sync in flight asked the generation to
    stop (which then comes right after that step); the event is set once it waits."""
    engine, calls, there = rollouts.llm.llm_engine, [], threading.Event()
    real = engine.step

    def step():
        calls.append(1)
        if len(calls) == steps:
            there.set()
            deadline = time.monotonic() + 120
            while rollouts._gate._stop_at is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return real()

    engine.step = step
    return there


def greedy(model, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their log-probs."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    logps = [torch.log_softmax(score[0].float(), -1)[t].item()
             for score, t in zip(out.scores, tokens)]
    return tokens, logps


def main() -> None:
    model_dir, out_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tok = AutoTokenizer.from_pretrained(model_dir)
    strategy = DeepSpeedStrategy(StrategyConfig(zero_stage=2, micro_train_batch_size=2,
                                                train_batch_size=4, seed=3))
    strategy.setup_distributed()
    model = strategy.from_pretrained(model_dir)
    engine, _, _ = strategy.prepare((model, strategy.create_optimizer(model, lr=1e-3), None))
    rollout = RolloutConfig(rollout_engine="vllm", vllm_enforce_eager=True, vllm_timeout=120,
                            vllm_tensor_parallel_size=2, async_rollouts=1, partial_rollouts=True)
    rollouts = strategy.rollout_engine(engine, rollout=rollout, max_model_len=64)
    rollouts.sync()
    texts = [["12 7 3", "5 5 1 9"], ["8 2", "4 4 4 6 1"]][strategy.rank]  # lengths differ
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    there = held_at(rollouts, steps)
    ahead = rollouts.start_generate(batch["input_ids"], batch["attention_mask"], GenerationConfig(
        max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id))
    w0 = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    torch.manual_seed(11)  # W1: the same on both ranks
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert there.wait(120), "the generation never reached its step"
    rollouts.sync_in_flight()
    out, logprobs = ahead.wait()
    rows = {"prompt": [], "tokens": [], "logprobs": logprobs, "late": rollouts.late}
    for ids, mask, full in zip(batch["input_ids"], batch["attention_mask"], out):
        rows["prompt"].append(ids[mask.bool()].tolist())
        rows["tokens"].append(full[batch["input_ids"].shape[1]:].tolist())
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, rows)
    if strategy.rank == 0:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        w1 = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        result = {"ranks": gathered, "w0": [], "w1": []}
        for part in gathered:
            for prompt, tokens in zip(part["prompt"], part["tokens"]):
                hf.load_state_dict(w0)
                result["w0"].append(greedy(hf, prompt, NEW))
                hf.load_state_dict(w1)  # W1's continuation of what W0 sampled first
                result["w1"].append(greedy(hf, prompt + tokens[:steps], NEW - steps))
        with open(out_path, "w") as f:
            json.dump(result, f)
    strategy.close()


if __name__ == "__main__":
    main()
