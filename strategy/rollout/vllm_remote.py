"""``RemoteVllmRollout``: vLLM engines in processes of their own, apart from training
(``--vllm_num_engines N``; OpenRLHF's engines without colocation), each serving ``world / N``
consecutive ranks. It is ``VllmRollout`` across a process boundary: the same requests, seeds,
streamed weights and faults, the engine answered over a local socket (``rollout.vllm_server``).

- Start-up: the first rank of each engine writes its untied ``config.json``, starts the engine's
  processes, one per device it spans (``--vllm_tensor_parallel_size``: a world of their own;
  on CUDA the GPUs after the node's training ones, ``CUDA_VISIBLE_DEVICES``; on CPU the host)
  and waits for each one's line; every rank then connects to its engine's first process (the
  address and key shared through the training world). A start that fails is one line on every
  rank.
- ``sync``: every rank enters each export group's gather, as colocated; the engine's first rank
  sends each tensor's header down its socket and broadcasts the tensor to all the engine's
  processes at once over a process group of their own (``weight_group``: NCCL on CUDA, device to
  device, as OpenRLHF's; gloo on CPU), and each streams it into vLLM's in-place reload (no
  rank, and not the engine, holds more than one group beyond vLLM's copy).
- ``generate``: each rank sends its own rows and seeds; the engine batches all its ranks' rows.
  With ``--async_rollouts 1`` the generation runs in the engine's process while the step trains.
- Faults: an engine error, or one of its processes ending, is one line on every rank naming the
  engine, the call and the ranks it serves (the process that ended, where the starting rank
  sees it); a call that hangs past ``--vllm_timeout`` ends the rank, and the engine ends with
  the rank that started it.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from multiprocessing.connection import Client
from typing import Any, Iterator

import torch
from transformers import GenerationConfig

from strategy.dist import checked, free_port, get_local_world_size
from strategy.internals import unlink_cpu_shm
from strategy.model import base_model
from strategy.rollout.config import RolloutConfig
from strategy.rollout.vllm_checks import check_engine_split, check_head_size
from strategy.rollout.vllm_engine import (
    EnginePeers,
    Requests,
    VllmRollout,
    deadline,
    engine_failure,
    save_untied_config,
    scratch_dir,
    shm_prefix,
    with_completions,
)
from strategy.rollout.vllm_server import MARK, generation_settings, send_tensor
from strategy.rollout.weight_stream import weight_group

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_PORT",
                 "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")


def engine_env(index: int, size: int, port: int, devices: list[int] | None) -> dict[str, str]:
    """The environment of the engine's process ``index`` of ``size``: this one's without the
    training world's launcher variables, a world of the engine's own on ``port``, its devices
    on CUDA (vLLM's own variables are set in it by ``start_llm``, as in a rank)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(size),
               LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if devices is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = visible.split(",") if visible else [str(d) for d in range(max(devices) + 1)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(names[d] for d in devices)
    return env


def engine_devices(local_rank: int, local_world: int, per: int, tp: int) -> list[int] | None:
    """The GPUs of the engine whose first rank is ``local_rank``: ``tp`` of them after the
    node's training GPUs and its engines before it (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    first = local_world + local_rank // per * tp
    return list(range(first, first + tp))


def ready_line(process: subprocess.Popen) -> str:
    """The engine's line after ``MARK`` ('' when it ended first); what it printed before that
    (its imports' notes) goes on to this process's stderr."""
    for line in process.stdout:
        if line.startswith(MARK):
            return line[len(MARK):].strip()
        sys.stderr.write(line)
    return ""


def ready_lines(processes: list[subprocess.Popen]) -> list[str | None]:
    """Each engine process's line, '' where it ended first (read side by side: a process may
    wait on another that failed first, and that one's error is the line to give; once one has
    failed, those not yet read are None)."""
    lines: list[str | None] = [None] * len(processes)
    done = threading.Condition()

    def read(index: int) -> None:
        line = ready_line(processes[index])
        with done:
            lines[index] = line
            done.notify()

    for index in range(len(processes)):
        threading.Thread(target=read, args=(index,), daemon=True).start()
    with done:
        done.wait_for(lambda: None not in lines or any(
            line is not None and '"error"' in line or line == "" for line in lines))
    return list(lines)


def engine_error(name: str, message: str) -> RuntimeError:
    """The engine's error (its type's name and first line), raised here as it named it."""
    return type(name, (RuntimeError,), {})(message)


def stop(process: subprocess.Popen) -> None:
    """End the engine's process (at exit; it also ends when its ranks close)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


class RemoteVllmRollout(VllmRollout):
    """A vLLM engine in a process of its own, shared by ``world / vllm_num_engines``
    consecutive ranks (every rank constructs this alike: it is collective).

    Args:
        engine: the policy's training engine (any ZeRO stage; a PEFT model is merged).
        config: the ``RolloutConfig``.
        max_model_len: the longest prompt + completion it will see.
        seed: the engine's own seed (the same on its ranks).
    """

    def __init__(self, engine: Any, config: RolloutConfig, max_model_len: int,
                 seed: int) -> None:
        self.source, self.config = engine.module, config
        self.rank = torch.distributed.get_rank()
        self.per = torch.distributed.get_world_size() // config.vllm_num_engines
        self.first = self.rank - self.rank % self.per  # the rank that starts this engine
        self._peers = EnginePeers(1)  # each rank sends its own rows; the engine batches them
        model = base_model(self.source)
        check_head_size(model.config)
        check_engine_split(model.config, config.vllm_tensor_parallel_size)
        self.processes: list[subprocess.Popen] = []  # the engine's, on the rank that started it
        self._group: Any = None  # the sync's process group with them, there
        failed = engine_failure(self.describe, "start")
        # the engine's config.json, written by the rank that starts it and read at start only
        with scratch_dir() if self.rank == self.first else nullcontext() as directory:
            self._tied = save_untied_config(model, directory)
            started = checked(self._start, directory, max_model_len, seed, make=failed)
        addresses: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(addresses, started)
        self.address = addresses[self.first]
        self._conn = checked(self._connect, make=failed)
        self._prepare_stream()

    def describe(self, rank: int) -> str:
        first, tp = rank - rank % self.per, self.config.vllm_tensor_parallel_size
        where = "a process of its own" if tp == 1 else f"{tp} processes of its own"
        return (f"vLLM engine {rank // self.per} ({where}, serving ranks "
                f"{first}-{first + self.per - 1})")

    def _start(self, directory: str | None, max_model_len: int, seed: int) -> dict | None:
        """On the engine's first rank: its process started and ready; its address."""
        if directory is None:
            return None
        key = secrets.token_hex(16)
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        local_world = get_local_world_size()  # torchrun's or the deepspeed launcher's variable
        spec = {"dir": directory, "dtype": str(next(self.source.parameters()).dtype)[6:],
                "rollout": asdict(self.config), "max_model_len": max_model_len, "seed": seed,
                "clients": self.per, "authkey": key, "parent": os.getpid()}
        tp, port = self.config.vllm_tensor_parallel_size, free_port()
        spec["weights_port"] = free_port()
        devices = engine_devices(local_rank, local_world, self.per, tp)
        # at exit, after its processes have ended (atexit runs last what it got first): what
        # they left in shared memory, where one was killed while it started
        atexit.register(unlink_cpu_shm, shm_prefix(port))
        for index in range(tp):
            process = subprocess.Popen(
                [sys.executable, "-c", "from strategy.rollout.vllm_server import main; main()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env={"VLLM_RPC_BASE_PATH": directory,  # its sockets' files go with the folder
                     **engine_env(index, tp, port, devices)})
            atexit.register(stop, process)
            self.processes.append(process)
            process.stdin.write(json.dumps(spec) + "\n")
            process.stdin.close()
        with deadline(self.config.vllm_timeout, f"the {self.describe(self.rank)} (start)"):
            lines = ready_lines(self.processes)
        replies = [json.loads(line) if line else {} for line in lines]
        for reply in replies:  # a process's own error first: the others may have waited on it
            if "error" in reply:
                raise engine_error(*reply["error"])
        for index, line in enumerate(lines):
            if line == "":
                raise RuntimeError(f"its process {index} exited with code "
                                   f"{self.processes[index].wait()} before it was ready")
        with deadline(self.config.vllm_timeout, f"the {self.describe(self.rank)} (start)"):
            self._group = weight_group(spec["weights_port"], 0, tp + 1, self.config.vllm_timeout)
        return {"host": socket.gethostname(), "port": replies[0]["port"], "key": key,
                "pids": [process.pid for process in self.processes]}

    def _ended(self, index: int) -> str | None:
        """Says so when the engine's process ``index`` has ended (the rank that started it)."""
        process = self.processes[index]
        if process.poll() is None:
            return None
        which = "its process" if len(self.processes) == 1 else f"its process {index}"
        return f"{which} (pid {process.pid}) ended with exit code {process.returncode}"

    def _connect(self) -> Any:
        if self.address["host"] != socket.gethostname():
            raise RuntimeError(f"it runs on {self.address['host']}, this rank on "
                               f"{socket.gethostname()}: an engine's ranks share its node; give "
                               "each node whole engines (--vllm_num_engines a multiple of the "
                               "nodes)")
        conn = Client(("127.0.0.1", self.address["port"]),
                      authkey=bytes.fromhex(self.address["key"]))
        conn.send(self.rank - self.first)
        return conn

    @contextmanager
    def _link(self) -> Iterator[None]:
        """The socket to the engine failing (its process gone) as one line saying so."""
        try:
            yield
        except (EOFError, OSError) as exc:
            raise ConnectionError(self._lost() or f"its process (pid "
                                  f"{self.address['pids'][0]}) ended") from exc
        except RuntimeError as exc:  # the sync's group: a process gone is what to say
            lost = self._lost()
            if lost:
                raise ConnectionError(lost) from exc
            raise

    def _lost(self) -> str | None:
        """Which of the engine's processes ended, where this rank started them (else None;
        a process whose sockets just closed is given a moment to be seen ended)."""
        if not self.processes:
            return None
        for _ in range(20):
            lost = next(filter(None, map(self._ended, range(len(self.processes)))), None)
            if lost:
                return lost
            time.sleep(0.1)
        return None

    def _reply(self) -> Any:
        """The engine's answer to the last call, or its error raised here."""
        with self._link():
            kind, value = self._conn.recv()
        if kind == "error":
            lost = self._lost()  # an engine process gone: that, not the error it caused
            if lost:
                raise ConnectionError(lost)
            raise engine_error(*value)
        return value

    def _sync(self) -> None:
        with self._link():
            self._conn.send(("sync",))
        for name, tensor in self._weights(copy=False):  # every rank enters every gather; the
            # broadcast is done with each tensor before the next: no copies
            if self.rank == self.first:
                with self._link():
                    send_tensor(self._conn, self._group, name, tensor)
        if self.rank == self.first:
            with self._link():
                self._conn.send(("end",))
        self._reply()

    def _generate(self, requests: Requests, input_ids: torch.Tensor,
                  generation_config: GenerationConfig) -> torch.Tensor:
        with self._link():
            self._conn.send(("generate", requests.prompts, requests.seeds,
                             generation_settings(generation_config)))
        tokens, self.logprobs = self._reply()
        return with_completions(input_ids, tokens, generation_config.pad_token_id)
