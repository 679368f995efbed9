"""Sharded safetensors written tensor by tensor.

The shard plan (which tensor goes in which file, at which offset) is made from shapes and dtypes
alone, so each shard's header is written first and every tensor is appended the moment it is
ready: the writer never holds a shard in memory. The layout is the one transformers writes
(``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``, or one
``model.safetensors``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strategy.dtypes import SAFETENSORS_CODES
from strategy.errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5e9 bytes (GB = 10^9, GiB = 2^30, as transformers reads
    ``max_shard_size``)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B?)\s*", size.upper())
    if not match or match.group(2) not in _UNITS:
        raise ConfigError(f"max_shard_size={size!r} is invalid: use bytes or a size like "
                          "'500MB' or '5GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@dataclass
class TensorSpec:
    """A tensor to be written: its name in the file, shape and on-disk dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class ShardPlan:
    """Which file each tensor goes to, in write order."""

    shards: list[list[TensorSpec]] = field(default_factory=list)

    def main_dtype(self) -> torch.dtype:
        """The dtype of most floating bytes (what config.json's ``dtype`` should say)."""
        floats = [spec for shard in self.shards for spec in shard if spec.dtype.is_floating_point]
        return max(floats, key=lambda spec: spec.nbytes).dtype if floats else torch.float32

    def filenames(self, prefix: str = "model") -> list[str]:
        count = len(self.shards)
        if count == 1:
            return [f"{prefix}.safetensors"]
        return [f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> ShardPlan:
    """Greedy split in order, as transformers does: a tensor larger than the limit gets its own
    shard."""
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
    for spec in specs:
        if spec.dtype not in SAFETENSORS_CODES:
            raise ValueError(f"tensor {spec.name!r} has dtype {spec.dtype}, which safetensors "
                             "cannot store: pass dtype=")
        meta[spec.name] = {"dtype": SAFETENSORS_CODES[spec.dtype], "shape": list(spec.shape),
                           "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
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
        """Append ``tensor`` (converted to its planned dtype) to its shard; the caller may free it
        after."""
        shard, spec = self._order[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(f"tensor {name} {tuple(tensor.shape)} written out of plan order: "
                               f"expected {spec.name} {spec.shape}")
        if shard != self._shard:
            self._open(shard)
        flat = tensor.detach().to(device="cpu", dtype=spec.dtype).contiguous().reshape(-1)
        if flat.numel():
            self._file.write(memoryview(flat.view(torch.uint8).numpy()))
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
            raise RuntimeError(f"{len(self._order) - self._next} planned tensors were never "
                               "written")
        self._close_file()
        # only an empty plan leaves files unopened
        for shard in range(self._shard + 1, len(self.names)):
            self._open(shard)
            self._close_file()
        if len(self.names) > 1:
            self._write_index()

    def _write_index(self) -> None:
        weight_map = {spec.name: self.names[shard_no]
                      for shard_no, shard in enumerate(self.plan.shards) for spec in shard}
        specs = [s for shard in self.plan.shards for s in shard]
        metadata = {"total_parameters": sum(s.numel for s in specs),
                    "total_size": sum(s.nbytes for s in specs)}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        with open(self.dir / f"{self.prefix}.safetensors.index.json", "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)
            fh.write("\n")
