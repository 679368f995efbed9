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
- ``RayVllmRollout`` (every training rank; ``--vllm_num_engines N``, each engine serving
  ``world / N`` consecutive ranks): ``sync`` streams the export's units from rank 0 to every
  engine's workers at once (``weight_stream``: one process group, addressed by rank 0's node IP;
  every rank still enters each gather); ``generate`` gathers an engine's ranks' rows to its
  first rank, which asks the engine and hands each rank its own rows back. Every engine call has
  a deadline (``--vllm_timeout``); an engine that died or raised is one line on every rank naming
  the engine, its node and the call.

The driver names the engines in the ranks' environment (``ENGINES_VAR``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from typing import Any

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
from transformers import GenerationConfig

from strategy.dist import checked, first_line, free_port
from strategy.internals.vllm import SHM_DIR
from strategy.model import base_model
from strategy.rollout.config import ENGINES_VAR, RolloutConfig
from strategy.rollout.partial import StepGate
from strategy.rollout.vllm_checks import check_engine_split, check_head_size, check_model_len
from strategy.rollout.vllm_engine import (
    VllmRollout,
    deadline,
    engine_failure,
    scratch_dir,
    start_llm,
    untied_config,
)
from strategy.rollout.vllm_requests import (
    EnginePeers,
    Requests,
    draw_seeds,
    late_tokens,
    prompt_rows,
    run_requests,
    with_completions,
)
from strategy.rollout.weight_stream import send_weights, weight_group

EXTENSION = "strategy.rollout.vllm_worker.WeightSyncExtension"
GENERATION_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
                   "eos_token_id", "pad_token_id")
SHM_RECORD = "shm-files.json"  # in an engine actor's temp folder: its processes' /dev/shm files
STREAM_ANSWER_S = 10.0  # a broken stream: how long its engines get to say why (a dead worker)
UNREACHABLE = "unreachable: its process or its node is gone"  # Ray's ActorUnavailableError
WATCHDOG_GRACE_S = 30.0  # past its Ray waits' own deadlines, before a rank ends itself


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


def engine_names() -> dict | None:
    """The driver's engines for this job (``ENGINES_VAR``), or None outside a Ray job."""
    value = os.environ.get(ENGINES_VAR)
    return json.loads(value) if value else None


