"""KTO's unpaired data: completions labelled desirable or not (TRL's ``prompt``/``completion``/
``label`` rows, text or conversations), or preference rows split into one of each.

Each sample also carries a mismatched sequence for KTO's KL reference point: its own prompt with
the completion of the next sample (in file order, wrapping) whose prompt differs. The pairing is
fixed when the data loads, so a step's KL estimate is the same however the step is split.
"""

from __future__ import annotations

from typing import Any

import torch

from strategy.trainers.config import DataConfig
from strategy.trainers.data.collate import collate_sft
from strategy.trainers.data.files import (
    DataError,
    Stats,
    Tokenize,
    admitted_parts,
    finished,
    load_table,
    pair_parts,
    read_rows,
    text_field,
)
from strategy.trainers.losses import IGNORE

KL_PREFIX = "kl_"  # batch keys of the mismatched sequences


def kto_parts(tokenizer: Any, cfg: DataConfig):
    """``make(row, where) -> (parts, desirable flags)`` of KTO rows or preference rows."""
    tok, pairs = Tokenize(tokenizer, cfg), pair_parts(tokenizer, cfg)

    def make(row: dict, where: str) -> tuple[list, tuple[bool, ...]]:
        label = row.get(cfg.label_key)
        if label is None and row.get(cfg.chosen_key) is not None:  # a pair: one of each
            return pairs(row, where), (True, False)
        if not isinstance(label, bool):
            raise DataError(f"{where}: {cfg.label_key!r} is {label!r}, not true/false; set "
                            "--label_key, or give --chosen_key/--rejected_key rows")
        prompt, completion = row.get(cfg.prompt_key), row.get(cfg.completion_key)
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            prompt, completion = (text_field(row, key, where)
                                  for key in (cfg.prompt_key, cfg.completion_key))
        return [tok.response(prompt, completion, where)], (label,)
    return make


def check_first_row(cfg: DataConfig) -> None:
    """KTO's columns on the first row of each ``--dataset`` source, read lazily (one row), so data
    without labels is refused before any process group starts.

    Args:
        cfg: the ``DataConfig``.

    Raises:
        DataError: a source's first row has neither ``label_key`` nor ``chosen_key``.
    """
    for source in (cfg.dataset or "").split(","):
        row = next(iter(load_table(source.strip(), cfg.dataset_split, streaming=True)), None)
        if row is not None and row.get(cfg.label_key) is None \
                and row.get(cfg.chosen_key) is None:
            raise DataError(f"label_key={cfg.label_key!r} is invalid: {source.strip()} row 0 has "
                            f"no {cfg.label_key!r} (nor {cfg.chosen_key!r}), only "
                            f"{sorted(row)}; set --label_key, or give preference pairs")


def load_kto(path: str, tokenizer: Any, cfg: DataConfig, max_samples: int = -1,
             **source: Any) -> list[dict]:
    """KTO samples ``{"input_ids", "labels", "desirable", "kl_ids", "kl_labels"}``; rows failing
    checks raise, or are counted and skipped.

    Args:
        path: what ``files.read_rows`` reads.
        tokenizer: turns text into ids.
        cfg: the ``DataConfig`` (``prompt_key``, ``completion_key``, ``label_key``...).
        max_samples: at most this many rows (-1: all).
        **source: ``split`` and ``probabilities`` for ``read_rows``.

    Returns:
        The samples, with their mismatched KL sequences.
    """
    stats, split, make = Stats(path), source.get("split", "train"), kto_parts(tokenizer, cfg)
    flags: list[tuple[bool, ...]] = []

    def parts_only(row: dict, where: str) -> list:
        parts, desirable = make(row, where)
        flags.append(desirable)
        return parts

    samples = []
    for parts in admitted_parts(read_rows(path, max_samples, **source), path, split, cfg, stats,
                                parts_only):
        samples += [{"input_ids": ids, "labels": labels, "desirable": good}
                    for (ids, labels, _), good in zip(parts, flags[-1])]
    return with_mismatched(finished(samples, stats, path), cfg.max_len)


def _prompt_length(sample: dict) -> int:
    """Tokens before the first scored one."""
    return next((i for i, v in enumerate(sample["labels"]) if v != IGNORE),
                len(sample["labels"]))


def with_mismatched(samples: list[dict], max_len: int) -> list[dict]:
    """Each sample's KL sequence: its prompt, then the completion of the next sample (wrapping)
    whose prompt differs (its own when every prompt is the same), cut to ``max_len``.

    Args:
        samples: KTO samples in file order.
        max_len: the longest sequence.

    Returns:
        ``samples``, each given ``kl_ids`` and ``kl_labels``.
    """
    starts = [_prompt_length(s) for s in samples]
    prompts = [tuple(s["input_ids"][:n]) for s, n in zip(samples, starts)]
    for i, sample in enumerate(samples):
        j = next((k % len(samples) for k in range(i + 1, i + len(samples))
                  if prompts[k % len(samples)] != prompts[i]), i)
        other, start = samples[j], starts[j]
        ids = list(prompts[i]) + other["input_ids"][start:]
        labels = [IGNORE] * len(prompts[i]) + other["labels"][start:]
        sample["kl_ids"], sample["kl_labels"] = ids[:max_len], labels[:max_len]
    return samples


def collate_kto(pad_id: int):
    """Right-padded completions (``collate_sft``'s keys), ``desirable`` flags, and the
    mismatched sequences under ``kl_``-prefixed keys."""
    plain = collate_sft(pad_id)

    def collate(batch: list[dict]) -> dict:
        out = plain(batch)
        kl = plain([{"input_ids": b["kl_ids"], "labels": b["kl_labels"]} for b in batch])
        out.update({KL_PREFIX + key: value for key, value in kl.items()})
        out["desirable"] = torch.tensor([b["desirable"] for b in batch])
        return out
    return collate


def mismatched(batch: dict) -> dict:
    """The batch of ``batch``'s mismatched sequences, under plain keys.

    Args:
        batch: a ``collate_kto`` batch.

    Returns:
        ``input_ids``, ``labels`` and ``attention_mask`` of the KL sequences.
    """
    return {key[len(KL_PREFIX):]: value for key, value in batch.items()
            if key.startswith(KL_PREFIX)}
