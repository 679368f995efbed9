"""Tensor parallelism with DeepSpeed's AutoTP (``tensor_parallel.autotp_size``, ZeRO 0-2).

Ranks ``[k * tp, (k + 1) * tp)`` form a tensor-parallel group: they see the same batch and each
holds a slice of every attention and MLP projection, split by the model's transformers
tensor-parallel plan (column-wise q/k/v/gate/up, row-wise o/down, the output layer column-wise
with its logits gathered whole, so every loss sees full logits: ``vocab_parallel_lm_head`` off);
embeddings and norms stay whole. Exports
gather each layer's slices back (``internals.tensor_parallel_gathered``) and write a normal HF
directory; checkpoints hold one file per slice and resume at the same tensor-parallel size.

``GradNorms`` measures the gradient norm DeepSpeed leaves unmeasured (plain ZeRO-0), summing
AutoTP slices' squares over their group so the norm is the whole model's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import groups as deepspeed_groups
from torch import nn

from strategy import dist
from strategy.errors import fail
from strategy.internals import engine_measures_grad_norm


def check_tensor_parallel(hf_config: Any, tp: int) -> None:
    """Before any process group starts: what AutoTP cannot split here, as one line each."""
    if tp == 1:
        return
    text = hf_config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        fail("tensor_parallel_size", tp, f"model_type {hf_config.model_type!r} has no tensor-"
             "parallel plan in transformers; use a LLaMA/Qwen2-style model, or size 1")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for count, what in ((heads, "attention heads"), (kv_heads, "key/value heads")):
        if count % tp:
            fail("tensor_parallel_size", tp, f"the model's {count} {what} do not divide by it; "
                 f"use a divisor of {count}")


def is_tensor_parallel_param(param: torch.Tensor) -> bool:
    """A parameter AutoTP split across the tensor-parallel group (DeepSpeed's own test)."""
    return is_model_parallel_parameter(param)


def tensor_parallel_group() -> Any:
    """The tensor-parallel process group AutoTP made."""
    return deepspeed_groups.get_tensor_model_parallel_group()


def grad_norm(module: nn.Module, tensor_parallel: bool = False) -> float:
    """Collective over the tensor-parallel group (with ``tensor_parallel``): the global norm of
    ``module``'s gradients; AutoTP slices' squares are summed over their group, whole parameters
    counted once."""
    squares = torch.zeros(2, dtype=torch.float64)  # [whole parameters, split slices]
    for p in module.parameters():
        if p.grad is not None:
            split = tensor_parallel and is_tensor_parallel_param(p)
            squares[int(split)] += torch.linalg.vector_norm(p.grad.double()).pow(2).cpu()
    if tensor_parallel:
        squares[1] = dist.all_reduce(squares[1], "sum", group=tensor_parallel_group())
    return squares.sum().sqrt().item()


class GradNorms:
    """The gradient norm of each engine's last optimizer step, measured here for the engines
    DeepSpeed does not measure it for (a plain ZeRO-0 fp32 client optimizer). Held per engine
    object (weakly: a closed engine's entry goes with it)."""

    def __init__(self, tensor_parallel: bool = False) -> None:
        self.tensor_parallel = tensor_parallel
        self._measured: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def before_step(self, engine: Any) -> None:
        """At an accumulation boundary, before ``engine.step()`` drops the gradients: measure
        the norm if DeepSpeed will not."""
        if not engine_measures_grad_norm(engine):
            self._measured[engine] = grad_norm(engine.module, self.tensor_parallel)

    def get(self, engine: Any) -> float | None:
        """The norm (before clipping) of ``engine``'s last step; None before its first."""
        norm = engine.get_global_grad_norm()
        norm = self._measured.get(engine) if norm is None else norm
        return None if norm is None else float(norm)
