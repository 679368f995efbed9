"""Two "nodes" of one rank each on this machine: two deepspeed launchers with ``--no_ssh
--node_rank N`` meeting on the loopback address, as on Kubernetes. Trained, saved, resumed and
exported, they must equal a one-node 2-rank run. Node-local storage: each node launcher runs in
its own mount namespace where the same checkpoint path is a different directory; one node is
killed mid-save and both resume from the newest checkpoint complete on every node. The launches
and the kill use real launchers; resumes and refusals run as two nodes in the long-lived ranks
(``LOCAL_SIZE=1``, each rank's own disk mounted in its own namespace)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from strategy.dist import free_port
from tests.support.helpers import kill_group, run_job, script_outcome

SCRIPT = "tests/scripts/fault_train.py"
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from strategy.demos.toy_task import make

    root = tmp_path_factory.mktemp("nodes")
    make(str(root / "data"), n_train=50, n_test=13)  # 50 rows: 12 steps of 4, 2 rows dropped
    (root / "hostfile").write_text("node-a slots=1\nnode-b slots=1\n")
    return root


def _flags(toy, name: str, stage: int, *extra: str) -> list[str]:
    out = toy / name
    return ["--zero_stage", str(stage), "--micro_train_batch_size", "2",
            "--train_batch_size", "4", "--max_len", "16", "--model_config",
            "configs/tiny_llama.json", "--tokenizer", f"{toy}/data/tokenizer",
            "--dataset", f"{toy}/data/train.jsonl", "--eval_dataset", f"{toy}/data/test.jsonl",
            "--learning_rate", "1e-3", "--max_steps", "6", "--save_steps", "2",
            "--logging_steps", "1", "--seed", "7", "--ckpt_path", f"{out}/ckpt",
            "--save_path", f"{out}/model", "--log_dir", f"{out}/logs",
            "--timeout_minutes", "2", *extra]  # a rank waiting on a killed one gives up


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}


def one_node(flags: list[str]) -> subprocess.CompletedProcess:
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), SCRIPT, *flags]
    return run_job(cmd, TIMEOUT_S, env=_env())


def two_nodes(toy, flags: list[str], private: dict[str, list[str]] | None = None,
              ) -> list[subprocess.CompletedProcess]:
    """One launcher per node; ``private`` maps a path to the per-node directories bind-mounted
    over it, each node in its own mount namespace."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [DEEPSPEED, "--hostfile", str(toy / "hostfile"), "--no_ssh", "--node_rank",
               str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), SCRIPT,
               *flags]
        if private:
            mounts = " && ".join(f"mount --bind {dirs[node]} {path}"
                                 for path, dirs in private.items())
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   f'{mounts} && exec "$@"', "sh", *cmd]
        procs.append(subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    out = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=TIMEOUT_S)
            out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""))
    finally:  # a hang, or ranks a launcher left: both nodes' whole process groups
        for proc in procs:
            kill_group(proc)
    return out


def _ok(*procs: subprocess.CompletedProcess) -> None:
    for proc in procs:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}" \
            f"\n{proc.stderr[-4000:]}"


def _losses(toy, name: str) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (toy / name / "logs" / "metrics.jsonl").open()]
    return {row["step"]: (row["train/loss"], row["train/grad_norm"])
            for row in rows if "train/loss" in row}


def _weights(toy, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(toy / name / "model" / "model.safetensors"))


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:  # 2 ranks: every reduction is one addition, the same in any order
        assert torch.equal(a[key], b[key]), key


def _as_two_nodes(flags: list[str]) -> str:
    """In a rank of the ``ranks`` pool, as one rank of each of two nodes (what the deepspeed
    launcher sets on ``--no_ssh`` nodes of one slot): the script's ``script_outcome``."""
    saved = {k: os.environ.get(k) for k in ("LOCAL_SIZE", "LOCAL_RANK")}
    os.environ.update(LOCAL_SIZE="1", LOCAL_RANK="0")
    try:
        return script_outcome(SCRIPT, flags)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})


def _on_own_disk(flags: list[str], path: str, disks: list[str]) -> str:
    """``_as_two_nodes`` with each rank's own disk at ``path`` (node-local storage)."""
    from tests.support.readonly import own_view

    with own_view(disks[int(os.environ["RANK"])], path):
        return _as_two_nodes(flags)


@pytest.fixture(scope="module")
def reference(toy, ranks):
    """One node, two ranks, ZeRO-2 and ZeRO-3: the runs every other one must equal (the same
    script in the long-lived ranks: one node is what they are)."""
    for stage in (2, 3):
        assert ranks.run(script_outcome, SCRIPT, _flags(toy, f"ref{stage}", stage)) == ["", ""]
    return toy


