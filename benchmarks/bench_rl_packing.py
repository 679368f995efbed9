"""GRPO/PPO's update forwards on rollouts of very different lengths, three ways: one update
micro-batch's policy forward + backward and reference forward through ``token_logps``, per row
(prompt + completion, right-padded, sdpa), padding-free (``--packing_samples``: one packed row,
``sdpa_varlen``) and prompt-shared (``--shared_prompt_forward``, the default: each group's prompt
once, its completions on that prompt's KV cache, sdpa), in one process.

python benchmarks/bench_rl_packing.py [--rounds 5] [--rows 16] [--group 8] [--prompt 64] \
    [--longest 512]

The three ways take the same micro-batch (``--rows`` completions in groups of ``--group`` that
share a ``--prompt``-token prompt, as a GRPO micro-batch's do, completion lengths drawn uniformly
from 1 to ``--longest``: what reasoning rollouts look like), the same model (bench_long's: LLaMA,
hidden 256, 4 layers, vocabulary 32000, fp32) and weights, the same loss; each way warms up once,
then they alternate, the order rotating every round. Every round checks the ways' log-probs agree
(1e-4). Figure: useful (completion and prompt, non-padding) tokens per second of the whole update
(policy forward and backward plus the reference forward), median [min-max] over rounds, and each
way / per row, round by round. Also printed: a long-prompt shape (512-token prompts, completions
of 1-128: few-shot or retrieved context), and the toy GRPO example's shape (``--prompt 12
--longest 14``), where the padding is small and the per-sample attention calls cost about what
they save.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_grpo import spread  # median [min-max], as bench_grpo prints it

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 32000, "max_position_embeddings": 4096}


def micro_batch(rows: int, group: int, prompt: int, longest: int, seed: int) -> dict:
    """A right-padded GRPO micro-batch: runs of ``group`` rows sharing a ``prompt``-token prompt,
    completions of 1 to ``longest`` tokens, labels on the completions only."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (rows,), generator=g).tolist()
    width = prompt + max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), -100)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if row % group == 0:
            shared = torch.randint(3, MODEL["vocab_size"], (prompt,), generator=g)
        ids[row, :prompt] = shared
        ids[row, prompt:prompt + n] = torch.randint(3, MODEL["vocab_size"], (n,), generator=g)
        labels[row, prompt:prompt + n] = ids[row, prompt:prompt + n]
        mask[row, :prompt + n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def three_ways(batch: dict, prompt: int) -> dict[str, dict]:
    """The batch as each way forwards it."""
    from strategy.trainers.losses import padding_free, shared_prompts

    real = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    keys = shared_prompts([r[:prompt] for r in real], [r[prompt:] for r in real], pad=0)
    return {"per_row": batch, "packed": {**batch, **padding_free(batch["input_ids"],
                                                                  batch["attention_mask"])},
            "shared": {**batch, **keys}}


def update_seconds(policy, reference, batch: dict) -> tuple[float, torch.Tensor]:
    from strategy.trainers.losses import token_logps

    start = time.perf_counter()
    with torch.no_grad():
        token_logps(reference, batch, 0.7)
    logp, mask = token_logps(policy, batch, 0.7)
    (logp.sum() / mask.sum()).backward()
    policy.zero_grad(set_to_none=True)
    return time.perf_counter() - start, logp.detach()


def measure(args, prompt: int, longest: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    import strategy  # noqa: F401  registers sdpa_varlen

    config = AutoConfig.for_model(**MODEL)
    torch.manual_seed(0)
    models = {way: AutoModelForCausalLM.from_config(config, attn_implementation=impl)
              for way, impl in (("per_row", "sdpa"), ("packed", "sdpa_varlen"),
                                ("shared", "sdpa"))}
    for way in ("packed", "shared"):
        models[way].load_state_dict(models["per_row"].state_dict())
    batch = micro_batch(args.rows, args.group, prompt, longest, seed=1)
    batches = three_ways(batch, prompt)
    useful = int(batch["attention_mask"].sum())
    ways = list(models)
    times: dict[str, list[float]] = {way: [] for way in ways}
    for index in range(args.rounds + 1):  # round 0 warms every way up
        logps = {}
        for way in ways[index % 3:] + ways[:index % 3]:
            seconds, logps[way] = update_seconds(models[way], models[way], batches[way])
            if index:
                times[way].append(seconds)
        for way in ("packed", "shared"):
            torch.testing.assert_close(logps[way], logps["per_row"], rtol=1e-4, atol=1e-4)
    rates = {way: [useful / s for s in values] for way, values in times.items()}
    ratios = {way: [p / q for p, q in zip(times["per_row"], times[way])]
              for way in ("packed", "shared")}
    return {"useful": useful, "positions": batch["input_ids"].numel(), "rates": rates,
            "ratios": ratios}


def show(name: str, result: dict) -> None:
    share = 1 - result["useful"] / result["positions"]
    print(f"{name}: {result['useful']} tokens in {result['positions']} padded positions "
          f"({share:.0%} padding); useful tokens/s of the update:")
    for way, values in result["rates"].items():
        print(f"  {way:<8} {spread(values, '.0f')}")
    for way, ratios in result["ratios"].items():
        print(f"  {way} / per_row per round: median {spread(ratios, '.2f')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--group", type=int, default=8, help="rows sharing one prompt")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--longest", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lot = f"{args.rows} completions in groups of {args.group}"
    show(f"{lot}, 1-{args.longest} tokens after a {args.prompt}-token prompt",
         measure(args, args.prompt, args.longest))
    show(f"long prompts ({lot}, 1-128 tokens after a 512-token prompt)", measure(args, 512, 128))
    show(f"the toy GRPO example's shape ({lot}, 1-14 tokens, 12-token prompts)",
         measure(args, 12, 14))


if __name__ == "__main__":
    main()
