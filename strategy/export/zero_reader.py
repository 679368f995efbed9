"""Reading the weights of a DeepSpeed checkpoint one tensor at a time, without running DeepSpeed.

The layout below is DeepSpeed 0.19.8's (``engine.save_checkpoint``, checked with torch 2.13); its
file names and keys come from ``internals.deepspeed_files``, pinned there. In a tag directory:

- ZeRO 1/2: ``mp_rank_00_model_states.pt`` holds ``module`` (the whole state dict in the training
  dtype), ``param_shapes`` (per optimizer group, name -> shape in flattening order),
  ``buffer_names``, ``shared_params`` (tied name -> the name holding the data) and, at stage 2,
  ``frozen_param_shapes``/``frozen_param_fragments`` (each frozen parameter whole). Rank r's
  ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds slice r of every group's fp32 master
  weights (``single_partition_of_fp32_groups``): the group's parameters flattened in order, each
  followed by its ``param_alignment_paddings``, cut into equal slices.
- ZeRO-3: every rank writes ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (rank 0's holds the
  buffers and the names; each holds its slice of every frozen parameter) and an optimizer file whose
  ``fp32_flat_groups`` hold, at the same offset on every rank, ceil(numel / world) elements of each
  trainable parameter (slice r, zero-padded), offsets running on across the sub-groups.
- ZeRO-0: no optimizer files; ``module`` holds every weight in the training dtype.
- BF16_Optimizer (ZeRO-1 + bf16 + fp32 gradient accumulation): ``bf16_`` optimizer files without
  ``zero_stage``, laid out as ZeRO-1 without per-parameter padding.

``read`` returns what ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
returns, bit for bit (trainable parameters in fp32 from the master weights, frozen ones as saved,
floating buffers in fp32), except that ZeRO-1's frozen parameters, which that function drops, come
from ``module``. Files are mapped, not read (``torch.load(weights_only=True, mmap=True)`` with only
DeepSpeed's own classes allowed); a tensor is copied out of the mapped pages chunk by chunk and each
chunk's pages are handed back, so memory holds about one tensor whatever the model's size.
Tensor-/pipeline-parallel, MoE and universal checkpoints are refused with one line.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from strategy.checkpoint.safe_load import load_torch_file, verify_torch_files
from strategy.errors import CheckpointFileError
from strategy.export.memory import MappedPages
from strategy.internals.deepspeed_files import (
    AUTOEP_LAYERS_KEY,
    AUTOEP_LAYERS_KEY_LEGACY,
    BUFFER_NAMES,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    FROZEN_PARAM_SHAPES,
    MODEL_STATES_FILE,
    MODULE,
    MP_WORLD_SIZE,
    OPTIMIZER_STATE_DICT,
    PARAM_ALIGNMENT_PADDINGS,
    PARAM_SHAPES,
    PARTITION_COUNT,
    SHARED_PARAMS,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    UNIVERSAL_DIR,
    ZERO_STAGE,
    is_pipeline_or_moe_file,
    optim_file_ranks,
    zero3_model_file_ranks,
)

_CHUNK = 4 * 2**20  # elements copied between two page releases (16 MiB of fp32)


def _damaged(path: object, problem: str) -> CheckpointFileError:
    return CheckpointFileError(f"{path}: {problem}; restore the checkpoint or export another tag")


def _unsupported(path: object, kind: str) -> CheckpointFileError:
    return CheckpointFileError(f"{path}: {kind} checkpoint, which this export cannot read (it "
                               "reads data-parallel ZeRO 0-3 checkpoints); export it with "
                               "DeepSpeed's own tools")


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's full shape and the dtype ``ZeroCheckpoint.read`` returns it in."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Flat:
    """Mapped tensors read as one flat concatenation, without building it."""

    def __init__(self, parts: list[torch.Tensor], pages: MappedPages) -> None:
        self.parts = [part.reshape(-1) for part in parts]
        self.starts = list(itertools.accumulate((p.numel() for p in self.parts), initial=0))
        self.pages = pages

    @property
    def numel(self) -> int:
        return self.starts[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def copy(self, start: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, start + out.numel())`` into the flat ``out`` (converting the
        dtype), handing the source pages back after every chunk."""
        end = start + out.numel()
        for part, first in zip(self.parts, self.starts):
            low, high = max(start, first), min(end, first + part.numel())
            for pos in range(low, high, _CHUNK):
                count = min(_CHUNK, high - pos)
                source = part.narrow(0, pos - first, count)
                out.narrow(0, pos - start, count).copy_(source)
                self.pages.release(source)


