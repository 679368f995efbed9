"""The Ray job's driver (a single controller, as OpenRLHF's ``train_ppo_ray`` and verl's): it
checks every setting, joins or starts Ray, reserves the placement, starts the vLLM engine actors
and the actor group's ranks (each a Ray actor running the trainer's own command, SPMD, with its
rendezvous from rank 0's node), writes ``placement.json``, waits, and tears everything down:
engines through vLLM's own shutdown, then every actor and placement group, however the job
ends (an error, a dead actor or node, SIGINT or SIGTERM to the driver).

A failure is one line naming the group, the rank (or engine) and its node.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import tempfile
import time
from typing import Any

import torch

from strategy.cluster.model_group import CriticRank, FrozenRank, RayRank
from strategy.cluster.placement import (
    actor_share,
    check_fits,
    ordered_bundles,
    plan,
    require_ray,
    reserve,
)
from strategy.cluster.settings import configs, model_groups
from strategy.config.cluster import ClusterConfig
from strategy.dist import first_line
from strategy.errors import ConfigError, RankFailedError, StrategyError
from strategy.rollout.config import ENGINES_VAR, RolloutConfig
from strategy.rollout.remote_models import GROUP_NAMES, GROUPS_VAR
from strategy.rollout.vllm_ray import (
    UNREACHABLE,
    VllmEngine,
    engine_concurrency,
    engine_env,
    remove_engine_files,
)
from strategy.trainers.config import TrainConfig

SHUTDOWN_S = 60.0  # an engine's own shutdown (at most --vllm_timeout), before its actor is killed
POLL_S = 1.0


class TrainingRank(RayRank):
    """One rank of the actor group, in a Ray actor: runs the trainer's command as a launcher's
    rank would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``)."""

    def run(self, command: str, argv: list[str], env: dict[str, str], cwd: str) -> Any:
        """The trainer's command, this actor being one of its ranks; its result."""
        os.environ.update(env)
        if os.path.isdir(cwd):  # the driver's folder, where this node sees it (relative paths)
            os.chdir(cwd)
        result = importlib.import_module(f"strategy.cli.train_{command}").main(argv)
        return json.loads(json.dumps(result, default=float))


