"""The weight sync's wire: a process group between the training rank that streams the policy
(rank 0, which holds the group's store) and every process of the engines it feeds (1..), and the
stream it carries, self-describing: each tensor goes as a header (its name, dtype and shape, JSON
in a byte tensor after its length) then the tensor itself, both broadcast from rank 0; an empty
header ends the stream. No side channel is needed: an engine's workers read the stream from the
group alone, so one ``collective_rpc`` per sync drives them (``rollout.vllm_worker``), and the
engines' processes may be on any node (the store's host is the streaming rank's address).

NCCL on CUDA (device to device, as OpenRLHF's), gloo on CPU.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch


def wire_device() -> torch.device:
    """Where a synced tensor travels: this process's GPU (NCCL), else host memory (gloo)."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def weight_group(port: int, rank: int, size: int, seconds: float,
                 host: str = "127.0.0.1") -> Any:
    """The sync's process group of ``size``: the streaming rank (0, which holds the store on
    ``host:port``) and the engine processes (1..), apart from either side's own world. Every
    member waits at most ``seconds`` for the others."""
    timeout = timedelta(seconds=seconds)
    store = torch.distributed.TCPStore(host, port, size, is_master=rank == 0,
                                       timeout=timeout, wait_for_workers=False)
    if torch.cuda.is_available():
        return torch.distributed.ProcessGroupNCCL(store, rank, size)
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """``tensor`` from the group's rank 0 (the training rank) to every engine process."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _send_header(group: Any, header: dict) -> None:
    data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    broadcast(group, torch.tensor([data.numel()], dtype=torch.int64, device=wire_device()))
    broadcast(group, data.to(wire_device()))


def _read_header(group: Any) -> dict:
    size = torch.empty(1, dtype=torch.int64, device=wire_device())
    broadcast(group, size)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=wire_device())
    broadcast(group, data)
    return json.loads(bytes(data.cpu().tolist()).decode())


def send_weights(group: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Stream ``tensors`` to every engine process of ``group`` (rank 0's side), each broadcast
    before the next is asked for (a gathered group may be released after), then the end.

    Returns:
        The tensors sent.
    """
    count = 0
    for name, tensor in tensors:
        data = tensor.detach().to(wire_device()).contiguous()
        _send_header(group, {"name": name, "dtype": str(data.dtype).removeprefix("torch."),
                             "shape": list(data.shape)})
        broadcast(group, data)
        count += 1
    _send_header(group, {})
    return count


class WeightStream:
    """The engine's side: the tensors ``send_weights`` streams, in its order, up to its end.
    ``drain`` reads what a consumer that failed part way left unread, so the next sync lines up
    on every process."""

    def __init__(self, group: Any) -> None:
        self.group, self.ended = group, False

    def _next(self) -> tuple[str, torch.Tensor] | None:
        header = _read_header(self.group)
        if not header:
            self.ended = True
            return None
        out = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]),
                          device=wire_device())
        broadcast(self.group, out)
        return header["name"], out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while not self.ended:
            item = self._next()
            if item is not None:
                yield item

    def drain(self) -> None:
        """Read the stream to its end."""
        while not self.ended:
            self._next()