class RayVllmRollout(VllmRollout):
    """The driver's vLLM engine actors, each shared by ``world / N`` consecutive ranks (every
    rank constructs this alike: it is collective).

    Args:
        engine: the policy's training engine (any ZeRO stage; a PEFT model is merged).
        config: the ``RolloutConfig``.
        max_model_len: the longest prompt + completion it will see.
        seed: the first engine's seed (engine i: seed + i).
    """

    def __init__(self, engine: Any, config: RolloutConfig, max_model_len: int,
                 seed: int) -> None:
        import ray  # the optional extra: a Ray job only

        self.source, self.config = engine.module, config
        self.rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        spec = engine_names()
        self.names = spec["names"]
        self.engines = [ray.get_actor(name, namespace=spec["namespace"]) for name in self.names]
        self.per = world // len(self.engines)
        self.first = self.rank - self.rank % self.per  # the rank that asks this rank's engine
        self.places: list[dict] = []  # each engine's node, as its line names it
        self.places = self._get([e.where.remote() for e in self.engines], "start")
        self._peers = EnginePeers(self.per)
        model = base_model(self.source)
        check_head_size(model.config)
        check_model_len(model.config, max_model_len)
        check_engine_split(model.config, config.vllm_tensor_parallel_size)
        untied, self._tied = untied_config(model)
        self._group: Any = None  # the sync's process group, on rank 0
        checked(self._start, untied.to_json_string(), str(next(self.source.parameters()).dtype),
                max_model_len, seed, make=engine_failure(self.describe, "start"))
        self._prepare_stream()

    def describe(self, rank: int) -> str:
        index, first = rank // self.per, rank - rank % self.per
        place = self.places[index] if self.places else None
        node = f" on node {place['ip']} {place['node_id'][:8]}" if place else ""
        return (f"vLLM engine {index} (Ray actor {self.names[index]}{node}, serving ranks "
                f"{first}-{first + self.per - 1})")

    def _call(self, name: str, fn: Any) -> Any:
        """As the in-rank engine's, but every wait here has a deadline of its own that raises (an
        engine call is a Ray reference): the watchdog, which ends the rank's process, fires only
        past them (twice ``--vllm_timeout``: a sync's stream, then a look at its answer), so a
        stopped engine is a line of its own, not a dead rank."""
        seconds = 2 * self.config.vllm_timeout + WATCHDOG_GRACE_S
        with deadline(seconds, f"the {self.describe(self.rank)} ({name})"):
            return checked(fn, make=engine_failure(self.describe, name))

    def _get(self, refs: list, call: str, engines: list[int] | None = None) -> list:
        """The answers of engines ``engines`` (all, in order, by default) to ``refs``, within
        ``--vllm_timeout``; a dead engine, an error in one or a wait past the deadline as one
        line naming the engine and its node."""
        import ray  # the optional extra: a Ray job only

        out = []
        for index, ref in zip(engines or range(len(refs)), refs):
            try:
                out.append(ray.get(ref, timeout=self.config.vllm_timeout))
            except ray.exceptions.GetTimeoutError:
                self._end_hung(index)
                raise TimeoutError(f"engine {index} did not answer {call} within "
                                   f"--vllm_timeout={self.config.vllm_timeout:g} s") from None
            except ray.exceptions.RayActorError as exc:
                why = "its node is gone" if self._node_lost(index) else UNREACHABLE \
                    if isinstance(exc, ray.exceptions.ActorUnavailableError) else first_line(exc)
                raise ConnectionError(f"engine {index}'s actor died in {call} ({why})") from None
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if exc.cause is not None else exc
                raise RuntimeError(f"engine {index} failed in {call}: "
                                   f"{type(cause).__name__}: {first_line(cause)}") from None
        return out

    def _node_lost(self, index: int) -> bool:
        """Engine ``index``'s node is no longer alive in the cluster."""
        import ray  # the optional extra: a Ray job only

        if not self.places:
            return False
        node = self.places[index]["node_id"]
        return not any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())

    def _end_hung(self, index: int) -> None:
        """Engine ``index`` missed its deadline (stopped, hung): its actor is killed now, as it
        would be at the teardown after another ``--vllm_timeout`` of waiting on its shutdown;
        the driver removes what it left (``remove_engine_files``)."""
        import ray  # the optional extra: a Ray job only

        ray.kill(self.engines[index])

    def _start(self, config_json: str, dtype: str, max_model_len: int, seed: int) -> None:
        """On rank 0: every engine started, then the sync's group joined by all their
        workers."""
        import ray  # the optional extra: a Ray job only

        if self.rank != 0:
            return
        dtype = dtype.removeprefix("torch.")
        self._get([e.start.remote(config_json, dtype, asdict(self.config), max_model_len,
                                  seed + i) for i, e in enumerate(self.engines)], "start")
        tp, host, port = self.config.vllm_tensor_parallel_size, ray.util.get_node_ip_address(), \
            free_port()
        size = 1 + len(self.engines) * tp
        joined = [e.join_weights.remote(host, port, 1 + i * tp, size, self.config.vllm_timeout)
                  for i, e in enumerate(self.engines)]
        with deadline(self.config.vllm_timeout, "the vLLM engines' weight group (start)"):
            self._group = weight_group(port, 0, size, self.config.vllm_timeout, host=host)
        self._get(joined, "start")

    def _sync(self) -> None:
        import ray  # the optional extra: a Ray job only

        # no look for an engine already gone before the stream (a live engine's call ends only
        # after it, so any wait is paid in full: 0.02 s of a 0.06 s sync): a gone engine's
        # process group breaks the stream, or its call's error ends the sync below
        refs = [e.receive_weights.remote() for e in self.engines] if self.rank == 0 else []
        stream = self._weights(copy=False)  # every rank enters every gather
        if self.rank == 0:
            try:
                send_weights(self._group, stream)
            except Exception:  # an engine gone mid-stream: that, not the broken pipe; one
                # that never took it (stopped, hung) already had --vllm_timeout to do so
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=STREAM_ANSWER_S)
                self._get(done, "sync", [refs.index(ref) for ref in done])
                late = [refs.index(ref) for ref in refs if ref not in done]
                if late:
                    self._end_hung(late[0])
                    raise TimeoutError(f"engine {late[0]} did not take the weight stream within "
                                       f"--vllm_timeout={self.config.vllm_timeout:g} s") from None
                raise
        else:
            for _ in stream:
                pass
        self._get(refs, "sync")

    def _ask(self, requests: Requests, generation_config: GenerationConfig) -> Any:
        """On an engine's first rank: its request under way (a Ray reference)."""
        if self.rank != self.first:
            return None
        return self.engines[self.rank // self.per].generate.remote(
            requests.prompts, requests.seeds, generation_settings(generation_config))

    def _answer(self, ref: Any) -> Any:
        """The engine's answer to ``_ask`` (every rank alike: an error is raised on all)."""
        return self._call("generate", lambda: self._get(
            [ref], "generate", [self.rank // self.per])[0] if ref is not None else None)

    def sync_in_flight(self) -> None:
        """``sync`` while generations run ahead in the engines (partial rollouts): each
        stops between two engine steps, takes the weights, and goes on under them."""
        self._call("sync", self._sync_held)

    def _sync_held(self) -> None:
        holds = [e.hold.remote(self.config.vllm_timeout) for e in self.engines] \
            if self.rank == 0 else []
        try:
            self._get(holds, "sync")
            self._sync()
        finally:
            for engine in self.engines if self.rank == 0 else []:
                engine.release.remote()

    def _rows(self, answer: Any, requests: Requests, input_ids: torch.Tensor,
              generation_config: GenerationConfig) -> torch.Tensor:
        """This rank's rows of its engine's answer (handed on from the engine's first rank)."""
        tokens, logprobs, split = self._peers.spread(answer)
        rows = slice(requests.start, requests.start + input_ids.shape[0])
        self.logprobs, self.late = logprobs[rows], late_tokens(tokens[rows], split, rows)
        return with_completions(input_ids, tokens[rows], generation_config.pad_token_id)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig, group: int = 1) -> torch.Tensor:
        seeds = draw_seeds(input_ids.shape[0])
        requests = self._peers.share(prompt_rows(input_ids, attention_mask), seeds)
        answer = self._answer(self._ask(requests, generation_config))
        return self._rows(answer, requests, input_ids, generation_config)

    def start_generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       generation_config: GenerationConfig) -> RayAhead:
        seeds = draw_seeds(input_ids.shape[0])
        requests = self._peers.share(prompt_rows(input_ids, attention_mask), seeds)
        return RayAhead(self, self._ask(requests, generation_config),
                        (requests, input_ids, generation_config))


class RayAhead:
    """A generation running in its engine's actor while the step before trains (``Ahead``'s
    interface): ``join`` waits for it (within the deadline), ``wait`` (collective) gives
    ``(output, log-probs)``."""

    def __init__(self, rollout: RayVllmRollout, ref: Any, request: tuple) -> None:
        self.rollout, self.ref, self.request = rollout, ref, request

    def join(self) -> None:
        import ray  # the optional extra: a Ray job only

        if self.ref is not None:
            ray.wait([self.ref], timeout=self.rollout.config.vllm_timeout)

    def wait(self) -> tuple[torch.Tensor, list[list[float]] | None]:
        out = self.rollout._rows(self.rollout._answer(self.ref), *self.request)
        return out, self.rollout.logprobs
