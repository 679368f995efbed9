"""vLLM engines as Ray actors (``strategy.cluster`` places them, on any node): OpenRLHF's
engines apart from training, on vLLM's own executor inside each actor and a worker extension of
ours for the weights (``rollout.vllm_worker``).

- The actor (``VllmEngine``): placed empty by the driver, started by the training world's first
  rank with the policy's untied config (sent as text: the engine's node need not share a disk),
  placeholder weights until the first sync. One device: vLLM's ``uni`` executor, its engine core
  in the actor's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); several
  (``--vllm_tensor_parallel_size``): ``mp``, a worker process per device. An engine one of whose
  workers raised is never called again (vLLM 0.32 answers the next call with the other worker's
  stale reply). ``shutdown`` ends it through vLLM's own shutdown, which leaves nothing in
  /dev/shm.
- The training ranks' side, ``RayVllmRollout``, is ``rollout.ray_rollout``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
from transformers import GenerationConfig

from strategy.dist import first_line
from strategy.internals.vllm import SHM_DIR
from strategy.rollout.config import RolloutConfig
from strategy.rollout.partial import StepGate
from strategy.rollout.vllm_engine import scratch_dir, start_llm
from strategy.rollout.vllm_requests import run_requests

EXTENSION = "strategy.rollout.vllm_worker.WeightSyncExtension"
GENERATION_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
                   "eos_token_id", "pad_token_id")
SHM_RECORD = "shm-files.json"  # in an engine actor's temp folder: its processes' /dev/shm files
UNREACHABLE = "unreachable: its process or its node is gone"  # Ray's ActorUnavailableError


def engine_env(tp: int) -> dict[str, str]:
    """An engine actor's own environment (Ray's ``runtime_env``): its engine core in its process
    at one device; at several on CPU, one core bound to each worker (vLLM refuses to bind
    several workers otherwise)."""
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif not torch.cuda.is_available():
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(tp))
    return env


def engine_concurrency(config: RolloutConfig) -> int:
    """An engine actor's threads (Ray's ``max_concurrency``): with ``--partial_rollouts`` a
    sync's calls (``hold``, ``receive_weights``, ``release``) run while a generate waits held;
    otherwise one call at a time."""
    return 2 if config.partial_rollouts else 1


def generation_settings(generation_config: GenerationConfig) -> dict[str, Any]:
    """What an engine actor needs of a ``GenerationConfig``, as plain values."""
    return {key: getattr(generation_config, key, None) for key in GENERATION_KEYS}


class VllmEngine:
    """One vLLM engine in a Ray actor (made remote by ``strategy.cluster``)."""

    def __init__(self, index: int, tp: int) -> None:
        self.index, self.tp = index, tp
        self.llm: Any = None
        self.broken: str | None = None
        self.gate = StepGate()  # partial rollouts: where a generation stops for a sync
        self.shm_files: set[str] = set()  # what ``_record_shm`` noted so far
        # the engine's temp files (vLLM's file store, vllm_dist_*) in a folder of its own, which
        # the driver removes on this node when the actor was killed (``remove_engine_files``)
        cache = cache_dir()  # torch's compile cache: the node's (sets TORCHINDUCTOR_CACHE_DIR)
        self.scratch = tempfile.mkdtemp(prefix="strategy-vllm-engine-")
        os.environ["TMPDIR"] = self.scratch
        tempfile.tempdir = None  # read TMPDIR again
        # torch puts its precompiled header in <temp folder>/torchinductor_<user> whatever the
        # variable says: linked to the node's cache, the engine's processes compile it once per
        # node, not at every engine's first generate (~5 s of one core); the link goes with the
        # folder
        os.symlink(cache, default_cache_dir())

    def where(self) -> dict:
        """Where Ray placed this engine: node id and address, devices, process, temp folder."""
        import ray  # the optional extra: a Ray job only

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "devices": [str(d) for d in context.get_accelerator_ids().get("GPU", [])],
                "pid": os.getpid(), "scratch": self.scratch}

    def start(self, config_json: str, dtype: str, rollout: dict, max_model_len: int,
              seed: int) -> None:
        """The engine for the model ``config_json`` describes, placeholder weights."""
        config = RolloutConfig(**{**rollout, "is_correction_threshold": tuple(
            rollout["is_correction_threshold"])})
        with scratch_dir() as directory:  # read at start only
            with open(os.path.join(directory, "config.json"), "w") as f:
                f.write(config_json)
            self.llm = start_llm(directory, getattr(torch, dtype), config, max_model_len, seed,
                                 executor="uni" if self.tp == 1 else "mp", extension=EXTENSION)
        self._record_shm()

    def _record_shm(self) -> None:
        """Note the /dev/shm files the engine's processes (this actor's and its children's)
        have mapped so far, for ``remove_engine_files``: at its start, after each sync and as
        it shuts down (a process of the engine makes some only later, e.g. once a worker died)."""
        seen = self.shm_files | set(shm_mapped_by([os.getpid(), *descendants(os.getpid())]))
        if seen != self.shm_files:  # written only when it grew
            self.shm_files = seen
            with open(os.path.join(self.scratch, SHM_RECORD), "w") as f:
                json.dump(sorted(seen), f)

    def _checked(self, fn: Any, *args: Any) -> Any:
        if self.broken is not None:
            raise RuntimeError(f"it failed before ({self.broken}) and is not called again")
        try:
            return fn(*args)
        except Exception as exc:
            self.broken = first_line(exc)
            raise

    def join_weights(self, host: str, port: int, first: int, size: int,
                     seconds: float) -> list[int]:
        """Each worker joins the sync's group (ranks ``first``..); the ranks they took."""
        return self._checked(self.llm.collective_rpc, "strategy_join",
                             None, (host, port, first, size, seconds))

    def receive_weights(self) -> None:
        """One sync's stream, into every worker; the prefix cache then reset (a held
        generation's requests too: they recompute under the new weights)."""
        self._checked(self.llm.collective_rpc, "strategy_receive")
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self._record_shm()

    def hold(self, seconds: float) -> bool:
        """Partial rollouts: the generation under way stops before its next engine step (True
        once it did; False when none runs: one that begins waits, as for ``release``)."""
        return self.gate.hold(self.gate.cap(), seconds, f"vLLM engine {self.index}")

    def release(self) -> None:
        """The held generation goes on."""
        self.gate.release()

    def generate(self, prompts: list[list[int]], seeds: list[int], settings: dict
                 ) -> tuple[list[list[int]], list[list[float]], list[int] | None]:
        """Each prompt's completion tokens, their log-probs, and (a sync in flight) each
        one's tokens sampled before it."""
        self.gate.start()
        return self._checked(run_requests, self.llm, prompts, seeds,
                             GenerationConfig(**settings), self.gate)

    def shutdown(self) -> None:
        """End the engine through vLLM's own shutdown (its processes and shared memory), then
        what it left (``remove_engine_files``)."""
        if self.llm is not None:
            self._record_shm()
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        remove_engine_files(self.scratch)  # what a shutdown after a dead worker leaves


