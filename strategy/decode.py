"""A lean sampling loop for rollouts: ``decode`` gives the tokens ``generate`` gives for the
settings a rollout uses (greedy, or temperature / top-k / top-p sampling, end-of-sequence ids,
padding) and does less work for them.

- Rows that ended leave the batch: their KV cache rows are dropped
  (``DynamicCache.batch_select_indices``) and the forward runs only the rows still sampling.
  ``generate`` runs every row to the last step of the longest, feeding pads to those that ended.
- One forward and one selection per token, nothing else: no stopping-criteria objects, no
  per-step rebuild of model kwargs, the position ids counted on rather than recomputed.

The same draws: ``torch.multinomial(probs, 1)`` (what ``generate`` samples with) is
``argmax(probs / E)`` with ``E`` exponential noise over the whole ``(rows, vocab)`` tensor. The loop
draws that noise for every row each step, ended rows included, and reads the rows still going:
from one seed it samples ``generate``'s tokens (tested against it), whichever rows have left.

Only for a module that holds its whole weights (ZeRO-0/1/2, or the gathered copy of a ZeRO-3
policy): DeepSpeed's partitioned forward needs every rank stepping until all ranks are done, which
``generate(synced_gpus=True)`` does (``rollout.EngineRollout``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig
from transformers.generation import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from strategy.internals import with_cache
from strategy.model import base_model

# the GenerationConfig fields decode reads; any other set field is refused (not silently ignored)
FIELDS = frozenset({"max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
                    "eos_token_id", "pad_token_id", "transformers_version"})


def supports(module: nn.Module) -> bool:
    """Whether ``module``'s generation runs on transformers' dynamic cache and can keep only the
    last position's logits (what ``decode`` relies on)."""
    model = base_model(module)
    return model._supports_default_dynamic_cache() and model._supports_logits_to_keep()


def warpers(config: GenerationConfig) -> LogitsProcessorList:
    """``generate``'s sampling warpers for ``config``, in its order (temperature, top-k, top-p)."""
    out = LogitsProcessorList()
    if not config.do_sample:
        return out
    if config.temperature is not None and config.temperature != 1.0:
        out.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        out.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return out


def _eos_ids(config: GenerationConfig, device: torch.device) -> torch.Tensor:
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return torch.tensor(eos, dtype=torch.long, device=device)


@torch.no_grad()
def decode(module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
           generation_config: GenerationConfig, cache: DynamicCache | None = None) -> torch.Tensor:
    """``generate(input_ids, attention_mask, generation_config=...)``'s output: the prompts and
    their completions, rows that ended padded with ``pad_token_id``, as many columns as the longest
    completion needed.

    Args:
        module: the model (a PEFT model too), whole on this rank, in eval mode.
        input_ids: left-padded prompts.
        attention_mask: their mask.
        generation_config: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``eos_token_id`` (an id or a list), ``pad_token_id``; nothing else may be set.
        cache: the KV cache of the prompts' first tokens (``rollout.prefill_groups``), or None.

    Returns:
        ``(rows, prompt width + steps)`` token ids.

    Raises:
        ValueError: ``generation_config`` sets a field this loop does not implement.
    """
    extra = sorted(set(generation_config.to_diff_dict()) - FIELDS)
    if extra:
        raise ValueError(f"decode does not implement generation settings {extra}")
    rows, width = input_ids.shape
    device = input_ids.device
    pad, eos = generation_config.pad_token_id, _eos_ids(generation_config, device)
    process = warpers(generation_config)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
    if cache is None:
        cache = DynamicCache(config=base_model(module).config)
    start = cache.get_seq_length()  # the prompt tokens the cache already holds
    feed, feed_pos, mask = input_ids[:, start:], positions[:, start:], attention_mask
    next_pos = positions[:, -1] + 1
    active = torch.arange(rows, device=device)  # the rows still sampling
    out = torch.full((rows, generation_config.max_new_tokens), pad, dtype=input_ids.dtype,
                     device=device)
    steps = 0
    for step in range(generation_config.max_new_tokens):
        logits = module(input_ids=feed, attention_mask=mask, position_ids=feed_pos,
                        **with_cache(cache),
                        use_cache=True, logits_to_keep=1).logits[:, -1].float()
        scores = process(feed, logits)
        if generation_config.do_sample:
            probs = scores.softmax(-1)
            noise = torch.empty((rows, probs.shape[-1]), dtype=probs.dtype,
                                device=device).exponential_(1)  # every row: generate's draws
            tokens = (probs / noise[active]).argmax(-1)
        else:
            tokens = scores.argmax(-1)
        out[active, step] = tokens
        steps = step + 1
        going = ~torch.isin(tokens, eos)
        if not going.any():
            break
        if not going.all():  # ended rows leave the batch and its cache
            keep = going.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            active, tokens, mask, next_pos = active[keep], tokens[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        feed, feed_pos, next_pos = tokens[:, None], next_pos[:, None], next_pos + 1
    return torch.cat([input_ids, out[:, :steps]], dim=1)
