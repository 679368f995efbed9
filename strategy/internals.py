"""Every use of private or undocumented DeepSpeed/torch internals, in one place.

Each function says why we need it and the versions it was checked on; ``tests/test_internals.py``
exercises every one of them on the real engine, so an upgrade that breaks one fails there first
(not deep inside a training run). Checked on: torch 2.13.0, DeepSpeed 0.19.8, transformers 5.24.0.
Nothing else in the package reads an underscore attribute of torch or DeepSpeed, or sets an
attribute on their objects.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import pickle
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import deepspeed
import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint import ds_to_universal
from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
from deepspeed.module_inject.layers import GatherReplacedLayerParams
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.adam.multi_tensor_apply import MultiTensorApply
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from deepspeed.utils import groups as deepspeed_groups
from deepspeed.utils.tensor_fragment import fragment_address
from pydantic import ValidationError
from torch import nn

# ------------------------------------------------------------ engine state


def engine_counters(engine: Any) -> tuple[int, int, int]:
    """(optimizer steps, consumed samples, micro-steps) DeepSpeed counts: undocumented attributes
    ``global_steps``, ``global_samples`` and ``micro_steps`` that every checkpoint and the
    accumulation boundary depend on."""
    return int(engine.global_steps), int(engine.global_samples), int(engine.micro_steps)


def skipped_steps(engine: Any) -> int:
    """fp16 steps the loss scaler skipped (undocumented ``engine.skipped_steps``)."""
    return int(engine.skipped_steps)


def engine_measures_grad_norm(engine: Any) -> bool:
    """DeepSpeed's ``get_global_grad_norm`` copies ``optimizer._global_grad_norm`` after a step; a
    plain ZeRO-0 fp32 client optimizer has no such attribute, so the norm is lost and we measure
    it."""
    return hasattr(engine.optimizer, "_global_grad_norm")


@contextmanager
def universal_checkpoint_loading(engine: Any) -> Iterator[None]:
    """Make ``engine.load_checkpoint`` read DeepSpeed's universal format: it consults
    ``engine._config.load_universal_checkpoint`` (set from the JSON config at init) only inside
    ``load_checkpoint``, so flipping it for the call is enough."""
    old = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = old


def universal_args(src_dir: str, dst_dir: str) -> argparse.Namespace:
    """The namespace ``ds_to_universal.main`` reads (its parser's fields, one worker each)."""
    return argparse.Namespace(input_folder=src_dir, output_folder=dst_dir, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)


def convert_to_universal(src_dir: str, dst_dir: str) -> None:
    """DeepSpeed's ``ds_to_universal`` has only a command-line entry (``main(args)``)."""
    ds_to_universal.main(universal_args(src_dir, dst_dir))


# ------------------------------------------------------------ ZeRO-3 parameters


def is_zero3_param(param: torch.Tensor) -> bool:
    """ZeRO-3 marks the parameters it partitions with ``ds_id`` (and ``ds_shape``/``ds_numel``)."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unpartitioned shape: ZeRO-3 leaves a parameter's local tensor empty and records it in
    ``ds_shape``; AutoTP keeps a shard and records the whole in its universal-checkpoint meta."""
    if is_zero3_param(param):
        return tuple(param.ds_shape)
    meta = getattr(param, DS_AUTOTP_UC_META, None) or {}
    return tuple(meta.get("original_shape") or param.shape)


def full_numel(param: torch.Tensor) -> int:
    return math.prod(full_shape(param))


# ------------------------------------------------------------ AutoTP parameters


def is_tensor_parallel_param(param: torch.Tensor) -> bool:
    """A parameter AutoTP split across the tensor-parallel group (DeepSpeed's own test)."""
    return is_model_parallel_parameter(param)


def tensor_parallel_group() -> Any:
    """The tensor-parallel process group AutoTP made (DeepSpeed keeps it in ``groups``)."""
    return deepspeed_groups.get_tensor_model_parallel_group()


@contextmanager
def tensor_parallel_gathered(params: list[torch.Tensor], owner: dict[int, nn.Module]
                             ) -> Iterator[None]:
    """Collective over each tensor-parallel group: within the block the AutoTP layers owning
    ``params`` hold their whole weights (DeepSpeed's ``GatherReplacedLayerParams``, which takes
    a layer's parameters in their own order, weight first)."""
    modules = {id(owner[id(p)]): owner[id(p)] for p in params if id(p) in owner}
    with ExitStack() as stack:
        for module in modules.values():
            own = list(module.parameters(recurse=False))
            stack.enter_context(GatherReplacedLayerParams(own, module, enabled=True))
        yield


def local_partition(param: torch.Tensor) -> torch.Tensor:
    """This rank's flat slice of a ZeRO-3 parameter (``ds_tensor``, padded to equal sizes across
    ranks), or the whole parameter otherwise. Updating it in place updates the partition."""
    return param.ds_tensor if is_zero3_param(param) else param.data


# ------------------------------------------------------------ torch


def norm_base_classes() -> tuple[type, ...]:
    """BatchNorm variants share the private base ``_NormBase``; there is no public one."""
    return (nn.modules.batchnorm._NormBase,)


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Buffers registered with ``persistent=False`` (left out of ``state_dict``): torch keeps their
    names only in ``_non_persistent_buffers_set``."""
    return set(module._non_persistent_buffers_set)


def default_store() -> Any:
    """The process group's key-value store, where a failing rank leaves its message for its peers
    (``_get_default_store`` is private); None when unavailable."""
    try:
        if not torch_dist.is_initialized():
            return None
        return torch_dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - best effort: the store may be gone with rank 0
        return None


# ------------------------------------------------------------ safe loading


def deepspeed_checkpoint_globals() -> list[type]:
    """The non-tensor classes DeepSpeed pickles into its ``.pt`` checkpoint files (the dynamic
    loss scaler with fp16 training)."""
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_torch_load(on_refusal: Callable[[Any, str], Exception]) -> Iterator[None]:
    """Monkeypatch: DeepSpeed calls ``torch.load(weights_only=False)`` inside ``load_checkpoint``
    and ``ds_to_universal`` with no way to change it; within the block every ``torch.load`` runs
    with ``weights_only=True`` and only DeepSpeed's own classes allowed. A refused file raises
    ``on_refusal(file, torch's message)``."""
    original, allowed = torch.load, deepspeed_checkpoint_globals()

    def safe_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            try:
                return original(f, *args, **kwargs)
            except pickle.UnpicklingError as exc:
                raise on_refusal(f, str(exc)) from None

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


# ------------------------------------------------------------ DeepSpeed config


@functools.lru_cache(maxsize=1)
def deepspeed_config_keys() -> frozenset[str]:
    """Every string constant DeepSpeed's ``constants.py``/``config.py`` modules define: a superset
    of the top-level keys it reads (it silently ignores any other). DeepSpeed publishes no list."""
    root = os.path.dirname(deepspeed.__file__)
    keys: set[str] = set()
    for dirpath, _, files in os.walk(root):
        for name in ("constants.py", "config.py"):
            if name not in files:
                continue
            rel = os.path.relpath(os.path.join(dirpath, name[:-3]), os.path.dirname(root))
            try:
                module = importlib.import_module(rel.replace(os.sep, "."))
            except Exception:  # noqa: BLE001 - optional backends fail to import on some machines
                continue
            keys |= {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}
    return frozenset(keys)


def zero_config_error(section: dict) -> tuple[str, str] | None:
    """(dotted field, message) of the first problem DeepSpeed's pydantic ZeRO schema finds in a
    ``zero_optimization`` section, or None. The schema class is internal."""
    try:
        DeepSpeedZeroConfig(**section)
    except ValidationError as exc:
        err = exc.errors()[0]
        return ".".join(str(p) for p in err["loc"]), err["msg"]
    return None


def shm_allreduce_buffer_path(rank: int) -> str:
    """The file DeepSpeed's CPU shared-memory allreduce creates per rank (and never removes); its
    name is an implementation detail of ``deepspeed/ops/csrc/cpu/comm/shm.cpp``."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


# ------------------------------------------------------------ DeepSpeed Ulysses


def ulysses_attention(core_attention: Callable, hf_config: Any, process_group: Any,
                      micro_batch_size: int) -> Callable:
    """An attention function running DeepSpeed's ``UlyssesSPAttentionHF`` (all-to-all from
    sequence shards to head shards and back) around ``core_attention``. DeepSpeed's
    ``register_with_transformers`` fixes the batch dimension of the shapes it asserts at
    registration; DPO's paired rows and eval batches differ, so this wrapper sets it from each
    call (``batch_size`` and the ``required_*_shape`` attributes, undocumented). Masks are
    dropped, as DeepSpeed's wrapper does: sdpa runs causal over the gathered sequence (right
    padding only)."""
    text = hf_config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    ulysses = UlyssesSPAttentionHF(attn=core_attention, batch_size=micro_batch_size,
                                   attn_head_count=heads, attn_head_size=head_dim,
                                   kv_head_count=kv_heads, num_hidden_layers=text.num_hidden_layers,
                                   process_group=process_group, seq_length_is_variable=True)
    ulysses.core_attn_implementation = "sdpa"

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        batch = query.shape[0]
        ulysses.batch_size = batch
        for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
            shape = list(getattr(ulysses, name))
            setattr(ulysses, name, torch.Size([shape[0], batch, *shape[2:]]))
        return ulysses(module, query, key, value, None, *args, **kwargs)

    return attention


def release_sequence_parallel_groups() -> None:
    """DeepSpeed keeps its Ulysses process groups in module globals that refuse a second
    ``initialize_sequence_parallel``, and every engine made with an mpu leaves it in
    ``deepspeed.utils.groups.mpu`` for all later engines; clearing both lets a later run in the
    same process start clean (the rank pool in tests, a notebook)."""
    parallel_state_sp._release_sequence_parallel_groups()
    deepspeed_groups.mpu = None


def release_tensor_parallel_groups() -> None:
    """AutoTP's groups live in ``deepspeed.utils.groups`` globals that later engines would take
    as theirs (a tp=1 engine after a tp=2 one finds a model-parallel size of 2 and no mpu)."""
    deepspeed_groups._TENSOR_MODEL_PARALLEL_GROUP = None
    deepspeed_groups._MODEL_PARALLEL_GROUP = None
    deepspeed_groups._DATA_PARALLEL_GROUP = None
    deepspeed_groups.mpu = None


# ------------------------------------------------------------ DeepSpeed's Adam kernels


def _base_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under DeepSpeed's ZeRO/bf16 wrappers (each keeps it as
    ``.optimizer``)."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def restart_adam_powers(optimizer: Any) -> None:
    """DeepSpeed's C++ CPU Adam (under ``DeepSpeedCPUAdam`` and the CPU build of ``FusedAdam``)
    keeps beta^t as a running product across steps, while an optimizer loaded from a checkpoint
    starts from pow(beta, t): a resumed run would drift from the uninterrupted one in the last
    bit. A throwaway update at step 0 on a one-element tensor before each step makes every step
    take pow(beta, t) (the kernel recomputes it when the step does not follow the last one;
    after step 0, step 1 multiplies 1 by beta, which is exact too)."""
    base = _base_optimizer(optimizer)
    if not isinstance(base, (DeepSpeedCPUAdam, FusedAdam)) or not base.param_groups:
        return
    group = base.param_groups[0]
    beta1, beta2 = group["betas"]
    dummy = [torch.zeros(1) for _ in range(4)]
    if isinstance(base, DeepSpeedCPUAdam):
        base.ds_opt_adam.adam_update(base.opt_id, 0, 0.0, beta1, beta2, group["eps"], 0.0, True,
                                     *dummy)
    elif isinstance(base, FusedAdam) and get_accelerator().device_name() == "cpu":
        base.multi_tensor_adam(2048, torch.zeros(1, dtype=torch.int), [[d] for d in dummy], 0.0,
                               beta1, beta2, group["eps"], 0, base.adam_w_mode, 1, 0.0)


def new_cpu_adam_id() -> int:
    """An id in the C++ optimizer table shared with ``DeepSpeedCPUAdam``, taken from its class
    counter (undocumented) so the two never collide."""
    opt_id = DeepSpeedCPUAdam.optimizer_id
    DeepSpeedCPUAdam.optimizer_id += 1
    return opt_id


def cpu_adam_op() -> Any:
    """DeepSpeed's compiled CPU Adam op (``create_adam``/``adam_update``/``destroy_adam``): the
    kernel under ``DeepSpeedCPUAdam``, whose Python class steps whole groups only."""
    return CPUAdamBuilder().load()


def multi_tensor_adam(chunk_size: int) -> Callable:
    """DeepSpeed's multi-tensor fused Adam kernel, called on our own tensor lists (``FusedAdam``
    applies it to whole parameter groups only)."""
    op = FusedAdamBuilder().load().multi_tensor_adam
    applier = MultiTensorApply(chunk_size)
    return functools.partial(applier, op)
