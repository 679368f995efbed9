"""Shared pieces of test bodies that run inside the ranks."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Callable

import torch


def gathered_state(engine) -> dict[str, torch.Tensor]:
    """Full fp32 copies of every parameter on every rank (ZeRO-3 partitions gathered)."""
    import deepspeed

    module = getattr(engine, "module", engine)
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def make_strategy(
    stage: int = 2,
    bf16: bool = False,
    offload: bool = False,
    micro: int = 2,
    total: int = 8,
    lr: float = 1e-2,
    l2: float = 0.1,
    optimizer: str = "fused_adam",
    **kw,
):
    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig

    overrides = (
        {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else {}
    )
    cfg = StrategyConfig(
        zero_stage=stage,
        bf16=bf16,
        adam_offload=offload,
        micro_train_batch_size=micro,
        train_batch_size=total,
        max_norm=1.0,
        seed=1,
        ds_config_overrides=overrides,
        **kw,
    )
    strategy = DeepSpeedStrategy(
        cfg, OptimConfig(learning_rate=lr, l2=l2, lr_warmup_ratio=0.25, optimizer=optimizer)
    )
    strategy.setup_distributed()
    return strategy


def load_script(path: str, run_name: str | None = None) -> dict:
    """The globals of the script at ``path`` (relative to the repository), loaded by path
    (examples and test scripts are scripts, not a package)."""
    import runpy
    from pathlib import Path

    full = Path(__file__).resolve().parents[2] / path
    return runpy.run_path(str(full), run_name=run_name or f"script_{full.stem}")


def script_outcome(path: str, flags: list[str]) -> str:
    """Run the script at ``path``'s ``main(flags)`` here (e.g. in a rank of the ``ranks`` pool):
    "" when it finishes, ``"<ErrorType>: <message>"`` when it stops with one of our errors (a
    refusal, a non-finite loss); the pool stays up either way."""
    from strategy.errors import StrategyError

    try:
        load_script(path)["main"](flags)
    except StrategyError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def load_example_module(name: str) -> dict:
    """The globals of a trainer's command (``train_sft``: ``strategy.cli.train_sft``), of the
    default run (``train_default``: ``strategy.demos.train_default``), or of
    ``examples/<name>.py``."""
    import importlib
    import importlib.util

    for package in ("strategy.cli", "strategy.demos"):
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            return vars(importlib.import_module(f"{package}.{name}"))
    return load_script(f"examples/{name}.py", run_name=f"example_{name}")


def load_example(name: str):
    """The ``main`` of ``load_example_module(name)``."""
    return load_example_module(name)["main"]


def forbid_process_group(monkeypatch, world_size: int | None = 2) -> None:
    """Any start of a process group fails the test: the checks under test must come before it.
    ``world_size``: what the launcher's environment says (None: leave it)."""
    import deepspeed

    def reached(*args, **kwargs):
        raise AssertionError("init_distributed was reached")

    monkeypatch.setattr(deepspeed, "init_distributed", reached)
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))


def torchrun_command(script: str, *args: str, port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` at 2 ranks on this machine."""
    import sys

    from strategy.dist import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--log-dir", os.devnull,  # else a torchelastic_* folder in the temp root each job
            "--master_port", str(port or free_port()), script, *args]


def run_job(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a process group of its own: on
    ``timeout`` every process of the job (a launcher's ranks too) is killed, then the test fails
    naming the command and the output's tail, instead of leaving ranks behind."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # held open by a process outside the group: left over
            stdout, stderr = "", ("its output is still held open by a process outside its "
                                  "process group (one of the job's, left behind)")
        raise AssertionError(f"{' '.join(map(str, cmd[:6]))}... still running after {timeout} s "
                             f"(killed with its process group):\n{(stdout + stderr)[-3000:]}"
                             ) from None
    finally:
        kill_group(proc)  # a launcher that returned may leave ranks behind
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def side_by_side(*jobs: Callable[[], Any]) -> list[Any]:
    """Each of ``jobs`` (a call that runs a job and returns its outcome) at once, in a thread of
    its own; their outcomes in order. Two jobs that each leave a core idle much of the time (a
    Ray job's start, a launcher's ranks waiting on each other) take little more than the longer
    one on 2 cores. An exception in one is raised after both ended."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [future.result() for future in futures]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process in ``proc``'s process group (started with ``start_new_session``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def save_tiny_llama(tokenizer, path) -> None:
    """A fresh tiny LLaMA (``configs/tiny_llama.json`` sized to ``tokenizer``, torch seed 0) and
    the tokenizer, saved in ``path``: a ``--pretrain`` directory for runs."""
    from transformers import AutoModelForCausalLM

    from strategy.trainers.run import hf_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama.json", tokenizer)
                                     ).save_pretrained(path)
    tokenizer.save_pretrained(path)


def toy_root(root, n_train: int, n_test: int, model_dir: str):
    """The toy reversal task's data in ``root/data`` and ``save_tiny_llama`` in
    ``root/model_dir``; returns the task's tokenizer."""
    from transformers import AutoTokenizer

    from strategy.demos.toy_task import make

    make(str(root / "data"), n_train=n_train, n_test=n_test)
    tokenizer = AutoTokenizer.from_pretrained(str(root / "data" / "tokenizer"))
    save_tiny_llama(tokenizer, root / model_dir)
    return tokenizer
