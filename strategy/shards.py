"""Sharded safetensors written tensor by tensor, and directories that appear only when complete.

The shard plan (which tensor goes in which file, at which offset) is made from shapes and dtypes
alone, so each shard's header is written first and every tensor is appended the moment it is
ready: the writer never holds a shard in memory. The layout is the one transformers writes
(``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``, or one
``model.safetensors``).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import struct
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5e9 bytes (GB = 10^9, GiB = 2^30, as transformers reads ``max_shard_size``)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B?)\s*", size.upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"max_shard_size={size!r} is invalid: use bytes or a size like '500MB' or '5GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass
class TensorSpec:
    """A tensor to be written: its name in the file, shape and on-disk dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class ShardPlan:
    """Which file each tensor goes to, in write order."""

    shards: list[list[TensorSpec]] = field(default_factory=list)

    def filenames(self, prefix: str = "model") -> list[str]:
        n = len(self.shards)
        if n == 1:
            return [f"{prefix}.safetensors"]
        return [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> ShardPlan:
    """Greedy split in order, as transformers does: a tensor larger than the limit gets its own shard."""
    plan, current, size = ShardPlan(), [], 0
    for spec in specs:
        if current and size + spec.nbytes > max_shard_bytes:
            plan.shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    plan.shards.append(current)  # an empty model still gets one (empty) file
    return plan


def _header(specs: list[TensorSpec]) -> bytes:
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for s in specs:
        if s.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {s.name!r} has dtype {s.dtype}, which safetensors cannot store: pass dtype=")
        meta[s.name] = {"dtype": _ST_DTYPES[s.dtype], "shape": list(s.shape),
                        "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes a planned set of shards; ``write`` must be called in plan order."""

    def __init__(self, directory: str | Path, plan: ShardPlan, prefix: str = "model") -> None:
        self.dir, self.plan, self.prefix = Path(directory), plan, prefix
        self.names = plan.filenames(prefix)
        self._order = [(i, s) for i, shard in enumerate(plan.shards) for s in shard]
        self._next, self._file, self._shard = 0, None, -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (converted to its planned dtype) to its shard; the caller may free it after."""
        shard, spec = self._order[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(f"tensor {name} {tuple(tensor.shape)} written out of plan order: expected "
                               f"{spec.name} {spec.shape}")
        if shard != self._shard:
            self._open(shard)
        t = tensor.detach().to(device="cpu", dtype=spec.dtype).contiguous().reshape(-1)
        if t.numel():
            self._file.write(memoryview(t.view(torch.uint8).numpy()))
        self._next += 1

    def _open(self, shard: int) -> None:
        self._close_file()
        self._shard = shard
        self._file = open(self.dir / self.names[shard], "wb")
        self._file.write(_header(self.plan.shards[shard]))

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Finish the last shard (and create empty planned shards); write the index when sharded."""
        if self._next != len(self._order):
            raise RuntimeError(f"{len(self._order) - self._next} planned tensors were never written")
        self._close_file()
        for i in range(self._shard + 1, len(self.names)):  # only an empty plan leaves files unopened
            self._open(i)
            self._close_file()
        if len(self.names) > 1:
            self._write_index()

    def _write_index(self) -> None:
        weight_map = {s.name: self.names[i] for i, shard in enumerate(self.plan.shards) for s in shard}
        specs = [s for shard in self.plan.shards for s in shard]
        metadata = {"total_parameters": sum(s.numel for s in specs), "total_size": sum(s.nbytes for s in specs)}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        with open(self.dir / f"{self.prefix}.safetensors.index.json", "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")


# ------------------------------------------------------------------ atomic directories
def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _publish(tmp: Path, final: Path) -> None:
    """Put the complete ``tmp`` at ``final``; an earlier ``final`` is replaced only after that."""
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp)  # tmp now holds the earlier export
    else:  # brief window where ``final`` is missing, but the earlier export survives as ``old``
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(final: Path) -> None:
    """Delete what earlier crashed saves to ``final`` left beside it."""
    for p in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in final.parent.glob(f".{final.name}.old-*"):
        shutil.rmtree(p, ignore_errors=True)


@contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; on success it becomes ``final``, on error it is removed.
    A killed process leaves only a hidden ``.NAME.tmp-*`` sibling, cleaned by the next save."""
    final = Path(final).absolute()
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"output_dir={str(final)!r} is a file: pass a directory path")
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, final)
