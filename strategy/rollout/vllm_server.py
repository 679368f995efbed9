"""A vLLM engine in processes of its own (``--vllm_num_engines``), serving the training ranks
that share it over local sockets. Started by the first of those ranks
(``RemoteVllmRollout``), never by hand:

    python -c "from strategy.rollout.vllm_server import main; main()"   (settings on stdin)

- Start-up: a world of its own, one process per device the engine spans
  (``--vllm_tensor_parallel_size``; vLLM's ``external_launcher`` in each, on the device its
  parent chose), the engine built from the ``config.json`` its parent wrote, placeholder
  weights; then each process prints one JSON line on stdout after ``MARK``: the first
  ``{"port": P}``, the others ``{"ready": I}`` (or ``{"error": [type, message]}``). The first
  accepts a connection from each of its ranks (authenticated with the key it was given).
- Calls in lockstep: each call is read from every rank before it runs (the training ranks
  call alike), and the first process hands it on to the others (``EngineGroup``: vLLM's
  tensor-parallel ranks run the same calls). ``generate``: every rank's rows in one batch, each
  rank answered its own tokens and log-probs. ``sync``: the first rank sends each tensor's
  header down its socket and broadcasts the tensor itself to every engine process at once, over
  a process group of its own with them (``weight_group``: NCCL on CUDA, device to device; gloo
  on CPU), each process streaming it straight into vLLM's in-place reload; the training ranks
  but the first only wait for it. An error in any process is answered to every rank as one
  line, and the engine serves on.
- Lifetime: it ends when a rank closes its connection or dies (end of file), and with its
  parent (``PR_SET_PDEATHSIG``, set by the parent at start): no engine outlives its job.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection, Listener
from typing import Any

import torch
from transformers import GenerationConfig

from strategy.dist import first_line
from strategy.internals import unlink_cpu_shm
from strategy.rollout.config import RolloutConfig
from strategy.rollout.vllm_engine import run_requests, shm_prefix, start_llm
from strategy.rollout.weight_stream import WeightStream, broadcast, weight_group, wire_device

MARK = "[strategy vllm engine] "  # starts the line the parent waits for (imports may print)
GENERATION_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
                   "eos_token_id", "pad_token_id")
IDLE = timedelta(days=30)  # the engine's processes wait this long for the next call


def generation_settings(generation_config: GenerationConfig) -> dict[str, Any]:
    """What the engine needs of a ``GenerationConfig``, as plain values."""
    return {key: getattr(generation_config, key, None) for key in GENERATION_KEYS}


def send_tensor(conn: Connection, group: Any, name: str, tensor: torch.Tensor) -> None:
    """One tensor to the engine: its header down ``conn``, the tensor over ``group``."""
    data = tensor.detach().to(wire_device()).contiguous()
    conn.send(("tensor", name, str(data.dtype).removeprefix("torch."), list(data.shape)))
    broadcast(group, data)


def one_line(exc: BaseException) -> tuple[str, str]:
    """An error as the ranks are answered it: its type's name and first line."""
    return type(exc).__name__, first_line(exc)


class EngineGroup:
    """The engine's processes, one per device it spans (``size``; a world of their own): the
    first reads the training ranks' calls and hands each on to the others, which run it alike
    (vLLM's tensor-parallel ranks must). With one process every step is local. ``weights``: the
    sync's group with the training rank (``weight_group``), made once all are ready."""

    def __init__(self, size: int) -> None:
        self.size, self.rank = size, torch.distributed.get_rank()
        self.control = (torch.distributed.new_group(backend="gloo", timeout=IDLE)
                        if size > 1 else None)
        self.weights: Any = None

    def share(self, value: Any = None) -> Any:
        """The first process's ``value``, on every process."""
        if self.size == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def tensor(self, header: tuple) -> torch.Tensor:
        """The training rank's tensor that ``header`` announced (its dtype and shape)."""
        _, _, dtype, shape = header
        out = torch.empty(shape, dtype=getattr(torch, dtype), device=wire_device())
        broadcast(self.weights, out)
        return out

    def errors(self, error: tuple[str, str] | None) -> tuple[str, str] | None:
        """The first error of any process in the call just run (every process alike)."""
        if self.size == 1:
            return error
        seen: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(seen, error, group=self.control)
        for index, found in enumerate(seen):
            if found is not None:
                return found if index == 0 else (found[0], f"in its process {index}: {found[1]}")
        return None


class TensorStream(WeightStream):
    """A sync's tensors, up to the stream's end marker, as ``send_tensor`` sent them: each
    header read from ``conn`` by the first process (handed on to the others), each tensor
    broadcast to all of them (``WeightStream``'s iteration and drain, headers from ``conn``)."""

    def __init__(self, conn: Connection | None, group: EngineGroup) -> None:
        super().__init__(group.weights)
        self.conn, self.engine = conn, group

    def _next(self) -> tuple[str, torch.Tensor] | None:
        header = self.engine.share(self.conn.recv() if self.conn is not None else None)
        if header[0] == "end":
            self.ended = True
            return None
        return header[1], self.engine.tensor(header)


