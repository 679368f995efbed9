"""Samples to batches: right-padded SFT rows and pairs (chosen rows first), left-padded prompts
(packed rows: ``packing``)."""

from __future__ import annotations

import torch

from strategy.trainers.losses import IGNORE


def collate_prompts(pad_id: int):
    """Left-padded prompts (generation appends on the right) with their mask, texts and rows."""
    def collate(batch: list[dict]) -> dict:
        width = max(len(b["prompt_ids"]) for b in batch)
        ids = [[pad_id] * (width - len(b["prompt_ids"])) + b["prompt_ids"] for b in batch]
        mask = [[0] * (width - len(b["prompt_ids"])) + [1] * len(b["prompt_ids"]) for b in batch]
        return {"prompt_ids": torch.tensor(ids), "prompt_mask": torch.tensor(mask),
                "prompts": [b["prompt"] for b in batch], "rows": [b["row"] for b in batch]}
    return collate


def _pad(seqs: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(seq) for seq in seqs)
    return torch.tensor([seq + [value] * (width - len(seq)) for seq in seqs])


def collate_sft(pad_id: int):
    """Right-padded rows with their attention mask (packed rows: ``packing.collate_packed``)."""
    def collate(batch: list[dict]) -> dict:
        return {"input_ids": _pad([row["input_ids"] for row in batch], pad_id),
                "labels": _pad([row["labels"] for row in batch], IGNORE),
                "attention_mask": _pad([[1] * len(row["input_ids"]) for row in batch], 0)}
    return collate


def collate_pairs(pad_id: int):
    """Chosen rows first, then rejected: one forward pass scores both."""
    def collate(batch: list[dict]) -> dict:
        ids = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
        labels = [b["chosen_labels"] for b in batch] + [b["rejected_labels"] for b in batch]
        return {"input_ids": _pad(ids, pad_id), "labels": _pad(labels, IGNORE),
                "attention_mask": _pad([[1] * len(x) for x in ids], 0)}
    return collate
