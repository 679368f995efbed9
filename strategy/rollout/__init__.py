"""Where on-policy completions come from: one seam (``RolloutEngine``), three implementations.

- ``EngineRollout`` (``--rollout_gather layer``): the training engine's own module generates.
  Under ZeRO-3 that is DeepSpeed's partitioned forward: every layer's parameters are gathered for
  each generated token and released after, and ``synced_gpus`` keeps every rank stepping until all
  ranks' sequences end. Memory stays at ZeRO-3's budget; the cost is a gather per layer per token.
- ``GatheredRollout`` (``--rollout_gather full``): a plain, unpartitioned copy of the policy on
  every rank, refreshed once per rollout (``sync``) by the grouped gather the streamed export uses
  (``plan_export`` units: a LoRA policy's merged weights, tied tensors once, one bounded group of
  parameters gathered at a time). Generation then runs without collectives, each rank on its own.
  It needs the whole model on every rank: ``check_fits`` refuses it in one line, on every rank,
  when the weights exceed a rank's free memory. Below ZeRO-3 the engine's module is already whole,
  and ``full`` generates with it directly (no copy).
- ``VllmRollout`` (``--rollout_engine vllm``, ``rollout.vllm_engine``): a vLLM engine on each
  rank, colocated with training, its weights refreshed after each policy change by streaming the
  same groups into vLLM's weight loader (every rank still entering each gather).
- ``RayVllmRollout`` (``--vllm_num_engines N``, a Ray job's ``rollout.ray_rollout``): engines
  apart from training, Ray actors of their own (``rollout.vllm_ray``), each serving consecutive
  ranks; the same weights streamed to them from rank 0.

The first two share a group's prompt (``generate(group=g)``: a GRPO rollout repeats each prompt
``g`` times): ``prefill_groups`` runs each prompt once and hands the decoder its KV cache repeated
to the ``g`` rows, so the prompt's forward work is 1/g of a plain ``generate``'s, with the same
tokens (the same sampling draws). Where the module generating is whole on its rank (below ZeRO-3,
and ``GatheredRollout``'s copy) the tokens come from ``strategy.decode``, which drops ended rows
from the batch and draws ``generate``'s tokens; the partitioned forward keeps ``generate``.

``remote_models`` holds the clients of a Ray job's frozen models placed apart (the reference's
log-probs, the reward model's scores): the trainers ask them as they would a local model.

May import: ``strategy.errors``, ``strategy.internals``, ``strategy.dist``, ``strategy.config``
(``RolloutConfig``'s fields), ``strategy.model``, ``strategy.decode``, ``strategy.export`` (the
units a sync streams), and vLLM (the optional extra), only once a vLLM engine is asked for.
"""

from strategy.rollout.hf import (
    GATHER_MODES,
    EngineRollout,
    GatheredRollout,
    RolloutEngine,
    check_fits,
    free_memory_bytes,
    full_weight_bytes,
    is_partitioned,
    prefill_groups,
    whole_generate,
)


def vllm_rollout(engine, config, max_model_len: int, seed: int) -> RolloutEngine:
    """The vLLM engine layer ``config`` asks for: an engine in every rank (colocated), or the
    Ray job's engine actors (``--vllm_num_engines N``, a rank of ``strategy.cluster``'s driver).

    Args:
        engine: the policy's training engine.
        config: the ``RolloutConfig``.
        max_model_len: the longest prompt + completion.
        seed: this rank's engine's seed (an engine's ranks alike).
    """
    from strategy.rollout.ray_rollout import RayVllmRollout  # vLLM's layer: only once asked for
    from strategy.rollout.vllm_engine import VllmRollout  # as above

    kind = RayVllmRollout if config.vllm_num_engines else VllmRollout
    return kind(engine, config, max_model_len, seed)


__all__ = ["GATHER_MODES", "EngineRollout", "GatheredRollout", "RolloutEngine", "check_fits",
           "free_memory_bytes", "full_weight_bytes", "is_partitioned", "prefill_groups",
           "vllm_rollout", "whole_generate"]