class Job:
    """One Ray job's actors and placement groups (``run`` starts, waits and tears down)."""

    def __init__(self, ray: Any, command: str, argv: list[str], by_type: dict) -> None:
        self.ray, self.command, self.argv = ray, command, argv
        self.cluster: ClusterConfig = by_type[ClusterConfig]
        self.rollout: RolloutConfig = by_type[RolloutConfig]
        self.log_dir = by_type[TrainConfig].log_dir
        self.model_groups = model_groups(by_type)
        self.namespace = f"strategy-{os.getpid()}-{time.time_ns()}"
        self.groups: list[Any] = []
        self.engines: list[Any] = []
        self.ranks: list[Any] = []
        self.members: dict[str, list[Any]] = {group: [] for group in self.model_groups}
        self.where: dict[str, list[dict]] = {"actor": [], "vllm_engines": [],
                                             **{group: [] for group in self.model_groups}}

    # ------------------------------------------------------------ placement
    def place(self) -> None:
        job = plan(self.cluster, self.rollout, self.model_groups)
        check_fits(job, self.ray)
        timeout = self.cluster.ray_timeout
        actor = reserve(self.ray, job.actor, "PACK", timeout, "actor group")
        self.groups.append(actor)
        slots = ordered_bundles(self.ray, actor)
        starting = [self._start_group(group, bundles) for group, bundles in job.groups.items()]
        share = 0.5 if job.colocated else 1.0
        starting += [self._start_engines(job, actor, slots, share),
                     self._start_ranks(job, actor, slots, share)]
        # every actor asked for first, then awaited: their processes start (and import) side by
        # side, not one group after the other
        for name, entries, refs in starting:
            for entry, where in zip(entries, self._get(refs, name, "start")):
                entry.update(where)

    def _options(self, group: Any, bundle: int, resources: dict, share: float,
                 env: dict[str, str]) -> dict:
        from ray.util.scheduling_strategies import (  # the optional extra
            PlacementGroupSchedulingStrategy,  # the optional extra: a Ray job only
        )

        return {**actor_share(self.cluster, resources, share),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle),
                "runtime_env": {"env_vars": env}}

    def _start_engines(self, job: Any, actor: Any, slots: list, share: float) -> tuple:
        """The engine actors asked for: (name, their placement entries, their ``where`` refs)."""
        n, tp = self.rollout.vllm_num_engines, self.rollout.vllm_tensor_parallel_size
        if not n:
            return "vLLM engines", [], []
        if job.colocated:
            group, bundles, resources = actor, [slots[i][0] for i in range(n)], job.actor[0]
        else:
            group = reserve(self.ray, job.engines, "PACK", self.cluster.ray_timeout,
                            "vLLM engines")
            self.groups.append(group)
            bundles, resources = list(range(n)), job.engines[0]
        remote = self.ray.remote(VllmEngine)
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **engine_env(tp)}
        for index, bundle in enumerate(bundles):
            name = f"vllm-engine-{index}"
            self.engines.append(remote.options(
                name=name, namespace=self.namespace,
                max_concurrency=engine_concurrency(self.rollout),
                **self._options(group, bundle, resources, share, env)).remote(index, tp))
            self.where["vllm_engines"].append({"engine": index, "name": name, "bundle": bundle,
                                               "placement_group": group.id.hex()})
        return "vLLM engines", self.where["vllm_engines"], [e.where.remote() for e in self.engines]

    def _start_group(self, group: str, bundles: list[dict]) -> tuple:
        """A model's group of its own: its placement group and ranks asked for (not yet loaded),
        as ``_start_engines``'s."""
        name = GROUP_NAMES[group]
        placed = reserve(self.ray, bundles, "PACK", self.cluster.ray_timeout, name)
        self.groups.append(placed)
        # a critic rank serves world / size actor ranks, in turns (CriticRank): one thread each,
        # and one for the driver's calls
        callers = self.cluster.world_size // len(bundles) if group == "critic" else 0
        remote = self.ray.remote(CriticRank if callers else FrozenRank)
        args = (callers, self.cluster.ray_timeout) if callers else ()
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        for rank, (bundle, _, _) in enumerate(ordered_bundles(self.ray, placed)):
            actor = f"{group}-{rank}"
            self.members[group].append(remote.options(
                name=actor, namespace=self.namespace, max_concurrency=callers + 1,
                **self._options(placed, bundle, bundles[0], 1.0, env)).remote(*args))
            self.where[group].append({"rank": rank, "name": actor, "bundle": bundle,
                                      "placement_group": placed.id.hex()})
        return name, self.where[group], [r.where.remote() for r in self.members[group]]

    def _load_group(self, group: str) -> None:
        """A group's ranks load its model (their own rendezvous), within ``--ray_timeout``."""
        name, ranks, places = GROUP_NAMES[group], self.members[group], self.where[group]
        master = self._get([ranks[0].rendezvous.remote()], name, "start")[0]
        refs = {rank.start.remote(group, self.command, self.argv,
                                  group_env(places, r, master), os.getcwd()): r
                for r, rank in enumerate(ranks)}
        try:
            self.ray.get(list(refs), timeout=self.cluster.ray_timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise RankFailedError(f"the {name} did not load its model within --ray_timeout="
                                  f"{self.cluster.ray_timeout:g} s") from None
        except self.ray.exceptions.RayError:
            raise RankFailedError(self.first_failure(refs, name, places)) from None

    def _start_ranks(self, job: Any, actor: Any, slots: list, share: float) -> tuple:
        """The actor group's ranks asked for, as ``_start_engines``'s."""
        remote = self.ray.remote(TrainingRank)
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        for rank, (bundle, _, _) in enumerate(slots):
            self.ranks.append(remote.options(
                **self._options(actor, bundle, job.actor[0], share, env)).remote())
            self.where["actor"].append({"rank": rank, "bundle": bundle,
                                        "placement_group": actor.id.hex()})
        return "actor group", self.where["actor"], [r.where.remote() for r in self.ranks]

    def _get(self, refs: list, group: str, what: str) -> list:
        try:
            return self.ray.get(refs, timeout=self.cluster.ray_timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise RankFailedError(f"the {group} did not {what} within --ray_timeout="
                            f"{self.cluster.ray_timeout:g} s") from None

    # ------------------------------------------------------------ the run
    def rank_env(self, rank: int, master: tuple[str, int]) -> dict[str, str]:
        env = group_env(self.where["actor"], rank, master)
        if self.members:
            env[GROUPS_VAR] = json.dumps({
                "namespace": self.namespace, "timeout": self.cluster.ray_timeout,
                "ranks": {group: [{k: p[k] for k in ("rank", "name", "ip", "node_id")}
                                  for p in self.where[group]] for group in self.members}})
        if self.engines:
            env[ENGINES_VAR] = json.dumps({"namespace": self.namespace, "names": [
                e["name"] for e in self.where["vllm_engines"]]})
        return env

    def run(self) -> Any:
        self.write_placement()
        for group in self.members:
            self._load_group(group)
        master = self._get([self.ranks[0].rendezvous.remote()], "actor group", "start")[0]
        refs = {self.ranks[r].run.remote(self.command, self.argv, self.rank_env(r, master),
                                         os.getcwd()): r for r in range(len(self.ranks))}
        results: dict[int, Any] = {}
        while len(results) < len(refs):
            done, _ = self.ray.wait([ref for ref, r in refs.items() if r not in results],
                                    num_returns=1, timeout=POLL_S)
            for ref in done:
                try:
                    results[refs[ref]] = self.ray.get(ref)
                except self.ray.exceptions.RayError:
                    raise RankFailedError(self.first_failure(refs, "actor group",
                                                             self.where["actor"])) from None
        return results[0]

    def first_failure(self, refs: dict, group: str, places: list[dict]) -> str:
        """The line of a rank whose actor died (the cause: its peers then fail in a collective
        with it), else of the lowest failing rank (every rank raises the first error alike);
        those still running are given a moment to end."""
        self.ray.wait(list(refs), num_returns=len(refs), timeout=5)
        failed = []
        for ref, rank in sorted(refs.items(), key=lambda item: item[1]):
            try:
                self.ray.get(ref, timeout=0)
            except self.ray.exceptions.GetTimeoutError:
                continue
            except self.ray.exceptions.RayError as exc:
                failed.append((not isinstance(exc, self.ray.exceptions.RayActorError), rank, exc))
        if not failed:
            raise AssertionError("no rank failed")  # not reached: one did
        _, rank, exc = min(failed, key=lambda item: item[:2])
        return self.failure(group, places[rank], exc)

    def failure(self, group: str, place: dict, exc: Any) -> str:
        """One line: the group, the rank, its node, and what happened."""
        where = f"{group} rank {place['rank']} (node {place['ip']} {place['node_id'][:8]})"
        if isinstance(exc, self.ray.exceptions.ActorUnavailableError):  # Ray's RPC text else
            return f"{where} died: {UNREACHABLE}"
        if isinstance(exc, self.ray.exceptions.RayActorError):
            return f"{where} died: {first_line(exc)}"
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, StrategyError):
            return f"{where}: {first_line(cause)}"
        return f"{where} failed: {type(cause).__name__}: {first_line(cause)}"

    def write_placement(self) -> None:
        """``<log_dir>/placement.json``: each group's ranks or engines, node, bundle, devices."""
        if not self.log_dir:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, "placement.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.where, f, indent=1)
        os.replace(path + ".tmp", path)

    # ------------------------------------------------------------ teardown
    def _remove_engine_files(self, ended: set[int]) -> None:
        """The temp folder of each engine not in ``ended`` (killed, or its shutdown failed)
        removed on its node, bounded; one whose shutdown ended removed its own."""
        from ray.util.scheduling_strategies import (  # the optional extra
            NodeAffinitySchedulingStrategy,  # the optional extra: a Ray job only
        )

        remove = self.ray.remote(num_cpus=0)(remove_engine_files)
        refs = [remove.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            place["node_id"], soft=False)).remote(place["scratch"])
            for index, place in enumerate(self.where["vllm_engines"])
            if "scratch" in place and index not in ended]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_S)

    def close(self) -> None:
        """Engines through vLLM's own shutdown (within ``--vllm_timeout``, the deadline of every
        engine call: a stopped or hung engine never answers), then every actor and group gone."""
        from ray.util.placement_group import (  # the optional extra
            remove_placement_group,  # the optional extra: a Ray job only
        )

        ray, ended = self.ray, set()
        if self.engines:
            refs = [engine.shutdown.remote() for engine in self.engines]
            ray.wait(refs, num_returns=len(refs),
                     timeout=min(SHUTDOWN_S, self.rollout.vllm_timeout))
            ended = {index for index, ref in enumerate(refs) if _ended(ray, ref)}
        members = [rank for ranks in self.members.values() for rank in ranks]
        for handle in self.ranks + members + self.engines:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._remove_engine_files(ended)
        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.engines, self.ranks, self.members, self.groups = [], [], {}, []


