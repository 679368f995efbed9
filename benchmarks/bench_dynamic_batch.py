"""Micro-batches by a token budget (``--dynamic_batch --max_tokens_per_gpu``) against micro-batches
of a row count (``--micro_train_batch_size``), on one optimizer step's rows of very different
lengths: the step's policy forwards and backwards (``token_logps``, loss over the step's tokens),
in one process.

python benchmarks/bench_dynamic_batch.py [--rounds 5] [--rows 32] [--micro 8] [--prompt 64] \
    [--longest 512] [--results benchmarks/results/dynamic_batch.json]
python benchmarks/bench_dynamic_batch.py --docs   # docs/benchmarks.md's block, from --results

Both take the same rows (``--rows`` completions in groups of 8 that share a ``--prompt``-token
prompt, in that order, as a rank's step of a GRPO rollout; completion lengths drawn uniformly
from 1 to ``--longest``, then skewed: 1 + longest x u^4, most short and a few long, as reasoning
rollouts' often are), the same model (bench_rl_packing's: LLaMA, hidden 256, 4 layers,
vocabulary 32000, fp32) and weights. Count-based: micro-batches of ``--micro`` rows in order.
Token budget: the step cut by ``token_budget.budget_bounds`` with a budget of what a count-based
micro-batch may hold at most (``--micro`` x the longest row's tokens): the same memory ceiling.
Each shape twice: padded forwards (sdpa; a micro-batch's tokens are rows x its longest) and
padding-free ones (``--packing_samples``, sdpa_varlen; the sum of lengths). Each warms up once,
then they alternate, the order swapping every round; every round checks both give the same gradient
(1e-4). Figure: useful (non-padding) tokens per second of the step, median [min-max] over rounds,
and budget / count round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rl_packing import MODEL  # noqa: E402 - the same model as the packing benchmark
from figures import (  # noqa: E402 - the benchmarks' own
    commit_measured,
    measured,
    row,
    span,
    write_rows,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "dynamic_batch.json")
WAYS = ("count", "budget")
SHAPES = [(shape, mode) for shape in ("uniform", "skewed") for mode in ("padded", "packed")]


def step_rows(rows: int, prompt: int, longest: int, shape: str,
              seed: int) -> tuple[list, list]:
    """Prompts (shared by runs of 8 rows) and completions of 1 to ``longest`` tokens: uniform,
    or ``skewed`` (1 + longest x u^4 for u uniform: most short, a few near the longest)."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for index in range(rows):
        if index % 8 == 0:
            shared = torch.randint(3, MODEL["vocab_size"], (prompt,), generator=g).tolist()
        u = float(torch.rand(1, generator=g))
        n = 1 + int((longest - 1) * (u if shape == "uniform" else u ** 4))
        prompts.append(shared)
        completions.append(torch.randint(3, MODEL["vocab_size"], (n,), generator=g).tolist())
    return prompts, completions


def micro_batches(prompts: list, completions: list, bounds: list, packed: bool) -> list[dict]:
    from strategy.trainers.algorithms.completions import completion_batch
    from strategy.trainers.losses import padding_free

    out = []
    for first, end in bounds:
        batch = completion_batch(prompts[first:end], completions[first:end], pad=0)
        if packed:
            batch.update(padding_free(batch["input_ids"], batch["attention_mask"]))
        out.append(batch)
    return out


def step_seconds(model, batches: list[dict]) -> tuple[float, torch.Tensor]:
    """One step's forwards and backwards, the loss a mean over the step's scored tokens; the
    seconds and the gradient of the embeddings."""
    from strategy.trainers.losses import token_logps

    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    start = time.perf_counter()
    for batch in batches:
        logp, _ = token_logps(model, batch, 1.0)
        (-logp.sum() / total).backward()
    seconds = time.perf_counter() - start
    grad = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad(set_to_none=True)
    return seconds, grad