Piece = tuple[_Flat, int, int]  # (source, first element, element count)


@dataclass
class _Entry:
    """How to assemble one tensor: consecutive ranges of mapped sources."""

    info: TensorInfo
    pieces: list[Piece]

    def read(self) -> torch.Tensor:
        out = torch.empty(self.info.numel, dtype=self.info.dtype)
        position = 0
        for flat, start, count in self.pieces:
            flat.copy(start, out.narrow(0, position, count))
            position += count
        return out.view(self.info.shape)


class ZeroCheckpoint:
    """One DeepSpeed checkpoint (a tag directory): ``index`` says what it holds from metadata alone,
    ``read(name)`` assembles one tensor. Use it as a context manager, or ``close`` it, to unmap
    the files."""

    def __init__(self, tag_dir: str | Path) -> None:
        self.dir = Path(tag_dir)
        self._pages = MappedPages()
        self._entries: dict[str, _Entry] = {}
        names = sorted(os.listdir(self.dir))
        _refuse_layouts(self.dir, names)
        verify_torch_files(str(self.dir))
        optim_files = _rank_files(self.dir, names, optim_file_ranks, "optimizer")
        optim = [_key(self._load(path), OPTIMIZER_STATE_DICT, path) for path in optim_files]
        self.stage = _stage(optim, optim_files)
        self.world_size = _world_size(optim, optim_files, self.dir) if optim else 1
        model_files = _model_files(self.dir, names, self.stage, self.world_size)
        models = [self._load(path) for path in model_files]
        _refuse_parallel(model_files[0], models[0])
        self._index(optim, optim_files, models, model_files[0])

    def __enter__(self) -> ZeroCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drop every mapped file (``read`` no longer works)."""
        self._pages.clear()
        self._entries = {}

    @property
    def index(self) -> dict[str, TensorInfo]:
        """Every tensor's name, full shape and dtype, in ``zero_to_fp32``'s order."""
        return {name: entry.info for name, entry in self._entries.items()}

    def read(self, name: str) -> torch.Tensor:
        """A fresh tensor holding ``name``'s values; the caller owns (and frees) it."""
        return self._entries[name].read()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one at a time, in ``index`` order."""
        for name, entry in self._entries.items():
            yield name, entry.read()

    def _load(self, path: Path) -> Any:
        state = load_torch_file(path, mmap=True)
        self._pages.track(path)
        return state

    def _whole(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> _Entry:
        info = TensorInfo(tuple(tensor.shape), dtype or tensor.dtype)
        return _Entry(info, [(_Flat([tensor], self._pages), 0, tensor.numel())])

    def _index(self, optim: list[dict], optim_files: list[Path], models: list[dict],
               model_file: Path) -> None:
        """zero_to_fp32's order: buffers, frozen parameters, trainable ones, then tied names."""
        first = models[0]
        module = _key(first, MODULE, model_file)
        if self.stage == 0:
            if first.get(PARAM_SHAPES) is not None:
                raise _damaged(self.dir, "the optimizer files (*_optim_states.pt) are missing")
            self._entries = {name: self._whole(t) for name, t in module.items()}
            return
        param_shapes = _key(first, PARAM_SHAPES, model_file)
        if param_shapes is None:
            raise _unsupported(model_file, "a pipeline-parallel (no param_shapes)")
        buffers = set(_key(first, BUFFER_NAMES, model_file))
        for name, tensor in module.items():
            if name in buffers:
                self._entries[name] = self._whole(tensor, _fp32_if_floating(tensor))
        self._add_frozen(models, model_file, module, param_shapes, first.get(SHARED_PARAMS) or {})
        if self.stage == 3:
            self._add_zero3(param_shapes, optim, optim_files)
        else:
            self._add_zero12(param_shapes, optim, optim_files)
        for alias, source in (first.get(SHARED_PARAMS) or {}).items():
            if source in self._entries:
                self._entries[alias] = self._entries[source]

    def _add_frozen(self, models: list[dict], model_file: Path, module: dict, param_shapes: list,
                    shared: dict) -> None:
        shapes = models[0].get(FROZEN_PARAM_SHAPES)
        if shapes is None and self.stage < 3:
            # ZeRO-1 saves no frozen_param_* (only stages that partition gradients do), but
            # ``module`` holds them as trained: they were never updated
            taken = {name for group in param_shapes for name in group} | set(shared)
            for name, tensor in module.items():
                if name not in taken and name not in self._entries:
                    self._entries[name] = self._whole(tensor)
            return
        for name, shape in (shapes or {}).items():
            fragments = [_key(state, FROZEN_PARAM_FRAGMENTS, model_file)[name] for state in models]
            flat = _Flat(fragments, self._pages)  # ZeRO-3: each rank's padded slice, in rank order
            numel = math.prod(shape)
            if flat.numel < numel:
                raise _damaged(model_file, f"frozen parameter {name} has {flat.numel} of its "
                               f"{numel} elements")
            self._entries[name] = _Entry(TensorInfo(tuple(shape), flat.dtype), [(flat, 0, numel)])

    def _add_zero12(self, param_shapes: list, optim: list[dict], files: list[Path]) -> None:
        partitions = [_key(state, SINGLE_PARTITION_OF_FP32_GROUPS, files[0]) for state in optim]
        paddings = optim[0].get(PARAM_ALIGNMENT_PADDINGS)  # absent from BF16_Optimizer's files
        if len(partitions[0]) != len(param_shapes):
            raise _damaged(files[0], f"{len(partitions[0])} fp32 groups but the model states name "
                           f"{len(param_shapes)}")
        for group, shapes in enumerate(param_shapes):
            flat = _Flat([rank_groups[group] for rank_groups in partitions], self._pages)
            pads = paddings[group] if paddings is not None else [0] * len(shapes)
            if len(pads) != len(shapes):
                raise _damaged(files[0], f"group {group}: {len(pads)} paddings for {len(shapes)} "
                               "parameters")
            offset = 0
            for (name, shape), pad in zip(shapes.items(), pads):
                numel = math.prod(shape)
                info = TensorInfo(tuple(shape), flat.dtype)
                self._entries[name] = _Entry(info, [(flat, offset, numel)])
                offset += numel + pad
            _check_consumed(offset, flat.numel, 2 * self.world_size, files[0], group)

    def _add_zero3(self, param_shapes: list, optim: list[dict], files: list[Path]) -> None:
        flats = [_Flat(_key(state, FP32_FLAT_GROUPS, path), self._pages)
                 for state, path in zip(optim, files)]
        if len({flat.numel for flat in flats}) != 1:
            raise _damaged(self.dir, "the ranks' fp32_flat_groups differ in size")
        offset = 0
        for shapes in param_shapes:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / self.world_size)
                pieces = [(flat, offset, min(part, numel - rank * part))
                          for rank, flat in enumerate(flats) if rank * part < numel]
                self._entries[name] = _Entry(TensorInfo(tuple(shape), flats[0].dtype), pieces)
                offset += part
        if offset != flats[0].numel:
            raise _damaged(files[0], f"its parameters use {offset} of {flats[0].numel} elements")