def _ended(ray: Any, ref: Any) -> bool:
    """``ref``'s call returned (an error or no answer yet: False)."""
    try:
        ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - raised, died, or still running
        return False
    return True


def local_resources(by_type: dict, temp_dir: str) -> dict:
    """``ray.init``'s arguments for a Ray of this job's own on this machine: its CPUs, and on
    a machine without CUDA as many logical GPUs as the placement asks (its ranks run on CPU)."""
    asked = plan(by_type[ClusterConfig], by_type[RolloutConfig], model_groups(by_type)).asked()
    out = {"include_dashboard": False, "_temp_dir": temp_dir,
           "num_cpus": max(int(asked.get("CPU", 0) + 0.999), os.cpu_count() or 1)}
    if not torch.cuda.is_available() and "GPU" in asked:
        out["num_gpus"] = int(asked["GPU"] + 0.999)
    return out


def group_env(places: list[dict], rank: int, master: tuple[str, int]) -> dict[str, str]:
    """A launcher's environment for rank ``rank`` of the group placed at ``places``."""
    nodes = [place["node_id"] for place in places]
    node = nodes[rank]
    return {"RANK": str(rank), "WORLD_SIZE": str(len(nodes)),
            "LOCAL_RANK": str(nodes[:rank].count(node)),
            "LOCAL_WORLD_SIZE": str(nodes.count(node)), "LOCAL_SIZE": str(nodes.count(node)),
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}


