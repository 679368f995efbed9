"""A vLLM engine in a process of its own (``--vllm_num_engines``), serving the training ranks
that share it over local sockets. Started by the first of those ranks
(``RemoteVllmRollout``), never by hand:

    python -c "from strategy.rollout.vllm_server import main; main()"   (settings on stdin)

- Start-up: a one-process world of its own (vLLM's ``external_launcher`` in this process, on
  the device its parent chose), the engine built from the ``config.json`` its parent wrote,
  placeholder weights; then one JSON line on stdout after ``MARK``, ``{"port": P}`` (or
  ``{"error": "..."}``),
  and a connection accepted from each of its ranks (authenticated with the key it was given).
- Calls in lockstep: each call is read from every rank before it runs (the training ranks
  call alike). ``generate``: every rank's rows in one batch, each rank answered its own tokens
  and log-probs. ``sync``: the first rank streams the tensors (a header, then the raw bytes, one
  tensor at a time) straight into vLLM's in-place reload; the others only wait for it. An error
  is answered to every rank as one line, and the engine serves on.
- Lifetime: it ends when a rank closes its connection or dies (end of file), and with its
  parent (``PR_SET_PDEATHSIG``, set by the parent at start): no engine outlives its job.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from multiprocessing.connection import Connection, Listener
from typing import Any, Iterator

import torch
from transformers import GenerationConfig

from strategy.rollout.config import RolloutConfig
from strategy.rollout.vllm_engine import run_requests, start_llm

MARK = "[strategy vllm engine] "  # starts the line the parent waits for (imports may print)
GENERATION_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
                   "eos_token_id", "pad_token_id")


def generation_settings(generation_config: GenerationConfig) -> dict[str, Any]:
    """What the engine needs of a ``GenerationConfig``, as plain values."""
    return {key: getattr(generation_config, key, None) for key in GENERATION_KEYS}


def send_tensor(conn: Connection, name: str, tensor: torch.Tensor) -> None:
    """One tensor down ``conn``: its header, then its bytes (no pickling of the data)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    conn.send(("tensor", name, str(flat.dtype).removeprefix("torch."), list(tensor.shape)))
    conn.send_bytes(flat.view(torch.uint8).numpy() if flat.numel() else b"")


class TensorStream:
    """The tensors ``send_tensor`` sent down ``conn``, up to the stream's end marker."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.ended = conn, False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while not self.ended:
            header = self.conn.recv()
            if header[0] == "end":
                self.ended = True
                return
            _, name, dtype, shape = header
            data = self.conn.recv_bytes()
            raw = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                   else torch.empty(0, dtype=torch.uint8))
            yield name, raw.view(getattr(torch, dtype)).reshape(shape)

    def drain(self) -> None:
        """Read what is left unread (a reload that failed part way), so the next call lines
        up."""
        while not self.ended:
            header = self.conn.recv()
            self.ended = header[0] == "end"
            if not self.ended:
                self.conn.recv_bytes()


def serve(llm: Any, conns: list[Connection]) -> None:
    """Answer the ranks' calls until one of them closes."""
    while True:
        try:
            calls = [conn.recv() for conn in conns]
        except (EOFError, OSError):
            return
        kind = calls[0][0]
        if kind == "close" or any(call[0] != kind for call in calls):
            return
        try:
            replies = {"generate": generate, "sync": reload}[kind](llm, calls, conns)
        except Exception as exc:  # noqa: BLE001 - answered to every rank as one line
            message = str(exc).strip().splitlines()
            replies = [("error", (type(exc).__name__, message[0][:300] if message else ""))
                       ] * len(conns)
        for conn, reply in zip(conns, replies):
            conn.send(reply)


def generate(llm: Any, calls: list[tuple], conns: list[Connection]) -> list[tuple]:
    """Every rank's rows in one batch; each rank's tokens and log-probs back to it."""
    prompts = [row for call in calls for row in call[1]]
    seeds = [seed for call in calls for seed in call[2]]
    tokens, logprobs = run_requests(llm, prompts, seeds, GenerationConfig(**calls[0][3]))
    replies, start = [], 0
    for call in calls:
        rows = slice(start, start + len(call[1]))
        replies.append(("ok", (tokens[rows], logprobs[rows])))
        start = rows.stop
    return replies


def reload(llm: Any, calls: list[tuple], conns: list[Connection]) -> list[tuple]:
    """The first rank's stream into vLLM's in-place reload, then the prefix cache reset."""
    stream = TensorStream(conns[0])
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(stream)})
    finally:
        stream.drain()
    llm.reset_prefix_cache()
    return [("ok", None)] * len(conns)


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
    try:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        config = RolloutConfig(**spec["rollout"])
        llm = start_llm(spec["dir"], getattr(torch, spec["dtype"]), config,
                        spec["max_model_len"], spec["seed"])
        listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(spec["authkey"]))
    except Exception as exc:  # noqa: BLE001 - the parent raises it as one line
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(MARK + json.dumps({"error": error}), file=replies, flush=True)
        os._exit(1)
    print(MARK + json.dumps({"port": listener.address[1]}), file=replies, flush=True)
    conns: list[Any] = [None] * spec["clients"]
    for _ in conns:
        conn = listener.accept()
        conns[conn.recv()] = conn
    serve(llm, conns)
    os._exit(0)  # the engine's threads are not joined: its process ends with its ranks


if __name__ == "__main__":
    main()