def _key(state: Any, key: str, path: Path) -> Any:
    if not isinstance(state, dict) or key not in state:
        raise _damaged(path, f"no {key!r} entry: not a DeepSpeed checkpoint file")
    return state[key]


def _fp32_if_floating(tensor: torch.Tensor) -> torch.dtype:
    return torch.float32 if tensor.is_floating_point() else tensor.dtype


def _check_consumed(used: int, available: int, align: int, path: Path, group: int) -> None:
    """zero_to_fp32's check: both ends padded to 2 x world size agree (ZeRO-2 pads each group)."""
    if used > available or -(-used // align) != -(-available // align):
        raise _damaged(path, f"group {group}: its parameters use {used} of {available} elements")


def _refuse_layouts(directory: Path, names: list[str]) -> None:
    """Pipeline, MoE and universal checkpoints, told apart by their files."""
    for name in names:
        if is_pipeline_or_moe_file(name):
            raise _unsupported(directory, f"a pipeline-parallel or MoE ({name})")
    if (directory / UNIVERSAL_DIR).is_dir() and not any(optim_file_ranks(n) for n in names):
        raise _unsupported(directory, "a universal (ds_to_universal's output)")


def _refuse_parallel(path: Path, state: dict) -> None:
    dims = state.get(CHECKPOINT_PARALLEL_DIMS) or {}
    degrees = {"mp_world_size": state.get(MP_WORLD_SIZE, 1),
               "tp_degree": dims.get(CHECKPOINT_TP_DEGREE, 1),
               "pp_degree": dims.get(CHECKPOINT_PP_DEGREE, 1)}
    parallel = {key: value for key, value in degrees.items() if value not in (None, 1)}
    if parallel:
        raise _unsupported(path, f"a tensor/pipeline-parallel ({parallel})")
    if state.get(AUTOEP_LAYERS_KEY) or state.get(AUTOEP_LAYERS_KEY_LEGACY):
        raise _unsupported(path, "an MoE (AutoEP)")


def _rank_files(directory: Path, names: list[str],
                ranks_of: Callable[[str], tuple[int, int] | None], what: str) -> list[Path]:
    """The files ``ranks_of`` recognizes, in rank order; every rank from 0 up must be there."""
    found: dict[int, Path] = {}
    for name in names:
        ranks = ranks_of(name)
        if ranks is None:
            continue
        if ranks[1] != 0:
            raise _unsupported(directory / name, "a tensor-parallel")
        if ranks[0] in found:
            raise _damaged(directory / name, f"a second {what} file for its rank")
        found[ranks[0]] = directory / name
    if sorted(found) != list(range(len(found))):
        raise _damaged(directory, f"{what} files of ranks {sorted(found)} only (some are missing)")
    return [found[rank] for rank in sorted(found)]


def _stage(optim: list[dict], files: list[Path]) -> int:
    if not optim:
        return 0
    if ZERO_STAGE in optim[0]:
        stage = int(optim[0][ZERO_STAGE])
    elif SINGLE_PARTITION_OF_FP32_GROUPS in optim[0]:
        stage = 1  # BF16_Optimizer
    else:
        raise _damaged(files[0], "no zero_stage: not a ZeRO optimizer file")
    if stage not in (1, 2, 3):
        raise _damaged(files[0], f"unknown ZeRO stage {stage}")
    return stage


def _world_size(optim: list[dict], files: list[Path], directory: Path) -> int:
    counts = _key(optim[0], PARTITION_COUNT, files[0])
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
    if len(set(counts)) != 1:
        raise _unsupported(files[0], f"an expert-parallel (partition counts {counts})")
    if counts[0] != len(files):
        raise _damaged(directory, f"written by {counts[0]} ranks but {len(files)} optimizer files "
                       "are there")
    return int(counts[0])


def _model_files(directory: Path, names: list[str], stage: int, world_size: int) -> list[Path]:
    if stage == 3:
        files = _rank_files(directory, names, zero3_model_file_ranks, "model-state")
        if len(files) != world_size:
            raise _damaged(directory, f"{len(files)} model-state files for {world_size} ranks")
        return files
    if MODEL_STATES_FILE not in names:
        raise _damaged(directory / MODEL_STATES_FILE, "not found")
    return [directory / MODEL_STATES_FILE]

