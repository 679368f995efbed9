"""DeepSpeed's undocumented engine state, parameter attributes, process-group globals, config
schema and Adam kernels we use: each with why, pinned by ``tests/test_internals.py`` (checked on
DeepSpeed 0.19.8). Its checkpoint files are ``internals.deepspeed_files``."""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import socket
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
from deepspeed.module_inject.layers import GatherReplacedLayerParams
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.adam.multi_tensor_apply import MultiTensorApply
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.utils import groups as deepspeed_groups
from pydantic import ValidationError
from torch import nn

# ------------------------------------------------------------ engine state


def engine_counters(engine: Any) -> tuple[int, int, int]:
    """(optimizer steps, consumed samples, micro-steps) DeepSpeed counts: undocumented attributes
    ``global_steps``, ``global_samples`` and ``micro_steps`` that every checkpoint and the
    accumulation boundary depend on."""
    return int(engine.global_steps), int(engine.global_samples), int(engine.micro_steps)


def begin_submodule_forward(engine: Any) -> None:
    """What ``DeepSpeedEngine.forward`` does before the module's forward, for a forward that
    calls a submodule directly (the backbone, then the output layer in chunks): ZeRO's
    per-micro-batch bookkeeping. ZeRO-3 counts micro-steps in ``clear_backward_seen_flag``
    (0.19.x); without it every micro-batch's gradients overwrite the last one's instead of
    accumulating.

    Args:
        engine: a training engine (an eval engine or a bare module: nothing to do).
    """
    optimizer = getattr(engine, "optimizer", None)
    if hasattr(optimizer, "clear_backward_seen_flag"):
        optimizer.clear_backward_seen_flag()


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


# ------------------------------------------------------------ ZeRO-3 and AutoTP parameters


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
    """The element count of ``full_shape``."""
    return math.prod(full_shape(param))


def local_partition(param: torch.Tensor) -> torch.Tensor:
    """This rank's flat slice of a ZeRO-3 parameter (``ds_tensor``, padded to equal sizes across
    ranks), or the whole parameter otherwise. Updating it in place updates the partition."""
    return param.ds_tensor if is_zero3_param(param) else param.data


@contextmanager
def tensor_parallel_gathered(params: list[torch.Tensor], owner: dict[int, nn.Module]
                             ) -> Iterator[None]:
    """Collective over each tensor-parallel group: within the block the AutoTP layers owning
    ``params`` hold their whole weights (DeepSpeed's undocumented ``GatherReplacedLayerParams``,
    which takes a layer's parameters in their own order, weight first)."""
    modules = {id(owner[id(p)]): owner[id(p)] for p in params if id(p) in owner}
    with ExitStack() as stack:
        for module in modules.values():
            own = list(module.parameters(recurse=False))
            stack.enter_context(GatherReplacedLayerParams(own, module, enabled=True))
        yield


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


# ------------------------------------------------------------ process groups, Ulysses


def new_ulysses(core_attention: Callable, micro_batch_size: int, heads: int, head_dim: int,
                kv_heads: int, layers: int, process_group: Any) -> UlyssesSPAttentionHF:
    """DeepSpeed's Ulysses attention around ``core_attention`` (sdpa's signature), as
    ``register_with_transformers`` builds it; that function also sets the undocumented
    ``core_attn_implementation``, which the module reads on every call."""
    ulysses = UlyssesSPAttentionHF(attn=core_attention, batch_size=micro_batch_size,
                                   attn_head_count=heads, attn_head_size=head_dim,
                                   kv_head_count=kv_heads, num_hidden_layers=layers,
                                   process_group=process_group, seq_length_is_variable=True)
    ulysses.core_attn_implementation = "sdpa"
    return ulysses


def fit_ulysses_to_batch(ulysses: Any, batch: int) -> None:
    """Make a ``UlyssesSPAttentionHF`` accept a batch of ``batch`` rows: it fixes the batch
    dimension of the shapes it asserts when built (``batch_size`` and the ``required_*_shape``
    attributes, undocumented)."""
    ulysses.batch_size = batch
    for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
        shape = list(getattr(ulysses, name))
        setattr(ulysses, name, torch.Size([shape[0], batch, *shape[2:]]))


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
    """DeepSpeed's compiled CPU Adam op (undocumented ``create_adam``/``adam_update``/
    ``destroy_adam``): the kernel under ``DeepSpeedCPUAdam``, whose Python class steps whole
    groups only."""
    return CPUAdamBuilder().load()


def multi_tensor_adam(chunk_size: int) -> Callable:
    """DeepSpeed's multi-tensor fused Adam kernel (undocumented ``MultiTensorApply``), called on
    our own tensor lists (``FusedAdam`` applies it to whole parameter groups only)."""
    op = FusedAdamBuilder().load().multi_tensor_adam
    applier = MultiTensorApply(chunk_size)
    return functools.partial(applier, op)


# ------------------------------------------------------------ py-cpuinfo, once per machine
CPU_INFO_VAR = "STRATEGY_CPU_INFO"  # [host name, py-cpuinfo's answer], for the processes started


def cache_cpu_info() -> None:
    """Answer py-cpuinfo's ``get_cpu_info`` once per machine. DeepSpeed's op builders call it
    on every op load, cached or not (``OpBuilder.cpu_arch`` and ``simd_width``; and
    ``DeepSpeedCPUAdam``), and each call runs a Python subprocess (``cpuinfo.py --json``: ~1 s
    of CPU here), in every rank. The first answer is kept in this process and in
    ``STRATEGY_CPU_INFO`` with its host's name, so the processes this one starts (ranks,
    engines, a test's jobs) reuse it; another host's answer (a variable carried to another node)
    is not used. It patches the module attribute DeepSpeed imports the function from at each
    call."""
    try:
        import cpuinfo  # DeepSpeed's dependency
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "answered_once", False):
        return
    ask = cpuinfo.get_cpu_info

    def get_cpu_info() -> dict:
        host = socket.gethostname()
        try:
            saved_host, info = json.loads(os.environ.get(CPU_INFO_VAR) or "[null, null]")
        except ValueError:
            saved_host, info = None, None
        if saved_host != host or not isinstance(info, dict):
            info = ask()
            os.environ[CPU_INFO_VAR] = json.dumps([host, info])
        return dict(info)

    get_cpu_info.answered_once = True
    cpuinfo.get_cpu_info = get_cpu_info
