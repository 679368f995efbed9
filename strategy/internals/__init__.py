"""Every use of private or undocumented torch/DeepSpeed/transformers/vLLM internals, in one place,
one module per library: ``deepspeed`` (engine state, parameter attributes, process-group globals,
config schema, Adam kernels), ``deepspeed_files`` (checkpoint file names and keys, the universal
conversion, ``weights_only`` loading), ``torch``, ``transformers``, ``vllm`` (the CPU build's
shared-memory names).

Each function says why we need it; ``tests/test_internals.py`` exercises every one of them on the
real libraries, so an upgrade that breaks one fails there first (not deep inside a training run).
Checked on: torch 2.13.0, DeepSpeed 0.19.8, transformers 5.24.0. Nothing else in the package reads
an underscore attribute of these libraries, or sets an attribute on their objects.

May import: ``strategy.errors`` only (layer 1: everything else imports it).
"""

from strategy.internals.deepspeed import (
    begin_submodule_forward,
    cache_cpu_info,
    cpu_adam_op,
    deepspeed_config_keys,
    engine_counters,
    engine_measures_grad_norm,
    fit_ulysses_to_batch,
    full_numel,
    full_shape,
    is_zero3_param,
    local_partition,
    multi_tensor_adam,
    new_cpu_adam_id,
    new_ulysses,
    release_sequence_parallel_groups,
    release_tensor_parallel_groups,
    restart_adam_powers,
    shm_allreduce_buffer_path,
    skipped_steps,
    tensor_parallel_gathered,
    universal_checkpoint_loading,
    zero_config_error,
)
from strategy.internals.deepspeed_files import (
    convert_to_universal,
    deepspeed_checkpoint_globals,
    universal_args,
    weights_only_torch_load,
)
from strategy.internals.torch import default_store, non_persistent_buffers, norm_base_classes
from strategy.internals.transformers import (
    attn_implementation,
    set_attn_implementation,
    with_cache,
)
from strategy.internals.vllm import cpu_shm_names, unlink_cpu_shm

__all__ = ["attn_implementation", "begin_submodule_forward", "cache_cpu_info",
           "convert_to_universal", "cpu_adam_op",
           "cpu_shm_names", "deepspeed_checkpoint_globals", "deepspeed_config_keys",
           "default_store",
           "engine_counters", "engine_measures_grad_norm", "fit_ulysses_to_batch", "full_numel",
           "full_shape", "is_zero3_param", "local_partition", "multi_tensor_adam",
           "new_cpu_adam_id", "new_ulysses", "non_persistent_buffers", "norm_base_classes",
           "release_sequence_parallel_groups", "release_tensor_parallel_groups",
           "restart_adam_powers", "set_attn_implementation", "shm_allreduce_buffer_path",
           "skipped_steps", "tensor_parallel_gathered", "universal_args",
           "universal_checkpoint_loading", "unlink_cpu_shm", "weights_only_torch_load",
           "with_cache",
           "zero_config_error"]
