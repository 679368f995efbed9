"""The weight sync's wire: a process group between the training rank that streams the policy
(rank 0, which holds the group's store) and every process of the engines it feeds (1..), and the
stream it carries, self-describing: tensors go in buckets of up to ``BUCKET_BYTES``, each a
header (its tensors' names, dtypes, shapes and offsets, JSON in a byte tensor after its length)
then the bucket's bytes, both broadcast from rank 0; an empty header ends the stream. A tensor
larger than a bucket goes alone, as it is. Three broadcasts per bucket, not per tensor: each is a
round trip (measured here: ~0.5 ms for a small gloo broadcast on one node), and a model has
hundreds of tensors. No side channel is needed: an engine's workers read the stream from the
group alone, so one ``collective_rpc`` per sync drives them (``rollout.vllm_worker``), and the
engines' processes may be on any node (the store's host is the streaming rank's address).

NCCL on CUDA (device to device, as OpenRLHF's), gloo on CPU.
"""

from __future__ import annotations

import json
import math
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


BUCKET_BYTES = 64 << 20  # a bucket's size: one copy of it on the streaming rank and on each reader
ALIGN = 64  # each tensor's offset in a bucket: any dtype's view of its bytes is aligned


def send_weights(group: Any, tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int = BUCKET_BYTES) -> int:
    """Stream ``tensors`` to every engine process of ``group`` (rank 0's side): each copied into
    the bucket before the next is asked for (a gathered group may be released after), a full
    bucket broadcast, then the end.

    Returns:
        The tensors sent.
    """
    bucket = _Bucket(group, bucket_bytes)
    count = 0
    for name, tensor in tensors:
        bucket.add(name, tensor.detach().to(wire_device()).contiguous())
        count += 1
    bucket.send()
    _send_header(group, {})
    return count


class _Bucket:
    """The streaming rank's bucket: one buffer, reused (each broadcast has ended before it is
    written again)."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size
        self.buffer: torch.Tensor | None = None
        self.entries: list[list] = []
        self.used = 0

    def add(self, name: str, data: torch.Tensor) -> None:
        raw = data.reshape(-1).view(torch.uint8)
        entry = [name, str(data.dtype).removeprefix("torch."), list(data.shape)]
        if _aligned(self.used) + raw.numel() > self.size:
            self.send()
        if raw.numel() > self.size:  # alone, as it is
            _send_header(self.group, {"tensors": [[*entry, 0]], "bytes": raw.numel()})
            broadcast(self.group, raw)
            return
        if self.buffer is None:
            self.buffer = torch.empty(self.size, dtype=torch.uint8, device=wire_device())
        offset = _aligned(self.used)
        self.buffer[offset:offset + raw.numel()].copy_(raw)
        self.entries.append([*entry, offset])
        self.used = offset + raw.numel()

    def send(self) -> None:
        if not self.entries:
            return
        _send_header(self.group, {"tensors": self.entries, "bytes": self.used})
        broadcast(self.group, self.buffer[:self.used])
        self.entries, self.used = [], 0


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class WeightStream:
    """The engine's side: the tensors ``send_weights`` streams, in its order, up to its end.
    ``drain`` reads what a consumer that failed part way left unread, so the next sync lines up
    on every process."""

    def __init__(self, group: Any) -> None:
        self.group, self.ended = group, False

    def _next(self) -> list[tuple[str, torch.Tensor]]:
        """The next bucket's tensors (views of a buffer of its own: a consumer may keep them)."""
        header = _read_header(self.group)
        if not header:
            self.ended = True
            return []
        buffer = torch.empty(header["bytes"], dtype=torch.uint8, device=wire_device())
        broadcast(self.group, buffer)
        out = []
        for name, dtype, shape, offset in header["tensors"]:
            kind = getattr(torch, dtype)
            count = math.prod(shape) * kind.itemsize
            out.append((name, buffer[offset:offset + count].view(kind).reshape(shape)))
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while not self.ended:
            yield from self._next()

    def drain(self) -> None:
        """Read the stream to its end."""
        while not self.ended:
            self._next()
