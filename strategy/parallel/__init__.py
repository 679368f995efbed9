"""Sequence and tensor parallelism: DeepSpeed's Ulysses for Hugging Face attention (sequence
shards, all-to-all to head shards inside attention) and DeepSpeed's AutoTP, with the checks that
refuse what they cannot run before any process group starts, and the gradient norm of a
tensor-parallel model (``GradNorms``).

May import: ``strategy.errors``, ``strategy.internals``, ``strategy.dist``, ``strategy.config``,
``strategy.model``. The rank arithmetic itself (data-parallel size and rank) lives in
``StrategyConfig``, the one place every batch size is computed from.
"""

from strategy.parallel.sequence import SequenceParallel, check_sequence_parallel
from strategy.parallel.tensor import GradNorms, check_tensor_parallel, grad_norm

__all__ = ["GradNorms", "SequenceParallel", "check_sequence_parallel", "check_tensor_parallel",
           "grad_norm"]
