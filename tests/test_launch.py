"""The same script under the deepspeed launcher (one node, and Slurm) and as a plain single process
(torchrun: tests/test_default_run.py, tests/test_faults.py)."""

from __future__ import annotations

import os
import re
import sys

import pytest

from strategy.dist import free_port
from tests.support.helpers import run_job
from tests.support.ranks import shm_buffers

PROBE = "tests/scripts/launch_probe.py"


def _run(cmd: list[str], port: int, timeout: float = 240, extra_env: dict | None = None,
         ) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = run_job(cmd, timeout, env=env)
    # lines may interleave
    pattern = r"RESULT rank=(\d+) world=(\d+) stage=(\d) loss=([\d.]+) shm_left=(True|False)"
    keys = ("rank", "world", "stage", "loss", "shm_left")
    results = [dict(zip(keys, m)) for m in re.findall(pattern, proc.stdout)]
    assert proc.returncode == 0 and results, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    assert not shm_buffers(port), f"left /dev/shm buffers: {shm_buffers(port)}"
    return results


@pytest.mark.slow
def test_deepspeed_launcher_zero3():
    port = free_port()
    bin_dir = os.path.dirname(sys.executable)
    out = _run(
        [
            os.path.join(bin_dir, "deepspeed"),
            "--num_gpus",
            "2",
            "--master_port",
            str(port),
            PROBE,
            "--zero_stage",
            "3",
        ],
        port,
    )
    assert sorted(r["rank"] for r in out) == ["0", "1"] and {r["world"] for r in out} == {"2"}
    assert {r["stage"] for r in out} == {"3"} and {r["shm_left"] for r in out} == {"False"}
    assert len({r["loss"] for r in out}) == 1


@pytest.mark.slow
def test_single_process_without_a_launcher():
    """A plain ``python script.py``: one rank, no launcher variables. (torchrun launches the
    README's main job in tests/test_default_run.py and the fault jobs in tests/test_faults.py.)"""
    env_free = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = run_job([sys.executable, PROBE, "--zero_stage", "1"], 240,
                   env={**env_free, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0 and "RESULT rank=0 world=1 stage=1" in proc.stdout, proc.stderr[
        -3000:
    ]


@pytest.mark.slow
def test_deepspeed_slurm_launcher_with_one_task_per_node(tmp_path):
    """``deepspeed --launcher slurm`` runs ``srun -n 2 ... python script``: each task gets its
    rank from Slurm's variables (a stand-in ``srun`` starts the two tasks here as two nodes)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").symlink_to(os.path.abspath("tests/scripts/fake_srun.py"))
    (bin_dir / "sinfo").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sinfo").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = free_port()
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    out = _run([deepspeed, "--hostfile", str(hostfile), "--launcher", "slurm", "--no_ssh_check",
                "--master_addr", "127.0.0.1", PROBE, "--zero_stage", "2"], port, extra_env=env)
    assert sorted(r["rank"] for r in out) == ["0", "1"] and {r["world"] for r in out} == {"2"}
    assert len({r["loss"] for r in out}) == 1
