"""Hugging Face export from any ZeRO stage, streamed: ``save_model`` and ``python -m strategy.export``.

Under ZeRO-3 parameters are gathered a bounded group at a time (about the largest tensor), rank 0
appends them to the current safetensors shard and lets them go before the next gather, so rank-0
memory never holds the model. Under ZeRO 0-2 rank 0 writes from its own parameters, tensor by
tensor, and no rank copies a state dict. Everything lands in a hidden sibling directory that is
renamed onto ``output_dir`` only when complete.

Offline: ``python -m strategy.export CKPT_DIR OUT_DIR [--tag T] [--max_shard_size S] [--dtype D]
[--merge_lora]`` turns a DeepSpeed checkpoint into the same HF directory (see ``offline_export``).
"""

from __future__ import annotations

import copy
import ctypes
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from strategy import dist
from strategy.export_units import Unit, adapter_units, full_units, merged_units
from strategy.shards import ShardWriter, atomic_directory, parse_size, plan_shards

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def is_peft_model(module: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def save_model(model: nn.Module, tokenizer: Any, output_dir: str | Path, max_shard_size: int | str = "5GB",
               dtype: torch.dtype | str | None = None, merge_lora: bool = False) -> Path:
    """Write an HF directory for ``model`` (an engine or a module); call it on every rank.

    A full model gets ``config.json``, ``generation_config.json``, sharded safetensors (+ index) and the
    tokenizer; a PEFT model its adapter only, or with ``merge_lora=True`` the merged full model.
    ``dtype`` converts floating tensors on the way out (default: as trained)."""
    module = getattr(model, "module", model)
    peft = is_peft_model(module)
    if merge_lora and not peft:
        raise ValueError("merge_lora=True needs a PEFT model: pass merge_lora=False for a plain model")
    dtype = resolve_dtype(dtype)
    if peft and not merge_lora:
        units, prefix, limit = adapter_units(module, dtype), "adapter_model", float("inf")  # peft reads one file
    else:
        units, prefix, limit = (merged_units(module, dtype) if peft else full_units(module, dtype)), "model", \
            parse_size(max_shard_size)
    plan = plan_shards([s for u in units for s in u.specs], limit)
    sink = _DirSink(Path(output_dir), plan, prefix) if dist.is_rank_0() else _NullSink()
    with sink:
        for group in group_units(units):
            with _gathered([p for u in group for p in u.params]):
                for unit in group:
                    sink.write(unit)
            sink.release()
        sink.finish(lambda d: _write_metadata(module, tokenizer, d, peft and not merge_lora, dtype, plan))
        error = dist.broadcast_object(None if sink.error is None else f"{type(sink.error).__name__}: {sink.error}")
        if error is not None:  # every rank raises the same line, so none waits in a later collective
            raise RuntimeError(f"saving to {output_dir} failed on rank 0 ({error}); free space or fix the path "
                               f"and save again: a previous export there is untouched") from sink.error
    dist.barrier()
    return Path(output_dir)


def group_units(units: list[Unit]) -> list[list[Unit]]:
    """Consecutive units whose gathered size stays within the largest single unit's (few collectives,
    bounded memory); the same on every rank."""
    budget = max((u.gather_bytes for u in units), default=0)
    groups: list[list[Unit]] = []
    size = budget + 1
    for u in units:
        if size + u.gather_bytes > budget or not groups:
            groups.append([])
            size = 0
        groups[-1].append(u)
        size += u.gather_bytes
    return groups


def _gathered(params: list[nn.Parameter]):
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def _load_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()


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

    def __init__(self, output_dir: Path, plan, prefix: str) -> None:
        self.output_dir, self.plan, self.prefix = output_dir, plan, prefix
        self.error: BaseException | None = None

    def __enter__(self) -> _DirSink:
        self._atomic = atomic_directory(self.output_dir)
        try:
            self.tmp = self._atomic.__enter__()
        except Exception as e:  # noqa: BLE001 - e.g. output_dir is a file; raised after the gathers
            self.error, self._atomic = e, None
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
            produced = unit.produce()
            for spec in unit.specs:
                self.writer.write(spec.name, produced[spec.name])
        except Exception as e:  # noqa: BLE001 - reported on every rank after the loop
            self.error = e

    def release(self) -> None:
        """Hand the group's freed buffers back to the OS: glibc keeps freed blocks under its (adaptive,
        up to 32 MB) mmap threshold on the heap, so without this rank-0 RSS creeps up group by group."""
        if _malloc_trim is not None:
            _malloc_trim(0)

    def finish(self, write_metadata) -> None:
        if self.error is not None:
            return
        try:
            self.writer.close()
            write_metadata(self.tmp)
        except Exception as e:  # noqa: BLE001
            self.error = e


def _write_metadata(module: nn.Module, tokenizer: Any, out: Path, adapter_only: bool, dtype, plan) -> None:
    if adapter_only:
        _write_adapter_config(module, out)
    else:
        base = module.get_base_model() if is_peft_model(module) else module
        _write_model_config(base, out, dtype or _main_dtype(plan))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def save_model_metadata(model: nn.Module, directory: str | Path, tokenizer: Any = None) -> None:
    """What ``python -m strategy.export`` needs beside a DeepSpeed checkpoint: the base model's
    ``config.json`` (+ ``generation_config.json``), ``adapter_config.json`` for a PEFT model, the
    tokenizer's files. No collectives: call it on the rank that writes (rank 0)."""
    module = getattr(model, "module", model)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    base = module.get_base_model() if is_peft_model(module) else module
    _write_model_config(base, out, next(base.parameters()).dtype)
    if is_peft_model(module):
        _write_adapter_config(module, out)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def _write_adapter_config(module: nn.Module, out: Path) -> None:
    from strategy.export_units import active_adapter

    config = copy.deepcopy(module.peft_config[active_adapter(module)])
    config.inference_mode = True
    config.save_pretrained(str(out))


def _main_dtype(plan) -> torch.dtype:
    floats = [s for shard in plan.shards for s in shard if s.dtype.is_floating_point]
    return max(floats, key=lambda s: s.nbytes).dtype if floats else torch.float32


def _write_model_config(base: nn.Module, out: Path, dtype: torch.dtype) -> None:
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]
    config.dtype = dtype
    config.save_pretrained(str(out))
    generation = getattr(base, "generation_config", None)
    if generation is not None and getattr(base, "can_generate", lambda: False)():
        generation.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> None:
    from strategy.offline_export import main as offline_main

    offline_main(argv)


if __name__ == "__main__":
    main()
