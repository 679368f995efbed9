"""Faults in real multi-process jobs: a rank raising, a rank killed (then resumed), a NaN loss."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support.helpers import run_job, script_outcome, torchrun_command
from tests.support.ranks import shm_buffers

SCRIPT = "tests/scripts/fault_train.py"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from strategy.demos.toy_task import make

    root = tmp_path_factory.mktemp("faults")
    make(str(root / "data"), n_train=256, n_test=16)
    return root


def _args(toy, out: str) -> list[str]:
    return [
        "--zero_stage",
        "2",
        "--micro_train_batch_size",
        "8",
        "--train_batch_size",
        "16",
        "--max_len",
        "16",
        "--model_config",
        "configs/tiny_llama.json",
        "--tokenizer",
        f"{toy}/data/tokenizer",
        "--dataset",
        f"{toy}/data/train.jsonl",
        "--learning_rate",
        "1e-3",
        "--max_steps",
        "8",
        "--save_path",
        f"{toy}/{out}/model",
        "--ckpt_path",
        f"{toy}/{out}/ckpt",
        "--log_dir",
        f"{toy}/{out}/logs",
        "--timeout_minutes",
        "1",
    ]


def _job(
    toy, out: str, *flags: str, timeout: float = 180
) -> subprocess.CompletedProcess:
    cmd = torchrun_command(SCRIPT, *_args(toy, out), *flags)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    proc = run_job(cmd, timeout, env=env)  # a hang fails here, its ranks killed
    for path in shm_buffers():  # torchrun sets no LOCAL_SIZE, so there should be none; never leak
        os.unlink(path)
    return proc


@pytest.mark.slow
def test_rank_raising_stops_everyone_and_names_it(toy):
    proc = _job(toy, "raise", "--fault", "raise", "--fault_rank", "1", "--fault_step", "3")
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert "[strategy] rank 1 of 2 failed: ValueError: injected failure on rank 1" in err, err[
        -3000:
    ]
    assert "DONE" not in proc.stdout


@pytest.mark.slow
def test_killed_rank_then_resume_completes(toy, ranks):
    """A launched job whose rank 1 is SIGKILLed stops; the resume (in the long-lived ranks: the
    kill is what needs the launcher) continues from its last checkpoint to the end."""
    proc = _job(
        toy,
        "kill",
        "--fault",
        "kill",
        "--fault_rank",
        "1",
        "--fault_step",
        "6",
        "--save_steps",
        "2",
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "DONE" not in proc.stdout
    ckpts = sorted(os.listdir(toy / "kill" / "ckpt"))
    assert "global_step4" in ckpts and "global_step6" not in ckpts, ckpts
    metrics = toy / "kill" / "logs" / "metrics.jsonl"
    before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    flags = [*_args(toy, "kill"), "--save_steps", "2", "--logging_steps", "1", "--load_checkpoint"]
    assert ranks.run(script_outcome, SCRIPT, flags) == ["", ""]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()[before:]]
    assert [r["step"] for r in rows if "train/loss" in r] == [5, 6, 7, 8]  # resumed at step 4
    assert (toy / "kill" / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_and_rank_0_names_the_step(toy, ranks):
    """Only rank 1's loss turns NaN: the step's loss is reduced over ranks before the check, so
    rank 0 stops too (no hang in its next collective) and says which step. (In the long-lived
    ranks: how a launched job reports a rank's error is the raising test's.)"""
    flags = [*_args(toy, "nan"), "--fault", "nan", "--fault_rank", "1", "--fault_step", "3"]
    want = "NonFiniteLossError: non-finite training loss (nan) at step 3"
    assert [want in got for got in ranks.run(script_outcome, SCRIPT, flags)] == [True, True]


@pytest.mark.gpu
@pytest.mark.slow
def test_fp16_overflow_steps_are_skipped_and_counted(toy):
    """fp16 (GPU only: DeepSpeed has no fp16 training on CPU): an overflowing step is skipped by the
    loss scaler, counted as skipped_steps in the metrics, and training goes on."""
    import json

    proc = _job(
        toy, "fp16", "--fp16", "--no-bf16", "--learning_rate", "1e3", "--logging_steps", "1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(toy / "fp16" / "logs" / "metrics.jsonl")]
    skipped = [r["train/skipped_steps"] for r in rows if "train/skipped_steps" in r]
    assert skipped and skipped[-1] >= 1, skipped