def run_call(llm: Any, group: EngineGroup, call: tuple, conn: Connection | None) -> Any:
    """One call on this process (``call`` as the first process shared it): a generation's
    tokens and log-probs, or a sync from ``conn`` (the first process) or its broadcasts."""
    if call[0] == "generate":
        return run_requests(llm, call[1], call[2], GenerationConfig(**call[3]))
    stream = TensorStream(conn, group)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(stream)})
    finally:
        stream.drain()
    llm.reset_prefix_cache()
    return None


def serve(llm: Any, group: EngineGroup, conns: list[Connection]) -> None:
    """The first process: answer the ranks' calls until one of them closes."""
    while True:
        try:
            calls = [conn.recv() for conn in conns]
        except (EOFError, OSError):
            calls = [("close",)]
        kind = calls[0][0]
        if kind == "close" or any(call[0] != kind for call in calls):
            try:
                group.share(("close",))
            except Exception:  # noqa: BLE001 - a process already gone: nothing to close
                pass
            return
        call = (kind,) if kind == "sync" else (
            kind, [row for c in calls for row in c[1]], [seed for c in calls for seed in c[2]],
            calls[0][3])  # every rank's rows in one batch
        value, error = None, None
        try:
            value = run_call(llm, group, group.share(call), conns[0])
        except Exception as exc:  # noqa: BLE001 - answered to every rank as one line
            error = one_line(exc)
        try:
            error, lost = group.errors(error), False
        except Exception as exc:  # noqa: BLE001 - a process of the engine gone: it ends
            error, lost = error or one_line(exc), True
        for conn, reply in zip(conns, answers(calls, value, error)):
            conn.send(reply)
        if lost:
            return


def answers(calls: list[tuple], value: Any, error: tuple[str, str] | None) -> list[tuple]:
    """Each rank's reply: the error, or its own rows of the generation (a sync: nothing)."""
    if error is not None:
        return [("error", error)] * len(calls)
    if calls[0][0] == "sync":
        return [("ok", None)] * len(calls)
    (tokens, logprobs), replies, start = value, [], 0
    for call in calls:
        rows = slice(start, start + len(call[1]))
        replies.append(("ok", (tokens[rows], logprobs[rows])))
        start = rows.stop
    return replies


def follow(llm: Any, group: EngineGroup) -> None:
    """Every process but the first: run the calls the first hands on, until it closes."""
    while True:
        call = group.share()
        if call[0] == "close":
            return
        error = None
        try:
            run_call(llm, group, call, None)
        except Exception as exc:  # noqa: BLE001 - the first process answers it
            error = one_line(exc)
        group.errors(error)


def die_with_parent(parent: int) -> None:
    """This process is killed when the rank that started it ends, however it ends (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    die_with_parent(spec["parent"])
    replies = os.fdopen(os.dup(1), "w")  # stdout is the parent's line; vLLM's prints go to stderr
    os.dup2(2, 1)
    first = int(os.environ.get("RANK", "0")) == 0
    try:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                             timeout=IDLE)
        config = RolloutConfig(**spec["rollout"])
        group = EngineGroup(config.vllm_tensor_parallel_size)
        llm = start_llm(spec["dir"], getattr(torch, spec["dtype"]), config,
                        spec["max_model_len"], spec["seed"])
        listener = (Listener(("127.0.0.1", 0), authkey=bytes.fromhex(spec["authkey"]))
                    if first else None)
    except Exception as exc:  # noqa: BLE001 - the parent raises it as one line
        unlink_cpu_shm(shm_prefix())  # what vLLM made before it failed (os._exit runs no C++)
        print(MARK + json.dumps({"error": one_line(exc)}), file=replies, flush=True)
        os._exit(1)
    ready = {"port": listener.address[1]} if first else {"ready": group.rank}
    print(MARK + json.dumps(ready), file=replies, flush=True)
    try:  # with the training rank, once it has read every process's line
        group.weights = weight_group(spec["weights_port"], group.rank + 1, group.size + 1,
                                     config.vllm_timeout)
    except Exception:  # noqa: BLE001 - its training rank gone, or failed: it says so
        os._exit(1)
    if not first:
        try:
            follow(llm, group)
        except Exception:  # noqa: BLE001 - the first process gone: its ranks say so
            os._exit(1)
        os._exit(0)
    conns: list[Any] = [None] * spec["clients"]
    for _ in conns:
        conn = listener.accept()
        conns[conn.recv()] = conn
    serve(llm, group, conns)
    os._exit(0)  # the engine's threads are not joined: its process ends with its ranks


if __name__ == "__main__":
    main()
