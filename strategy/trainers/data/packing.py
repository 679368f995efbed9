"""Padding-free packing: several samples in one row, told apart by ``position_ids`` alone.

Packed rows carry position ids that restart at 0 for each sample and no attention mask: on sdpa
runs load ``sdpa_varlen`` (``strategy.attention``: sdpa on each sample alone), flash attention 2
takes its varlen path, and for flex/eager transformers builds the block-causal mask itself
(``masking_utils.find_packed_sequence_indices``); no O(L^2) mask is ever built here.
Forwards must pass ``use_cache=False`` (with a cache transformers skips the packed-sequence
detection). Each sample's first label is ignored: it would otherwise be trained to follow the
previous sample's last token.

Pairs (RM/DPO) pack a pair's chosen and rejected responses into the same row; ``sample_index``
maps every token to its sample (chosen of pair ``p`` is sample ``p``, its rejected one ``P + p``
for ``P`` pairs in the batch, the unpacked layout's order), so per-sample sums are one
``index_add``.
"""

from __future__ import annotations

import torch

from strategy.errors import fail
from strategy.trainers.losses import IGNORE

# model families whose attention follows packed position ids (packed forward == separate
# forwards, checked on transformers 5.24: tests/test_packing.py runs llama, qwen2 and gpt2);
# OPT, BLOOM and MPT ignore them (ALiBi or learned absolute positions) and are refused
PACKING_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma",
                    "gemma2", "phi", "gpt2", "gptj", "gpt_neox", "starcoder2", "olmo", "olmo2",
                    "granite", "cohere", "stablelm")


def check_packing_family(model_type: str | None, flag: str = "packing_samples") -> None:
    """Refuse packing (``flag``: ``packing_samples`` or ``pack_dataset``) for a model family
    whose attention ignores packed position ids."""
    if model_type not in PACKING_FAMILIES:
        fail(flag, True, f"model_type {model_type!r} does not find packed samples "
             f"from position ids; use one of {', '.join(PACKING_FAMILIES)}, or no packing")


def _unit(sample: dict, keys: tuple[str, ...]) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each sequence a sample contributes: one for SFT, two for a pair."""
    return [(sample[ids], sample[labels]) for ids, labels in zip(keys[::2], keys[1::2])]


def _pack(samples: list[dict], capacity: int, keys: tuple[str, ...]) -> list[dict]:
    rows, row = [], {"input_ids": [], "labels": [], "seq_lens": [], "units": 0}
    for sample in samples:
        parts = _unit(sample, keys)
        size = sum(len(ids) for ids, _ in parts)
        if row["input_ids"] and len(row["input_ids"]) + size > capacity:
            rows.append(row)
            row = {"input_ids": [], "labels": [], "seq_lens": [], "units": 0}
        for ids, labels in parts:
            row["input_ids"] += ids
            row["labels"] += [IGNORE] + labels[1:]
            row["seq_lens"].append(len(ids))
        row["units"] += 1
    return rows + ([row] if row["input_ids"] else [])


def pack(samples: list[dict], max_len: int) -> list[dict]:
    """SFT samples greedily concatenated into rows of at most ``max_len`` tokens."""
    return _pack(samples, max_len, ("input_ids", "labels"))


def pack_pairs(samples: list[dict], max_len: int) -> list[dict]:
    """Preference pairs, each kept whole in one row, in rows of at most ``2 * max_len`` tokens."""
    keys = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")
    return _pack(samples, 2 * max_len, keys)


def collate_micro_batch(pad_id: int, pairs: bool = False):
    """``--packing_samples`` (OpenRLHF's): a micro-batch of samples packed into one padding-free
    row, collated as ``collate_packed`` (pairs: ``collate_packed_pairs``) collates packed rows.

    Args:
        pad_id: the pad token id.
        pairs: the samples are preference pairs.

    Returns:
        The ``collate_fn``.
    """
    keys = (("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels") if pairs
            else ("input_ids", "labels"))
    rows = (collate_packed_pairs if pairs else collate_packed)(pad_id)

    def collate(batch: list[dict]) -> dict:
        return rows(_pack(batch, float("inf"), keys))
    return collate


def _pad(rows: list[list[int]], value: int, width: int) -> torch.Tensor:
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])


def _positions(seq_lens: list[int], width: int) -> list[int]:
    """Each sample counts from 0; the padding after the last sample counts as one more."""
    positions = [i for length in seq_lens for i in range(length)]
    return positions + list(range(width - len(positions)))


def collate_packed(pad_id: int):
    """Packed rows into ``input_ids``, ``labels``, ``position_ids`` (no attention mask) and
    ``token_count`` (real tokens, for the throughput meter)."""
    def collate(batch: list[dict]) -> dict:
        width = max(len(row["input_ids"]) for row in batch)
        return {"input_ids": _pad([row["input_ids"] for row in batch], pad_id, width),
                "labels": _pad([row["labels"] for row in batch], IGNORE, width),
                "position_ids": torch.tensor([_positions(row["seq_lens"], width) for row in batch]),
                "token_count": torch.tensor(sum(len(row["input_ids"]) for row in batch))}
    return collate


def _sample_ids(batch: list[dict], width: int) -> tuple[torch.Tensor, list[int]]:
    """Per token, the sample it belongs to (-1 for padding); and each sample's last token, as a
    flat index into the batch."""
    pairs = sum(row["units"] for row in batch)
    index = torch.full((len(batch), width), -1, dtype=torch.long)
    last = [0] * (2 * pairs)
    pair = 0
    for row_number, row in enumerate(batch):
        start = 0
        for position, length in enumerate(row["seq_lens"]):
            sample = pair + position // 2 + (pairs if position % 2 else 0)
            index[row_number, start:start + length] = sample
            last[sample] = row_number * width + start + length - 1
            start += length
        pair += row["units"]
    return index, last


def collate_packed_pairs(pad_id: int):
    """Packed pair rows: ``collate_packed``'s keys plus ``sample_index`` and ``last_token``."""
    plain = collate_packed(pad_id)

    def collate(batch: list[dict]) -> dict:
        out = plain(batch)
        out["sample_index"], last = _sample_ids(batch, out["input_ids"].shape[1])
        out["last_token"] = torch.tensor(last)
        return out
    return collate


def per_sample_sums(token_values: torch.Tensor, sample_index: torch.Tensor,
                    samples: int) -> torch.Tensor:
    """Sum ``token_values`` (rows x tokens) into one value per sample (padding ignored)."""
    flat_index, flat_values = sample_index.reshape(-1), token_values.reshape(-1)
    keep = flat_index >= 0
    out = torch.zeros(samples, dtype=token_values.dtype, device=token_values.device)
    return out.index_add(0, flat_index[keep], flat_values[keep])


def pair_count(batch: dict) -> int:
    """Pairs in a (packed or plain) pair batch."""
    if "last_token" in batch:
        return int(batch["last_token"].numel()) // 2
    return int(batch["input_ids"].shape[0]) // 2
