"""Preference methods side by side on the toy task, from the same SFT start, the same steps.

    SKIP_SETUP=1 bash examples/run_default.sh           # the SFT start and the pairs
    python benchmarks/bench_preference.py accuracy [--steps 40]
    python benchmarks/bench_preference.py memory [--hidden 512 --layers 8]

``accuracy``: each method's shipped config (DPO sigmoid and IPO, ORPO, SimPO, KTO) runs at 2 ranks
(torchrun) for ``--steps`` optimizer steps from ``outputs/default/model``; each export is then
reloaded in this process and scored on the held-out pairs and words alike: pair accuracy (the
mean per-token log-prob of the chosen response above the rejected one's), implicit-reward accuracy
(the summed log-prob gain over the SFT start larger for the chosen response: DPO's own measure) and
greedy exact match on the held-out words. The SFT start is scored the same way.

``memory``: DPO (a reference engine) and SimPO (none) on the same fresh LLaMA, same batch, 3 steps
each at ZeRO-2 on 2 ranks, alternating for ``--rounds``; the peak memory each run logs (max over
ranks of the process peak: RSS on CPU) and its ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = {  # name: (example, config, extra flags)
    "dpo": ("train_dpo", "configs/dpo_zero3.yaml", []),
    "dpo-ipo": ("train_dpo", "configs/dpo_zero3.yaml", ["--ipo"]),
    "orpo": ("train_orpo", "configs/orpo_zero2.yaml", []),
    "simpo": ("train_simpo", "configs/simpo_zero3.yaml", []),
    "kto": ("train_kto", "configs/kto_zero3.yaml", []),
}


def _torchrun(example: str, *flags: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", os.environ.get("MASTER_PORT", "29567"),
               "-m", f"strategy.cli.{example}", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{example} failed:\n{proc.stderr[-3000:]}")


@torch.no_grad()
def _logps(model, tok, prompt: str, response: str) -> tuple[float, int]:
    """Summed log-prob of the response (and its EOS) after the prompt, and its token count."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([p + r])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    picked = logp[torch.arange(len(p) - 1, len(p) + len(r) - 1), torch.tensor(r)]
    return float(picked.sum()), len(r)


def score(model_dir: str, data: str, start: dict | None) -> dict:
    """Pair accuracy, implicit-reward accuracy over ``start`` (per-pair summed log-probs of the
    SFT start) and greedy exact match of one export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strategy.demos.toy_task import generate

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs = [json.loads(line) for line in open(f"{data}/pairs_test.jsonl")]
    sums, mean_wins, gain_wins = [], 0, 0
    for i, pair in enumerate(pairs):
        (c, nc), (r, nr) = (_logps(model, tok, pair["prompt"], pair[k])
                            for k in ("chosen", "rejected"))
        sums.append((c, r))
        mean_wins += c / nc > r / nr
        if start is not None:
            gain_wins += (c - start[i][0]) > (r - start[i][1])
    words = [json.loads(line) for line in open(f"{data}/test.jsonl")]
    answers = generate(model, tok, [w["input"] for w in words])
    exact = sum(a == w["output"] for a, w in zip(answers, words)) / len(words)
    return {"pair_accuracy": mean_wins / len(pairs),
            "implicit_reward_accuracy": gain_wins / len(pairs) if start else None,
            "exact_match": exact, "sums": sums}


def accuracy(args: argparse.Namespace) -> None:
    data, start_dir = f"{ROOT}/outputs/default/data", f"{ROOT}/outputs/default/model"
    if not os.path.isdir(start_dir):
        sys.exit("no SFT start: run `SKIP_SETUP=1 bash examples/run_default.sh` first")
    start = score(start_dir, data, None)
    print(f"{'SFT start':<10} pair acc {start['pair_accuracy']:.1%}  exact match "
          f"{start['exact_match']:.1%}", flush=True)
    out = tempfile.mkdtemp(prefix="bench_pref_")
    for name in args.methods.split(","):
        example, config, extra = METHODS[name]
        path = f"{out}/{name}"
        _torchrun(example, "--config", config, "--max_steps", str(args.steps), "--save_path",
                  f"{path}/model", "--ckpt_path", f"{path}/ckpt", "--log_dir", f"{path}/logs",
                  *extra)
        got = score(f"{path}/model", data, start["sums"])
        evals = [json.loads(line) for line in open(f"{path}/logs/metrics.jsonl")]
        own = {k: v for k, v in evals[-1].items() if k.startswith("eval/")}
        print(f"{name:<10} pair acc {got['pair_accuracy']:.1%}  implicit-reward acc "
              f"{got['implicit_reward_accuracy']:.1%}  exact match {got['exact_match']:.1%}  "
              f"(own eval: {json.dumps({k: round(v, 4) for k, v in own.items()})})", flush=True)


def memory(args: argparse.Namespace) -> None:
    config = json.load(open(f"{ROOT}/configs/tiny_llama.json"))
    config.update(hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                  num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8)
    out = tempfile.mkdtemp(prefix="bench_pref_mem_")
    with open(f"{out}/model.json", "w") as fh:
        json.dump(config, fh)
    data = f"{ROOT}/outputs/default/data"
    peaks: dict[str, list[float]] = {"dpo": [], "simpo": []}
    for round_ in range(args.rounds):
        order = ["dpo", "simpo"] if round_ % 2 == 0 else ["simpo", "dpo"]
        for name in order:
            example = "train_dpo" if name == "dpo" else "train_simpo"
            path = f"{out}/{name}{round_}"
            _torchrun(example, "--model_config", f"{out}/model.json", "--tokenizer",
                      f"{data}/tokenizer", "--dataset", f"{data}/pairs_train.jsonl",
                      "--zero_stage", "2", "--micro_train_batch_size", "4",
                      "--train_batch_size", "8", "--max_len", "16", "--max_steps", "3",
                      "--logging_steps", "1", "--save_path", f"{path}/model", "--log_dir",
                      f"{path}/logs")
            rows = [json.loads(line) for line in open(f"{path}/logs/metrics.jsonl")]
            peaks[name].append(max(r["train/peak_mem_gb"] for r in rows if
                                   "train/peak_mem_gb" in r))
    for name, values in peaks.items():
        print(f"{name:<6} peak {statistics.median(values):.3f} GB (range {min(values):.3f}-"
              f"{max(values):.3f}, {len(values)} runs)")
    print(f"SimPO / DPO peak memory: "
          f"{statistics.median(peaks['simpo']) / statistics.median(peaks['dpo']):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--steps", type=int, default=40)
    acc.add_argument("--methods", default=",".join(METHODS))
    mem = sub.add_parser("memory")
    mem.add_argument("--hidden", type=int, default=512)
    mem.add_argument("--layers", type=int, default=8)
    mem.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    {"accuracy": accuracy, "memory": memory}[args.cmd](args)


if __name__ == "__main__":
    main()
