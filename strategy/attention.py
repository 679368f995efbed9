"""``sdpa_varlen``: sdpa on each packed sample alone, registered with transformers' attention
interface, so packing pays off without flash attention.

On packed rows (position ids restarting at 0 for each sample, no attention mask) transformers'
own sdpa path builds a block-diagonal mask and attends densely over the whole row: 2048^2
query-key pairs for a row of 8 samples of 256 tokens, where the samples alone need 8 x 256^2.
This implementation finds each sample from the position ids (every place where the position does
not follow the previous one by 1 starts a new sample), batches the samples of one length into one
causal sdpa call, and puts the outputs back in row order: the cost is the sum of squared sample
lengths, and no mask is ever built. Anything else (a padding mask, a cache, one sample per row)
runs transformers' sdpa unchanged, so one model can train packed and generate left-padded.

Under Ulysses sequence parallelism DeepSpeed gathers the position ids of the whole sequence before
the core attention runs (``UlyssesSPAttentionHF.forward``), so the samples are found over the
gathered sequence, as flash attention 2's varlen path finds them.

Select it by name (``--attn_implementation sdpa_varlen``, or ``attn_implementation=
"sdpa_varlen"`` in ``from_pretrained``); ``attention_for(name, packing)`` picks it for packed
runs on sdpa. It needs the model to hand ``position_ids`` to its attention (the families in
``trainers.data.packing.PACKING_FAMILIES``, each run by the tests); a sliding window shorter
than the row gets transformers' sdpa mask (exact, but dense).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from strategy.errors import fail

VARLEN = "sdpa_varlen"


def sample_plan(position_ids: torch.Tensor, rows: int) -> list[tuple[int, torch.Tensor]] | None:
    """The packed samples of a batch, grouped by length: ``[(length, starts)]`` where ``starts``
    holds each sample's first token as a flat index into ``rows x width`` tokens; None when every
    row holds one sample (nothing to split)."""
    positions = position_ids.expand(rows, -1)
    width = positions.shape[1]
    step = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1)
    starts = (step != 1)
    starts[:, 0] = True
    flat = starts.reshape(-1).nonzero().squeeze(1)
    if flat.numel() == rows:
        return None
    ends = torch.cat([flat[1:], flat.new_tensor([rows * width])])
    row_ends = (flat // width + 1) * width  # a sample never runs past its row's end
    lengths = torch.minimum(ends, row_ends) - flat
    groups: dict[int, list[int]] = {}
    for start, length in zip(flat.tolist(), lengths.tolist()):
        groups.setdefault(length, []).append(start)
    return [(length, flat.new_tensor(starts_of)) for length, starts_of in groups.items()]


def _per_sample(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                plan: list[tuple[int, torch.Tensor]], **kwargs: Any) -> torch.Tensor:
    """Causal sdpa over each group of equal-length samples; the output in row order
    ``(rows, width, heads, head_dim)``, as transformers' sdpa returns it."""
    rows, heads, width, _ = query.shape

    def tokens(tensor: torch.Tensor) -> torch.Tensor:  # (rows * width, heads, dim)
        return tensor.transpose(1, 2).reshape(rows * width, tensor.shape[1], tensor.shape[3])

    flat = [tokens(query), tokens(key), tokens(value)]
    outputs, order = [], []
    for length, starts in plan:
        index = (starts[:, None] + torch.arange(length, device=starts.device)).reshape(-1)
        # (samples, heads, length, dim) each
        q, k, v = (t[index].view(len(starts), length, *t.shape[1:]).transpose(1, 2) for t in flat)
        out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
        outputs.append(out.reshape(-1, heads, out.shape[-1]))
        order.append(index)
    inverse = torch.empty(rows * width, dtype=torch.long, device=query.device)
    order = torch.cat(order)
    inverse[order] = torch.arange(order.numel(), device=query.device)
    return torch.cat(outputs)[inverse].view(rows, width, heads, -1)


_last_plan: tuple = (None, 0, None)  # (position ids, rows, plan): a forward's layers share ids


def _plan_for(position_ids: torch.Tensor, rows: int) -> list[tuple[int, torch.Tensor]] | None:
    """``sample_plan`` once per forward (one host sync, not one per layer); Ulysses gathers new
    ids for every layer, which are planned afresh."""
    global _last_plan
    if _last_plan[0] is not position_ids or _last_plan[1] != rows:
        _last_plan = (position_ids, rows, sample_plan(position_ids, rows))
    return _last_plan[2]


def sdpa_varlen_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: packed rows per sample, anything else as sdpa."""
    position_ids = kwargs.pop("position_ids", None)
    plan = None
    if (attention_mask is None and position_ids is not None and query.shape[2] > 1
            and query.shape[2] == key.shape[2] == position_ids.shape[-1]):
        plan = _plan_for(position_ids, query.shape[0])
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    kwargs.pop("is_causal", None)
    return _per_sample(module, query, key, value, plan, dropout=dropout, scaling=scaling,
                       **kwargs), None


def sdpa_varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                     kv_offset: int = 0, attention_mask: torch.Tensor | None = None,
                     **kwargs: Any) -> torch.Tensor | None:
    """No mask where the attention finds the samples itself (no padding mask, no cache, no
    sliding window shorter than the row); sdpa's mask otherwise."""
    window = getattr(kwargs.get("config"), "sliding_window", None)  # shorter than the row: the
    if (attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length
            and not (window and window < kv_length)):  # dense mask (exact, not faster)
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                     **kwargs)


def check_attention(name: str) -> None:
    """Refuse an attention name transformers would reject after the ranks start (a hub kernel,
    ``org/repo``, is left to transformers)."""
    known = ["eager", *AttentionInterface().valid_keys()]
    if name not in known and "/" not in name:
        fail("attn_implementation", name, f"no such attention kernel; use one of "
             f"{', '.join(sorted(known))}")


def attention_for(name: str, packing: bool) -> str:
    """The attention a run loads: ``sdpa_varlen`` for packed rows on sdpa (transformers' sdpa
    would attend densely over the whole packed row), the name asked for otherwise.

    Args:
        name: the attention implementation asked for (``--attn_implementation``).
        packing: whether the run trains packed rows (``--packing_samples``).

    Returns:
        The ``attn_implementation`` to load the model with.
    """
    return VARLEN if packing and name == "sdpa" else name


AttentionInterface.register(VARLEN, sdpa_varlen_attention)
AttentionMaskInterface.register(VARLEN, sdpa_varlen_mask)
