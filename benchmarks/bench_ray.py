"""GRPO with vLLM rollouts, four ways on the same work: the torchrun path (2 ranks, an engine
colocated in each: under torchrun engines apart from training are refused, they are Ray actors);
on Ray with the same layout (``ray_colocated``: ``--train.colocate_all``, an engine actor in
each rank's bundle, one node), the like-for-like side; and on Ray with one engine apart, on one
node and on two simulated nodes (``python -m strategy.cli.train_ppo_ray``: the 2 ranks and the
engine Ray actors; on two nodes the ranks on one, the engine on the other), where one engine
generates what two do on the other sides. What Ray costs, and where.

python benchmarks/bench_ray.py [--steps 10] [--skip 3] [--rounds 3] [--out /tmp/bench_ray] \
    [--sides torchrun,ray_colocated,ray_one_node,ray_two_nodes] \
    [--results benchmarks/results/ray.json]

The same toy GRPO on every side: the toy reversal data (``python -m strategy.demos.toy_task make``),
a fresh tiny Llama (configs/tiny_llama.json, torch seed 0; policy and reference) at ZeRO-3,
configs/grpo_toy.yaml's batch (16 prompts x group size 8 = 128 completions per optimizer step, 14
new tokens, temperature 0.5), its KL reference in the ranks, the engine eager
(``--vllm_enforce_eager``), seed 42, no evaluation, no checkpoint, the export at the end. Per run,
from its ``metrics.jsonl`` (``--logging_steps 1``): seconds per step (``train/step_time``: rollout,
scoring, reference forward and update; the first ``--skip`` steps left out) and the weight sync's
seconds (``train/weight_sync_s``); the job's wall seconds; the peak RSS of the driver process
(polled every 0.2 s: torchrun's agent on the torchrun side, the Ray driver on the others). On the
Ray sides the cluster (``ray.cluster_utils.Cluster``, logical GPUs on this CPU machine; each node 4
CPUs) is started fresh each round, timed on its own and left out of the job's figures, and shut down
after it. The sides' order rotates every round.

Each figure is written to ``--results`` (figure, value, range, rounds, date, commit, machine):
the median over rounds and its range; ratios are per round (Ray's steps/s over torchrun's in the
same round), then their median and range. Goal (issue 52): Ray on one node >= 0.9x the torchrun
path's steps/s on the same work: ``ray_colocated``'s ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import commit_measured, measured, row  # noqa: E402 - the benchmarks' own helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("torchrun", "ray_colocated", "ray_one_node", "ray_two_nodes")
NODES = {"ray_colocated": [2], "ray_one_node": [3],  # logical GPUs per simulated node
         "ray_two_nodes": [2, 2]}
PLACEMENT = {"ray_colocated": ["--vllm.num_engines", "2", "--train.colocate_all"],
             "ray_one_node": ["--vllm.num_engines", "1"],
             "ray_two_nodes": ["--vllm.num_engines", "1"]}


def flags(args, side: str) -> list[str]:
    """The job's flags, alike on every side (the engine's placement aside)."""
    out, data = os.path.join(args.out, side), os.path.join(args.out, "data")
    return ["--config", os.path.join(REPO, "configs", "grpo_toy.yaml"),
            "--pretrain", os.path.join(args.out, "init"),
            "--dataset", os.path.join(data, "train.jsonl"), "--eval_dataset", "none",
            "--zero_stage", "3", "--rollout_engine", "vllm", "--vllm_enforce_eager",
            "--max_steps", str(args.steps), "--logging_steps", "1", "--eval_steps", "-1",
            "--save_steps", "-1", "--seed", "42", "--save_path", os.path.join(out, "model"),
            "--ckpt_path", os.path.join(out, "ckpt"), "--log_dir", os.path.join(out, "logs")]


def command(args, side: str) -> list[str]:
    if side == "torchrun":
        from strategy.dist import free_port

        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--log-dir", os.devnull, "--master_port", str(free_port()),
                "-m", "strategy.cli.train_grpo", *flags(args, side)]
    return [sys.executable, "-m", "strategy.cli.train_ppo_ray", "--actor.num_nodes", "1",
            "--actor.num_gpus_per_node", "2", *PLACEMENT[side],
            "--algo.advantage.estimator", "group_norm", *flags(args, side)]


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return 0.0


def run_job(cmd: list[str], env: dict, log: str, timeout: float) -> tuple[float, float]:
    """``cmd`` in a process group of its own, output to ``log``: wall seconds and the driver's
    peak RSS (MB). Killed with its group on a timeout, an error or Ctrl-C."""
    start, peak = time.perf_counter(), 0.0
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                peak = max(peak, rss_mb(proc.pid))
                if time.perf_counter() - start > timeout:
                    raise SystemExit(f"still running after {timeout:.0f} s: {' '.join(cmd)} "
                                     f"(log: {log})")
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    if proc.returncode != 0:
        tail = open(log).read()[-3000:]
        raise SystemExit(f"{tail}\nfailed ({proc.returncode}): {' '.join(cmd)} (log: {log})")
    return time.perf_counter() - start, peak


class SimulatedCluster:
    """``ray.cluster_utils.Cluster`` with ``gpus`` logical GPUs per node (4 CPUs each), its
    session files in a folder of its own (removed after); ``seconds`` it took to start."""

    def __init__(self, gpus: list[int]) -> None:
        from ray.cluster_utils import Cluster

        self.temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
        self.notes = os.path.join(tempfile.gettempdir(), "ray")  # Ray notes the address there
        self.made_notes = not os.path.isdir(self.notes)
        os.makedirs(self.notes, exist_ok=True)
        start = time.perf_counter()
        self.nodes = Cluster()
        for i, count in enumerate(gpus):
            extra = {"temp_dir": self.temp, "include_dashboard": False} if i == 0 else {}
            self.nodes.add_node(num_cpus=4, num_gpus=count, **extra)
        self.nodes.wait_for_nodes()
        self.seconds = time.perf_counter() - start

    def close(self) -> None:
        self.nodes.shutdown()
        shutil.rmtree(self.temp, ignore_errors=True)
        if self.made_notes:
            shutil.rmtree(self.notes, ignore_errors=True)


def figures(logs: str, skip: int) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(logs, "metrics.jsonl"))]
    steps = [r for r in rows if "train/step_time" in r]
    if len(steps) <= skip:
        raise SystemExit(f"{logs}/metrics.jsonl has {len(steps)} steps; --skip {skip} leaves none")
    syncs = [r["train/weight_sync_s"] for r in steps[skip:] if "train/weight_sync_s" in r]
    step_s = statistics.median(r["train/step_time"] for r in steps[skip:])
    return {"steps_per_s": 1.0 / step_s, "step_s": step_s,
            "weight_sync_s": statistics.median(syncs) if syncs else float("nan")}


def run_side(args, side: str, rnd: int) -> dict:
    out = os.path.join(args.out, side)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    env.pop("RAY_ADDRESS", None)
    cluster = SimulatedCluster(NODES[side]) if side in NODES else None
    try:
        if cluster is not None:
            env["RAY_ADDRESS"] = cluster.nodes.address
        wall, rss = run_job(command(args, side), env, os.path.join(out, f"r{rnd}.log"),
                            args.timeout)
    finally:
        if cluster is not None:
            cluster.close()
    result = {**figures(os.path.join(out, "logs"), args.skip), "job_s": wall,
              "driver_rss_mb": rss}
    if cluster is not None:
        result["cluster_start_s"] = cluster.seconds
    return result


def report(args, results: dict[str, list[dict]]) -> list[dict]:
    commit = commit_measured(REPO)
    command = "python benchmarks/bench_ray.py " + " ".join(sys.argv[1:])
    units = {"steps_per_s": "steps/s", "step_s": "s", "weight_sync_s": "s", "job_s": "s",
             "driver_rss_mb": "MB", "cluster_start_s": "s"}
    rows = []
    for side, runs in results.items():
        for key, unit in units.items():
            if key in runs[0]:
                rows.append(row(f"{side}.{key}", [r[key] for r in runs], unit, command, commit))
    if "torchrun" in results:
        for side in [s for s in results if s != "torchrun"]:
            ratios = [r["steps_per_s"] / t["steps_per_s"]
                      for r, t in zip(results[side], results["torchrun"])]
            rows.append(row(f"{side}.steps_per_s_vs_torchrun", ratios, "x (per round)",
                            command, commit))
    return rows


def save_fresh_model(data: str, path: str) -> None:
    """configs/tiny_llama.json sized to the toy tokenizer, torch seed 0, saved with it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strategy.trainers.run import hf_config

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(data, "tokenizer"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config(os.path.join(REPO, "configs", "tiny_llama.json"),
                                               tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)


def stopped(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def markdown(rows: list[dict]) -> str:
    """The results as docs/benchmarks.md's Ray table (tests/test_benchmark_figures.py checks the
    page against the file)."""
    by = {r["figure"]: r for r in rows}
    first = rows[0]
    lines = [f"{measured(first)}, {first['rounds']} rounds; median [range]:", "",
             "| side | steps/s | weight sync s | job s | driver RSS MB | cluster start s | "
             "steps/s vs torchrun (per round) |", "| --- | --- | --- | --- | --- | --- | --- |"]

    def cell(key: str, fmt: str) -> str:
        r = by.get(key)
        if r is None:
            return "-"
        return f"{r['value']:{fmt}} [{r['range'][0]:{fmt}}-{r['range'][1]:{fmt}}]"

    for side in SIDES:
        if f"{side}.steps_per_s" in by:
            lines.append(f"| {side} | {cell(side + '.steps_per_s', '.2f')} | "
                         f"{cell(side + '.weight_sync_s', '.3f')} | {cell(side + '.job_s', '.0f')}"
                         f" | {cell(side + '.driver_rss_mb', '.0f')} | "
                         f"{cell(side + '.cluster_start_s', '.1f')} | "
                         f"{cell(side + '.steps_per_s_vs_torchrun', '.2f')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="/tmp/bench_ray", help="data and runs")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results",
                                                          "ray.json"))
    parser.add_argument("--table", action="store_true",
                        help="print --results as docs/benchmarks.md's table, run nothing")
    args = parser.parse_args()
    if args.table:
        with open(args.results) as fh:
            return print(markdown(json.load(fh)), end="")
    signal.signal(signal.SIGTERM, stopped)  # a killed benchmark still ends its jobs and clusters
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        raise SystemExit(f"--sides {args.sides!r}: use a comma-separated list of "
                         + ", ".join(SIDES))
    args.out = os.path.abspath(args.out)
    data = os.path.join(args.out, "data")
    if not os.path.exists(os.path.join(data, "train.jsonl")):
        subprocess.run([sys.executable, "-m", "strategy.demos.toy_task", "make", data, "--hard"],
                       cwd=REPO, check=True, capture_output=True)
    if not os.path.exists(os.path.join(args.out, "init", "config.json")):
        save_fresh_model(data, os.path.join(args.out, "init"))
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for rnd in range(args.rounds):
        for side in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
            results[side].append(run_side(args, side, rnd))
            print(f"round {rnd + 1} {side}: " + json.dumps(
                {k: round(v, 3) for k, v in results[side][-1].items()}), flush=True)
    rows = report(args, results)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as fh:
        json.dump(rows, fh, indent=1)
    for r in rows:
        print(f"{r['figure']:42s} {r['value']:10.4g} {r['unit']:14s} "
              f"[{r['range'][0]:.4g}-{r['range'][1]:.4g}] over {r['rounds']}")
    print(f"written to {args.results}")


if __name__ == "__main__":
    main()