def remove_engine_files(scratch: str) -> None:
    """What an engine actor killed on this node left (a Ray task the driver runs there after the
    actor is gone): the /dev/shm files its engine's processes had mapped (vLLM unlinks them only
    at its own shutdown: a killed worker leaves them), then its temp folder."""
    try:
        with open(os.path.join(scratch, SHM_RECORD)) as f:
            names = json.load(f)
    except (OSError, ValueError):  # never started, or already removed
        names = []
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:  # its own shutdown got there first
            pass
    shutil.rmtree(scratch, ignore_errors=True)


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, theirs, and so on (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def shm_mapped_by(pids: list[int]) -> list[str]:
    """The /dev/shm files of vLLM's kinds (its message queues' ``psm_*``, its CPU groups'
    ``*cpushm*``, multiprocessing's ``sem.mp-*``) that the processes ``pids`` have mapped.
    Matched by inode, not by the name a map shows: glibc creates a named semaphore under a
    temporary name, maps it, links it to its name and unlinks the temporary, so its creator's
    map reads ``sem.XXXXXX (deleted)``, never ``sem.mp-...``."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                inodes.update(int(line.split()[4]) for line in f if SHM_DIR + "/" in line)
        except OSError:  # gone meanwhile
            continue
    names = []
    for entry in os.scandir(SHM_DIR) if inodes else ():
        if (entry.name.startswith(("psm_", "sem.mp-")) or "cpushm" in entry.name) and \
                entry.inode() in inodes:
            names.append(entry.name)
    return sorted(names)
