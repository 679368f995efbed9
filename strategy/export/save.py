"""``save_model``: a Hugging Face directory from any ZeRO stage, streamed.

Under ZeRO-3 parameters are gathered a bounded group at a time (about the largest tensor), rank 0
appends them to the current safetensors shard and lets them go before the next gather, so rank-0
memory never holds the model. Under ZeRO 0-2 rank 0 writes from its own parameters, tensor by
tensor, and no rank copies a state dict. Everything lands in a hidden sibling directory that is
renamed onto ``output_dir`` only when complete.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import deepspeed
import torch
from torch import nn

from strategy import dist
from strategy.atomic_fs import atomic_directory
from strategy.dtypes import resolve_dtype
from strategy.errors import SaveError
from strategy.export.memory import trim_heap
from strategy.export.metadata import write_export_metadata
from strategy.export.shards import ShardPlan, ShardWriter
from strategy.export.units import Unit, plan_export
from strategy.internals import is_zero3_param, tensor_parallel_gathered
from strategy.parallel.tensor import is_tensor_parallel_param


def save_model(model: nn.Module, tokenizer: Any, output_dir: str | Path,
               max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None,
               merge_lora: bool = False) -> Path:
    """Write an HF directory for ``model`` (an engine or a module); call it on every rank.

    A full model gets ``config.json``, ``generation_config.json``, sharded safetensors (+ index)
    and the tokenizer; a PEFT model its adapter only, or with ``merge_lora=True`` the merged full
    model.

    Args:
        model: a DeepSpeed engine or an ``nn.Module`` (full or PEFT).
        tokenizer: saved beside the weights when not None.
        output_dir: the directory to write; replaced only once the export is complete.
        max_shard_size: the largest safetensors shard, in bytes or as ``"5GB"``.
        dtype: converts floating tensors on the way out (default: as trained).
        merge_lora: write a PEFT model's merged full model instead of its adapter.

    Returns:
        ``output_dir`` as a ``Path``.

    Raises:
        SaveError: writing failed on rank 0 (raised on every rank).
    """
    module = getattr(model, "module", model)
    dtype = resolve_dtype(dtype)
    plan = plan_export(module, dtype, max_shard_size, merge_lora)
    sink = _DirSink(Path(output_dir), plan.shards, plan.prefix) if dist.is_rank_0() else _NullSink()
    owner = tensor_parallel_owners(module)
    with sink:
        for group in group_units(plan.units):
            with gathered_params([p for unit in group for p in unit.params], owner):
                for unit in group:
                    sink.write(unit)
            sink.release()
        sink.finish(lambda out: write_export_metadata(module, tokenizer, out, plan.adapter_only,
                                                      dtype or plan.shards.main_dtype()))
        # every rank raises the same line, so none waits in a later collective
        dist.raise_if_any_failed(sink.error, _failure(output_dir))
    dist.barrier()
    return Path(output_dir)


def _failure(output_dir: str | Path):
    def make(rank: int, message: str) -> SaveError:
        return SaveError(f"saving to {output_dir} failed on rank {rank} ({message}); free space or "
                         "fix the path and save again: a previous export there is untouched")
    return make


def group_units(units: list[Unit]) -> list[list[Unit]]:
    """Consecutive units whose gathered size stays within the largest single unit's (few
    collectives, bounded memory); the same on every rank."""
    budget = max((u.gather_bytes for u in units), default=0)
    groups: list[list[Unit]] = []
    size = budget + 1
    for unit in units:
        if size + unit.gather_bytes > budget or not groups:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += unit.gather_bytes
    return groups


def tensor_parallel_owners(module: nn.Module) -> dict[int, nn.Module]:
    """The AutoTP layer holding each tensor-parallel parameter (empty without AutoTP)."""
    return {id(param): layer for layer in module.modules()
            for param in layer.parameters(recurse=False) if is_tensor_parallel_param(param)}


def gathered_params(params: list[nn.Parameter], owner: dict[int, nn.Module]):
    """Whole parameters within the block: ZeRO-3 partitions gathered, AutoTP slices joined."""
    partitioned = [p for p in params if is_zero3_param(p)]
    if partitioned:
        return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    sliced = [p for p in params if id(p) in owner]
    return tensor_parallel_gathered(sliced, owner) if sliced else nullcontext()


class _NullSink:
    """Ranks other than 0: enter every gather, touch no file."""

    error: BaseException | None = None

    def __enter__(self) -> _NullSink:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def write(self, unit: Unit) -> None:
        pass

    def finish(self, write_metadata) -> None:
        pass

    def release(self) -> None:
        pass


class _DirSink:
    """Rank 0: shards into a temporary sibling that replaces ``output_dir`` on success. A failure is
    kept (not raised) until every rank has passed the same gathers."""

    def __init__(self, output_dir: Path, plan: ShardPlan, prefix: str) -> None:
        self.output_dir, self.plan, self.prefix = output_dir, plan, prefix
        self.error: BaseException | None = None

    def __enter__(self) -> _DirSink:
        self._atomic = atomic_directory(self.output_dir)
        try:
            self.tmp = self._atomic.__enter__()
        except Exception as exc:  # noqa: BLE001 - e.g. output_dir is a file: raised after gathers
            self.error, self._atomic = exc, None
        else:
            self.writer = ShardWriter(self.tmp, self.plan, self.prefix)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._atomic is not None:
            self._atomic.__exit__(*exc)

    def write(self, unit: Unit) -> None:
        if self.error is not None:
            return
        try:
            unit.write(self.writer)
        except Exception as exc:  # noqa: BLE001 - reported on every rank after the loop
            self.error = exc

    def release(self) -> None:
        """Hand the group's freed buffers back to the OS (``memory.trim_heap``)."""
        trim_heap()

    def finish(self, write_metadata) -> None:
        if self.error is not None:
            return
        try:
            self.writer.close()
            write_metadata(self.tmp)
        except Exception as exc:  # noqa: BLE001
            self.error = exc