@pytest.mark.slow
def test_two_nodes_train_save_resume_and_export_like_one_node(reference, ranks):
    """Launched as two nodes (two deepspeed launchers), then resumed, and refused a setting, as
    two nodes in the long-lived ranks (the launch is what the first run shows)."""
    toy = reference
    nodes = two_nodes(toy, _flags(toy, "shared", 2))
    _ok(*nodes)
    assert "shared by all 2 nodes; global rank 0 publishes" in nodes[0].stdout
    assert _losses(toy, "shared") == _losses(toy, "ref2")
    _assert_same_weights(_weights(toy, "ref2"), _weights(toy, "shared"))
    assert sum("[export] save_model wrote" in n.stdout for n in nodes) == 1  # global rank 0 only

    ckpt = toy / "shared" / "ckpt"
    shutil.rmtree(ckpt / "global_step6")
    (ckpt / "latest").write_text("global_step4")
    shutil.rmtree(toy / "shared" / "model")
    assert ranks.run(_as_two_nodes, _flags(toy, "shared", 2, "--load_checkpoint")) == ["", ""]
    _assert_same_weights(_weights(toy, "ref2"), _weights(toy, "shared"))
    rows = [json.loads(line) for line in (toy / "shared" / "logs" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5, 6, 5, 6]  # resumed
    assert _losses(toy, "shared") == _losses(toy, "ref2")  # steps 5 and 6 again, the same

    refused = ranks.run(_as_two_nodes, _flags(toy, "forced", 2, "--checkpoint_storage",
                                              "node_local"))
    for message in refused:  # every rank, the same line
        assert "checkpoint_storage='node_local' is invalid: " in message
        assert "is shared storage (global rank 0's file was seen by 2 of 2 nodes); set " \
               "--checkpoint_storage shared or auto" in message
    assert not (toy / "forced" / "ckpt" / "global_step2").exists()


@pytest.mark.slow
def test_node_local_storage_resumes_after_a_node_killed_mid_save(reference, ranks):
    """The refusal and the resume run as two nodes in the long-lived ranks, each rank with its
    own disk mounted at the checkpoint path; the kill needs real launchers."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("per-node directories at one path need mount namespaces (root, unshare)")
    toy = reference
    ckpt = toy / "local" / "ckpt"
    disks = [toy / "disk0", toy / "disk1"]
    for path in (ckpt, *disks):
        path.mkdir(parents=True)
    private = {str(ckpt): [str(d) for d in disks]}
    mounts = (str(ckpt), [str(d) for d in disks])

    refused = ranks.run(_on_own_disk, _flags(toy, "local", 3, "--checkpoint_storage", "shared"),
                        *mounts)
    assert all("is node-local storage (global rank 0's file was seen by 1 of 2 nodes)" in m
               for m in refused), refused

    killed = two_nodes(toy, _flags(toy, "local", 3, "--fault", "kill_in_save", "--fault_rank",
                                   "1", "--fault_step", "4"), private)
    assert killed[0].returncode != 0 and killed[1].returncode != 0
    assert "node-local on each of 2 nodes" in killed[0].stdout
    assert "KILLED rank 1 before publishing global_step4" in killed[1].stdout
    assert not os.listdir(ckpt), "the checkpoint path itself must never be written"
    assert (disks[0] / "global_step4" / "strategy_state.json").is_file()  # node 0 published
    assert not (disks[1] / "global_step4").exists()  # node 1 was killed first
    for disk, rank in zip(disks, (0, 1)):  # each node holds its own ranks' files only
        files = os.listdir(disk / "global_step2")
        assert "mp_rank_00_model_states.pt" in files or any(
            f.startswith(f"zero_pp_rank_{rank}_") and f.endswith("model_states.pt") for f in files)
        assert any(f.startswith(f"zero_pp_rank_{rank}_") for f in files)
        assert not any(f.startswith(f"zero_pp_rank_{1 - rank}_") for f in files), files

    assert ranks.run(_on_own_disk, _flags(toy, "local", 3, "--load_checkpoint"),
                     *mounts) == ["", ""]
    _assert_same_weights(_weights(toy, "ref3"), _weights(toy, "local"))
    rows = [json.loads(line) for line in (toy / "local" / "logs" / "metrics.jsonl").open()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6], steps  # resumed from global_step2, complete on both
    ref = _losses(toy, "ref3")
    assert _losses(toy, "local") == ref  # steps 1-4 before the kill, 3-6 after the resume
    for disk in disks:
        assert (disk / "latest").read_text() == "global_step6"
