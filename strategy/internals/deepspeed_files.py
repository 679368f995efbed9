"""DeepSpeed's checkpoint files: their names and keys, the universal conversion, and loading them
``weights_only``. Each entry with why, pinned by ``tests/test_internals.py`` (checked on DeepSpeed
0.19.8 with torch 2.13.0).

The on-disk layout ``engine.save_checkpoint`` writes into a tag directory (keys are
``deepspeed.checkpoint.constants`` where DeepSpeed names them, re-exported here, else the literals
below): ``mp_rank_00_model_states.pt`` (ZeRO 0-2: ``module``, ``param_shapes``, ``buffer_names``,
``shared_params``, ``frozen_param_*``); per rank
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` and, at ZeRO-3,
``zero_pp_rank_<r>_mp_rank_00_model_states.pt``. ``export.zero_reader`` reads them.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import re
import types
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch
from deepspeed.checkpoint import ds_to_universal
from deepspeed.checkpoint.constants import (  # noqa: F401 - re-exported: the keys of the files
    AUTOEP_LAYERS_KEY,
    AUTOEP_LAYERS_KEY_LEGACY,
    BF16_ZERO_FILE_PREFIX,
    BUFFER_NAMES,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    FROZEN_PARAM_SHAPES,
    LAYER_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    MODEL_FILE_SUFFIX,
    OPTIM_FILE_SUFFIX,
    OPTIMIZER_STATE_DICT,
    PARAM_ALIGNMENT_PADDINGS,
    PARAM_SHAPES,
    PARTITION_COUNT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    ZERO_FILE_PREFIX,
    ZERO_STAGE,
)
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

# ------------------------------------------------------------ names and keys of the files

# keys DeepSpeed writes without a constant for them
MODULE, SHARED_PARAMS, MP_WORLD_SIZE = "module", "shared_params", "mp_world_size"
EXPERT_OPTIM_PREFIX = "expp_rank_"  # MoE expert optimizer files
UNIVERSAL_DIR = "zero"  # ds_to_universal's per-parameter folders
MODEL_STATES_FILE = f"{MODEL_FILE_PREFIX}00{MODEL_FILE_SUFFIX}"  # ZeRO 0-2: the whole module

_RANKS = rf"(\d+)_{MODEL_FILE_PREFIX}(\d+)"
_OPTIM_FILE = re.compile(rf"(?:{BF16_ZERO_FILE_PREFIX}|{ZERO_FILE_PREFIX}){_RANKS}"
                         + re.escape(OPTIM_FILE_SUFFIX))
_ZERO3_MODEL_FILE = re.compile(rf"{ZERO_FILE_PREFIX}{_RANKS}" + re.escape(MODEL_FILE_SUFFIX))


def _ranks(pattern: re.Pattern, name: str) -> tuple[int, int] | None:
    match = pattern.fullmatch(name)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def optim_file_ranks(name: str) -> tuple[int, int] | None:
    """(data-parallel rank, model-parallel rank) of a ZeRO optimizer-state file's name, or None
    when ``name`` is not one."""
    return _ranks(_OPTIM_FILE, name)


def zero3_model_file_ranks(name: str) -> tuple[int, int] | None:
    """(data-parallel rank, model-parallel rank) of a ZeRO-3 per-rank model-state file's name, or
    None when ``name`` is not one."""
    return _ranks(_ZERO3_MODEL_FILE, name)


def is_pipeline_or_moe_file(name: str) -> bool:
    """A pipeline-parallel layer file or an MoE expert optimizer file."""
    return name.startswith((LAYER_FILE_PREFIX, EXPERT_OPTIM_PREFIX))


# ------------------------------------------------------------ universal conversion


def universal_args(src_dir: str, dst_dir: str) -> argparse.Namespace:
    """The namespace ``ds_to_universal.main`` reads (its parser's fields, one worker each)."""
    return argparse.Namespace(input_folder=src_dir, output_folder=dst_dir, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)


def convert_to_universal(src_dir: str, dst_dir: str) -> None:
    """DeepSpeed's ``ds_to_universal`` has only a command-line entry (``main(args)``)."""
    ds_to_universal.main(universal_args(src_dir, dst_dir))


# ------------------------------------------------------------ safe loading


def deepspeed_checkpoint_globals() -> list[type]:
    """The non-tensor classes DeepSpeed pickles into its ``.pt`` checkpoint files (the dynamic
    loss scaler with fp16 training)."""
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


# The DeepSpeed modules whose functions ``torch.load`` checkpoint files while an engine loads one
# (its checkpoint engine; the universal format's optimizer state and parameter fragments) or while
# ``ds_to_universal`` converts one. Each calls ``torch.load`` through its module global ``torch``.
TORCH_LOAD_CALLERS = (
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
    "deepspeed.runtime.base_optimizer",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.checkpoint.universal_checkpoint",
    "deepspeed.checkpoint.ds_to_universal",
    "deepspeed.checkpoint.deepspeed_checkpoint",
    "deepspeed.checkpoint.zero_checkpoint",
    "deepspeed.checkpoint.reshape_3d_utils",
    "deepspeed.checkpoint.autoep_universal",
)


class _TorchWithLoad(types.ModuleType):
    """``torch`` as one module sees it: ``load`` replaced, every other name torch's own."""

    def __init__(self, load: Callable) -> None:
        super().__init__("torch")
        self.load = load

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextmanager
def weights_only_torch_load(on_refusal: Callable[[Any, str], Exception]) -> Iterator[None]:
    """Monkeypatch, scoped to ``TORCH_LOAD_CALLERS``: DeepSpeed calls
    ``torch.load(weights_only=False)`` inside ``load_checkpoint`` and ``ds_to_universal`` with no
    way to change it. Within the block those modules' ``torch.load`` runs with
    ``weights_only=True`` and only DeepSpeed's own classes allowed; ``torch.load`` itself, and
    every other module's, is untouched. A refused file raises ``on_refusal(file, torch's
    message)``."""
    allowed = deepspeed_checkpoint_globals()

    def safe_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            try:
                return torch.serialization.load(f, *args, **kwargs)
            except pickle.UnpicklingError as exc:
                raise on_refusal(f, str(exc)) from None

    proxy = _TorchWithLoad(safe_load)
    with ExitStack() as stack:
        for name in TORCH_LOAD_CALLERS:
            module = importlib.import_module(name)
            stack.callback(setattr, module, "torch", module.torch)
            module.torch = proxy
        yield