class Stopped(KeyboardInterrupt):
    """SIGTERM (or SIGINT) to the driver: the job is torn down, then this ends the driver."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_RECEIVED: list[int] = []  # the signals _stop took (Ray's waits re-raise a bare interrupt)


def _stop(signum: int, frame: Any) -> None:
    _RECEIVED.append(signum)
    raise Stopped(signum)


def run_on_ray(command: str, argv: list[str]) -> Any:
    """Check, place, run and tear down ``command``'s Ray job; rank 0's result.

    Raises:
        ConfigError: a setting, Ray missing, or a placement the cluster cannot hold (before any
            model loads).
        RankFailedError: a rank or engine failed or died (the job's actors torn down).
    """
    if command not in ("grpo", "ppo"):
        raise ConfigError(f"ray=True is invalid for {command}: Ray jobs run grpo and ppo; launch "
                          f"{command} with torchrun (strategy {command} --nproc N)")
    ray = require_ray()
    by_type = configs(command, argv)
    cluster = by_type[ClusterConfig]
    address = cluster.ray_address or os.environ.get("RAY_ADDRESS")
    started = not ray.is_initialized()
    own = tempfile.mkdtemp(prefix="strategy-ray-") if started and not address else None
    if started:  # joined (RAY_ADDRESS, --ray_address), else a Ray of this job's own, its
        # session folder one of ours (Ray keeps /tmp/ray/session_* otherwise)
        ray.init(**({"address": address} if address else local_resources(by_type, own)))
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM,)}
    job = Job(ray, command, argv, by_type)
    try:
        job.place()
        return job.run()
    except KeyboardInterrupt:  # SIGTERM through _stop, or Ctrl-C
        raise Stopped(_RECEIVED[-1] if _RECEIVED else signal.SIGINT) from None
    finally:
        for sig in previous:  # a second signal must not cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        job.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if started:
            ray.shutdown()
        if own:
            shutil.rmtree(own, ignore_errors=True)