def measure(args, shape: str, packed: bool) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    import strategy  # noqa: F401  registers sdpa_varlen
    from strategy.trainers.algorithms.token_budget import budget_bounds, forward_tokens

    config = AutoConfig.for_model(**MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa_varlen" if packed else "sdpa")
    prompts, completions = step_rows(args.rows, args.prompt, args.longest, shape, seed=1)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    budget = forward_tokens([max(lengths)] * args.micro, packed)  # a count micro-batch's most
    counted = [(i, min(i + args.micro, args.rows)) for i in range(0, args.rows, args.micro)]
    cut = [(a, b) for a, b, _ in budget_bounds(lengths, 1, budget, packed)]
    batches = {"count": micro_batches(prompts, completions, counted, packed),
               "budget": micro_batches(prompts, completions, cut, packed)}
    useful = sum(lengths)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for index in range(args.rounds + 1):  # round 0 warms both up
        grads = {}
        for way in (WAYS if index % 2 else WAYS[::-1]):
            seconds, grads[way] = step_seconds(model, batches[way])
            if index:
                times[way].append(seconds)
        torch.testing.assert_close(grads["budget"], grads["count"], rtol=1e-4, atol=1e-6)
    return {"micro_batches": {way: len(b) for way, b in batches.items()}, "budget": budget,
            "rates": {way: [useful / s for s in values] for way, values in times.items()},
            "ratio": [c / b for c, b in zip(times["count"], times["budget"])]}


def docs(rows: list[dict]) -> str:
    """docs/benchmarks.md's block: tokens/s each way, and the per-round ratio."""
    by = {r["figure"]: r for r in rows}
    first = rows[0]
    lines = [f"{measured(first)}, {first['rounds']} rounds (median [min-max]):", "",
             "| completion lengths | forwards | micro-batches (count / budget) | count-based "
             "tokens/s | token-budget tokens/s | budget / count, per round |",
             "| --- | --- | --- | --- | --- | --- |"]
    for shape, forwards in SHAPES:
        mode = f"{shape}.{forwards}"
        count, budget = by[f"dynamic_batch.{mode}.count_tokens_per_s"], by[
            f"dynamic_batch.{mode}.budget_tokens_per_s"]
        ratio = by[f"dynamic_batch.{mode}.speedup"]
        micro = [by[f"dynamic_batch.{mode}.{way}_micro_batches"]["value"] for way in WAYS]
        lines.append(f"| {shape} | {forwards} | {micro[0]:.0f} / {micro[1]:.0f} | "
                     f"{count['value']:.0f} [{span(count, '.0f')}] | "
                     f"{budget['value']:.0f} [{span(budget, '.0f')}] | "
                     f"{ratio['value']:.2f}x [{span(ratio, '.2f')}] |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8, help="count-based rows per micro-batch")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--longest", type=int, default=512)
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--docs", action="store_true",
                        help="print docs/benchmarks.md's block from --results, run nothing")
    args = parser.parse_args()
    if args.docs:
        with open(args.results) as fh:
            print(docs(json.load(fh)), end="")
        return
    torch.set_num_threads(1)
    commit = commit_measured(REPO)
    command = "python benchmarks/bench_dynamic_batch.py " + " ".join(sys.argv[1:])
    rows = []
    for shape, mode in SHAPES:
        result = measure(args, shape, packed=mode == "packed")
        mode = f"{shape}.{mode}"
        print(f"{mode}: micro-batches {result['micro_batches']}, budget {result['budget']} "
              f"tokens; tokens/s count {result['rates']['count']}, budget "
              f"{result['rates']['budget']}; budget / count {result['ratio']}", flush=True)
        rows += [row(f"dynamic_batch.{mode}.{way}_tokens_per_s", result["rates"][way],
                     "tokens/s", command, commit) for way in WAYS]
        rows.append(row(f"dynamic_batch.{mode}.speedup", result["ratio"], "x", command, commit))
        rows += [row(f"dynamic_batch.{mode}.{way}_micro_batches", [result["micro_batches"][way]],
                     "", command, commit) for way in WAYS]
    write_rows(args.results, rows)


if __name__ == "__main__":
    main()
