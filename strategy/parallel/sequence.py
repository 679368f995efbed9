"""Sequence parallelism with DeepSpeed's Ulysses for Hugging Face attention.

Ranks ``[k * sp, (k + 1) * sp)`` form a sequence-parallel group; they see the same batch (the
sampler shards by data-parallel rank) and each takes a contiguous slice of its sequence. Inside
attention an all-to-all turns sequence shards into head shards and back, so every rank attends
over the whole sequence with ``heads / sp`` heads. Labels are shifted before slicing
(``shift_labels``), so no next-token target is lost at a slice boundary, and position ids travel
with each slice (Ulysses needs them). Attention masks are dropped, as DeepSpeed's wrapper does:
batches must be right-padded, and packed rows run flash attention's varlen path or
``sdpa_varlen`` (``strategy.attention``), which find the samples from the position ids DeepSpeed
gathers over the whole sequence.

Gradients: ZeRO 1/2 sum a parameter's gradient over the sequence-parallel group and average over
data-parallel ranks; ZeRO-3 averages over all ranks, so its losses are scaled by ``sp`` to match.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as torch_dist
import torch.distributed.nn.functional as differentiable
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from strategy.attention import VARLEN, sdpa_varlen_attention
from strategy.errors import fail
from strategy.internals import (
    attn_implementation,
    fit_ulysses_to_batch,
    new_ulysses,
    release_sequence_parallel_groups,
)
from strategy.model import IGNORE_INDEX

# families tested against sp=1 (tests/test_parallel.py); others (GPT-2's attention reshapes
# Ulysses' output, sliding-window and ALiBi models would attend wrongly) are refused
ULYSSES_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def check_sequence_parallel(hf_config: Any, sp: int) -> None:
    """Before any process group starts: what Ulysses cannot run, as one line each."""
    if sp == 1:
        return
    text = hf_config.get_text_config()
    kind = getattr(hf_config, "model_type", None)
    if kind not in ULYSSES_FAMILIES or getattr(text, "sliding_window", None):
        fail("sequence_parallel_size", sp, f"model_type {kind!r} (sliding window "
             f"{getattr(text, 'sliding_window', None)}) is not supported by DeepSpeed Ulysses "
             f"here; use one of {', '.join(ULYSSES_FAMILIES)} without a sliding window")
    implementation = attn_implementation(hf_config)
    if implementation not in ("sdpa", VARLEN, "flash_attention_2", "flash_attention_3"):
        fail("sequence_parallel_size", sp, f"attention {implementation!r} cannot run under "
             "Ulysses; load the model with attn_implementation='sdpa' or flash_attention_2")
    heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", None)
    if heads % sp:
        fail("sequence_parallel_size", sp, f"the model's {heads} attention heads do not divide "
             f"by it; use a divisor of {heads}")
    if kv_heads and kv_heads % sp and sp % kv_heads:
        fail("sequence_parallel_size", sp, f"the model's {kv_heads} key/value heads neither "
             "divide by it nor divide it; use a size compatible with both head counts")


def ulysses_attention(core_attention: Callable, hf_config: Any, process_group: Any,
                      micro_batch_size: int) -> Callable:
    """An attention function running DeepSpeed's ``UlyssesSPAttentionHF`` (all-to-all from
    sequence shards to head shards and back) around ``core_attention``. DeepSpeed's
    ``register_with_transformers`` fixes the batch dimension of the shapes it asserts at
    registration; DPO's paired rows and eval batches differ, so this wrapper fits them to each
    call. Masks are dropped, as DeepSpeed's wrapper does: sdpa runs causal over the gathered
    sequence (right padding only)."""
    text = hf_config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    ulysses = new_ulysses(core_attention, micro_batch_size, heads, head_dim, kv_heads,
                          text.num_hidden_layers, process_group)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        fit_ulysses_to_batch(ulysses, query.shape[0])
        return ulysses(module, query, key, value, None, *args, **kwargs)

    return attention


class SequenceParallel:
    """The Ulysses groups, the attention it installs, and batch slicing for one run."""

    def __init__(self, size: int) -> None:
        self.size = size
        parallel_state_sp.initialize_sequence_parallel(size)  # collective: every rank
        self.group = parallel_state_sp.get_sequence_parallel_group()
        self.rank = parallel_state_sp.get_sequence_parallel_rank()
        self.installed: list[str] = []

    @property
    def mpu(self) -> Any:
        """What ``deepspeed.initialize(mpu=...)`` needs to reduce over the right groups."""
        return parallel_state_sp

    def install(self, model: Any, micro_batch_size: int) -> None:
        """Route the model's attention through Ulysses, once per attention implementation (a
        reference loaded with another one than the policy's is sliced alike)."""
        config = getattr(model, "config", model)
        check_sequence_parallel(config, self.size)
        implementation = attn_implementation(config)
        if implementation in self.installed:
            return
        # Ulysses drops masks: sdpa finds packed samples from the gathered position ids too
        core = (sdpa_varlen_attention if implementation in ("sdpa", VARLEN)
                else ALL_ATTENTION_FUNCTIONS[implementation])
        # transformers' process-wide table: every model using this attention now runs Ulysses
        # (DeepSpeed's own registration does the same); close() puts the original back
        ALL_ATTENTION_FUNCTIONS[implementation] = ulysses_attention(core, config, self.group,
                                                                    micro_batch_size)
        self.installed.append(implementation)

    def shard(self, batch: dict, pad_id: int = 0) -> dict:
        """This rank's slice of the sequence: ``input_ids``, ``position_ids``, ``shift_labels``
        (labels shifted before slicing) and, for packed pairs, ``shift_sample_index`` (shifted
        alike); padded on the right to a multiple of the group size. Other keys stay whole."""
        ids = batch["input_ids"]
        rows, length = ids.shape
        width = -(-length // self.size) * self.size
        extra = width - length
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=ids.device).expand(rows, length)
        tail = torch.arange(extra, device=ids.device) + positions[:, -1:] + 1
        labels = torch.nn.functional.pad(batch["labels"], (0, extra + 1), value=IGNORE_INDEX)
        chunk = width // self.size
        window = slice(self.rank * chunk, (self.rank + 1) * chunk)
        out = {key: value for key, value in batch.items()
               if key not in ("input_ids", "labels", "position_ids", "attention_mask")}
        out["input_ids"] = torch.nn.functional.pad(ids, (0, extra), value=pad_id)[:, window]
        out["position_ids"] = torch.cat([positions, tail], dim=1)[:, window].contiguous()
        out["shift_labels"] = labels[:, 1:][:, window].contiguous()
        out["input_ids"] = out["input_ids"].contiguous()
        if "sample_index" in batch:  # packed pairs: the sample of each shifted target
            index = torch.nn.functional.pad(batch["sample_index"], (0, extra + 1), value=-1)
            out["shift_sample_index"] = index[:, 1:][:, window].contiguous()
        return out

    def sum(self, tensor: torch.Tensor, keep_gradient: bool = False) -> torch.Tensor:
        """Sum over the group; with ``keep_gradient`` the backward sums the gradients too (so a
        loss computed from the sum on every rank must be divided by the group size)."""
        if keep_gradient:
            return differentiable.all_reduce(tensor, group=self.group)
        out = tensor.detach().clone()
        torch_dist.all_reduce(out, group=self.group)
        return out

    def close(self) -> None:
        """Put transformers' attention back and release the groups (a later run may start)."""
        for implementation in self.installed:  # the registered implementation returns
            del ALL_ATTENTION_FUNCTIONS[implementation]
        self.installed = []
        release_sequence_parallel_groups()
