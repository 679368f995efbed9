"""On-policy completions, shared by the trainers that sample their own (GRPO, PPO,
distillation): a seeded sampling generator, generation through the strategy's rollout engine with
exactly the settings asked for, and prompt + completion micro-batches."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from deepspeed.accelerator import get_accelerator
from transformers import GenerationConfig

from strategy.model import base_model
from strategy.trainers.losses import IGNORE


@contextmanager
def sampling_rng(seed: int, step: int, rank: int, round_: int = 0) -> Iterator[None]:
    """The global RNGs, seeded by (seed, step, rank, sampling round) inside the block and as
    before after it."""
    accelerator = get_accelerator()
    devices = [] if accelerator.device_name() == "cpu" else [accelerator.current_device()]
    with torch.random.fork_rng(devices=devices, device_type=accelerator.device_name()):
        base = (seed * 1_000_003 + step) * 1_009 + rank
        torch.manual_seed(base if not round_ else (base * 7_919 + round_) % 2**63)
        if devices:
            accelerator.manual_seed(torch.initial_seed())
        yield


def generate_completions(rollouts: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         settings: dict, group: int = 1) -> torch.Tensor:
    """Completions (right of the prompts; padded after their end) from a ``RolloutEngine``, with
    ``settings`` alone: the checkpoint's ``generation_config`` (a ``repetition_penalty`` or
    ``min_p`` there would reshape the distribution the log-probs do not account for) is set
    aside while generating. Every rank calls this alike.

    Args:
        rollouts: the strategy's ``rollout_engine``, synced.
        prompt_ids: left-padded prompt token ids.
        prompt_mask: their attention mask.
        settings: ``GenerationConfig`` fields (max_new_tokens, do_sample, temperature...).
        group: rows come in runs of ``group`` copies of one prompt.

    Returns:
        The completion token ids, one row per prompt.
    """
    module = getattr(rollouts, "module", None)  # None: an engine of its own (vLLM)
    if module is None:
        return rollouts.generate(prompt_ids, prompt_mask, GenerationConfig(**settings),
                                 group=group)[:, prompt_ids.shape[1]:]
    training, hf_model = module.training, base_model(module)
    saved, hf_model.generation_config = hf_model.generation_config, GenerationConfig()
    module.eval()
    try:
        out = rollouts.generate(prompt_ids, prompt_mask, GenerationConfig(**settings),
                                group=group)
    finally:
        hf_model.generation_config = saved
        module.train(training)
    return out[:, prompt_ids.shape[1]:]


def until_eos(completions: torch.Tensor, eos: int) -> list[list[int]]:
    """Each completion's tokens up to and including its first end-of-sequence token."""
    out = []
    for row in completions.tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def completion_batch(prompts: list[list[int]], completions: list[list[int]], pad: int,
                     scored: list[list[bool]] | None = None) -> dict:
    """Prompt + completion rows, right-padded, scored on the completion (``labels``).

    Args:
        prompts: each row's prompt tokens.
        completions: its completion tokens.
        pad: the padding id.
        scored: per completion token, whether it is scored (None: all; an episode's feedback is
            not: its label is ``IGNORE``).

    Returns:
        ``input_ids``, ``labels`` and ``attention_mask``.
    """
    ids = [p + c for p, c in zip(prompts, completions)]
    if scored is None:
        labels = [[IGNORE] * len(p) + c for p, c in zip(prompts, completions)]
    else:
        labels = [[IGNORE] * len(p) + [t if keep else IGNORE for t, keep in zip(c, m)]
                  for p, c, m in zip(prompts, completions, scored)]
    width = max(len(x) for x in ids)
    return {"input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
            "labels": torch.tensor([x + [IGNORE] * (width - len(x)) for x in labels]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])}


def prompts_of(batch: dict) -> list[list[int]]:
    """Each row's prompt: its attended tokens before the first scored one (an SFT batch).

    Args:
        batch: collated rows with ``input_ids``, ``attention_mask`` and ``labels``.

    Returns:
        The prompts' token ids.
    """
    out = []
    for ids, mask, labels in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist(),
                                 batch["labels"].tolist()):
        first = next((i for i, label in enumerate(labels) if label != IGNORE), len(labels))
        out.append([t for t, m in zip(ids[:first], mask[:first]) if m])
    return out


def regrouped(batches: list[dict], sizes: list[int], pad: int) -> list[dict]:
    """The rows of ``completion_batch`` micro-batches (right-padded) regrouped in order into
    micro-batches of ``sizes`` rows, each trimmed to its longest row: the experience stage's
    forward micro-batches (``--micro_rollout_batch_size``, or a token budget's), apart from
    training's.

    Args:
        batches: micro-batches with ``input_ids``, ``labels`` and ``attention_mask``.
        sizes: rows of each regrouped micro-batch (they sum to the rows of ``batches``).
        pad: the padding id.

    Returns:
        The regrouped micro-batches, with those three keys.
    """
    fill = {"input_ids": pad, "labels": IGNORE, "attention_mask": 0}
    rows = {key: [row for b in batches for row in b[key]] for key in fill}
    out, first = [], 0
    for size in sizes:
        part = {key: column[first:first + size] for key, column in rows.items()}
        first += size
        width = max(int(mask.sum()) for mask in part["attention_mask"])
        out.append({key: torch.stack([torch.nn.functional.pad(
            row[:width], (0, width - len(row[:width])), value=fill[key]) for row in column])
            for key, column in part.items()})
    return out


def scattered(outputs: list[torch.Tensor], batches: list[dict]) -> list[torch.Tensor]:
    """Per-token outputs of ``regrouped`` micro-batches (``token_logps``' layout, zero past each
    row's targets) back in ``batches``' rows and widths.

    Args:
        outputs: one tensor per regrouped micro-batch, rows x (its width - 1).
        batches: the micro-batches they were regrouped from.

    Returns:
        One tensor per micro-batch of ``batches``, rows x (its width - 1).
    """
    rows = [row for out in outputs for row in out]
    laid, first = [], 0
    for b in batches:
        count, width = b["input_ids"].shape
        out = torch.zeros(count, width - 1, dtype=rows[0].dtype)
        for index, row in enumerate(rows[first:first + count]):
            kept = row[:width - 1]
            out[index, :len(kept)] = kept
        laid.append(out)
        first += count
    return laid


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded for generation, and their attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def longest_prompt(*loaders: Any, key: str = "prompt_ids") -> int:
    """The most tokens of any row's ``key`` in the loaders' datasets (None loaders skipped): with
    the completion length, the longest sequence a rollout engine must hold."""
    return max((len(row[key]) for loader in loaders if loader is not None
                for row in loader.dataset), default=1)


def token_layout(prompts: list[list[int]], values: list[list[float]],
                 width: int) -> torch.Tensor:
    """Per-token values of completions (a rollout engine's log-probs, an episode's turn
    rewards), laid out as ``token_logps``'s output for ``completion_batch``'s rows of ``width``
    tokens (position ``j`` predicts token ``j + 1``; zero elsewhere)."""
    out = torch.zeros(len(prompts), width - 1)
    for row, (prompt, along) in enumerate(zip(prompts, values)):
        start = len(prompt) - 1
        out[row, start:start + len(along)] = torch.tensor(along, dtype=torch.float32)
    return out
