"""``RemoteVllmRollout``: vLLM engines in processes of their own, apart from training
(``--vllm_num_engines N``; OpenRLHF's engines without colocation), each serving ``world / N``
consecutive ranks. It is ``VllmRollout`` across a process boundary: the same requests, seeds,
streamed weights and faults, the engine answered over a local socket (``rollout.vllm_server``).

- Start-up: the first rank of each engine writes its untied ``config.json``, starts the engine's
  process (its own device: on CUDA the GPU after the node's training ones, ``CUDA_VISIBLE_DEVICES``;
  on CPU the host) and waits for its line; every rank then connects to its engine (the address
  and key shared through the training world). A start that fails is one line on every rank.
- ``sync``: every rank enters each export group's gather, as colocated; the engine's first rank
  sends each tensor down its socket, raw bytes after a header, and the engine streams them into
  vLLM's in-place reload (no rank, and not the engine, holds more than one group beyond vLLM's
  copy). On CUDA the bytes go through host memory; an NCCL broadcast (OpenRLHF's) is not here.
- ``generate``: each rank sends its own rows and seeds; the engine batches all its ranks' rows.
  With ``--async_rollouts 1`` the generation runs in the engine's process while the step trains.
- Faults: an engine error, or its process ending, is one line on every rank naming the engine,
  the call and the ranks it serves; a call that hangs past ``--vllm_timeout`` ends the rank, and
  the engine ends with the rank that started it.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from multiprocessing.connection import Client
from typing import Any, Iterator

import torch
from transformers import GenerationConfig

from strategy.dist import checked, free_port
from strategy.model import base_model
from strategy.rollout.config import RolloutConfig
from strategy.rollout.vllm_checks import check_head_size
from strategy.rollout.vllm_engine import (
    EnginePeers,
    Requests,
    VllmRollout,
    deadline,
    engine_failure,
    save_untied_config,
    with_completions,
)
from strategy.rollout.vllm_server import MARK, generation_settings, send_tensor

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_PORT",
                 "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")


def engine_env(device: int | None) -> dict[str, str]:
    """The engine process's environment: this one's without the training world's launcher
    variables, a one-process world of its own, its device on CUDA (vLLM's own variables are
    set in it by ``start_llm``, as in a rank)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if device is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[device] if visible else str(device)
    return env


def engine_device(local_rank: int, local_world: int, per: int) -> int | None:
    """The GPU of the engine whose first rank is ``local_rank``: those after the node's
    training GPUs, one per engine (None on CPU)."""
    return local_world + local_rank // per if torch.cuda.is_available() else None


def ready_line(process: subprocess.Popen) -> str:
    """The engine's line after ``MARK`` ('' when it ended first); what it printed before that
    (its imports' notes) goes on to this process's stderr."""
    for line in process.stdout:
        if line.startswith(MARK):
            return line[len(MARK):].strip()
        sys.stderr.write(line)
    return ""


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
        directory = None  # the engine's config.json, written by the rank that starts it
        if self.rank == self.first:
            directory = tempfile.mkdtemp(prefix="strategy-vllm-")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
        self._tied = save_untied_config(model, directory)
        self.process: subprocess.Popen | None = None
        failed = engine_failure(self.describe, "start")
        started = checked(self._start, directory, max_model_len, seed, make=failed)
        addresses: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(addresses, started)
        self.address = addresses[self.first]
        self._conn = checked(self._connect, make=failed)
        self._prepare_stream()

    def describe(self, rank: int) -> str:
        first = rank - rank % self.per
        return (f"vLLM engine {rank // self.per} (a process of its own, serving ranks "
                f"{first}-{first + self.per - 1})")

    def _start(self, directory: str | None, max_model_len: int, seed: int) -> dict | None:
        """On the engine's first rank: its process started and ready; its address."""
        if directory is None:
            return None
        key = secrets.token_hex(16)
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE",
                                         torch.distributed.get_world_size()))
        spec = {"dir": directory, "dtype": str(next(self.source.parameters()).dtype)[6:],
                "rollout": asdict(self.config), "max_model_len": max_model_len, "seed": seed,
                "clients": self.per, "authkey": key, "parent": os.getpid()}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from strategy.rollout.vllm_server import main; main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=engine_env(engine_device(local_rank, local_world, self.per)))
        atexit.register(stop, self.process)
        self.process.stdin.write(json.dumps(spec) + "\n")
        self.process.stdin.close()
        with deadline(self.config.vllm_timeout, f"the {self.describe(self.rank)} (start)"):
            line = ready_line(self.process)
        reply = json.loads(line) if line else {
            "error": f"its process exited with code {self.process.wait()} before it was ready"}
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return {"host": socket.gethostname(), "port": reply["port"], "key": key,
                "pid": self.process.pid}

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
            raise ConnectionError(f"its process (pid {self.address['pid']}) ended") from exc

    def _reply(self) -> Any:
        """The engine's answer to the last call, or its error raised here."""
        with self._link():
            kind, value = self._conn.recv()
        if kind == "error":
            name, message = value
            raise type(name, (RuntimeError,), {})(message)  # the engine's error, as it named it
        return value

    def _sync(self) -> None:
        with self._link():
            self._conn.send(("sync",))
        for name, tensor in self._weights():  # every rank enters every gather
            if self.rank == self.first:
                with self._link():
                    send_tensor(self._conn, name, tensor)
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
