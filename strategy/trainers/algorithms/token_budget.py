"""Micro-batches by a token budget (OpenRLHF's ``--train.dynamic_batch_enable`` with
``--train.max_tokens_per_gpu``, and ``--rollout.max_tokens_per_gpu`` for the experience
forwards): a run of completions cut into contiguous micro-batches whose forwards hold at most the
budget's tokens, as few as fit; every rank then cuts into the most any rank needs (its forwards
and ZeRO's collectives pair up), each as even as the cut allows.

A micro-batch's tokens are what its forward processes: the sum of its rows' lengths when it runs
padding-free (``--packing_samples``), its rows x its longest row otherwise. The cuts keep the
rollout's order (a group's completions stay together; OpenRLHF balances over a reordering).
"""

from __future__ import annotations

from typing import Any

import torch


def forward_tokens(lengths: list[int], packed: bool) -> int:
    """The tokens a forward of rows of ``lengths`` processes (``packed``: no padding)."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def _greedy(lengths: list[int], budget: int, packed: bool) -> list[int]:
    """Contiguous chunk sizes, each as long as fits ``budget`` (a longer row alone)."""
    sizes, total, longest, count = [], 0, 0, 0
    for length in lengths:
        grown = (total + length if packed else (count + 1) * max(longest, length))
        if count and grown > budget:
            sizes.append(count)
            total, longest, count = 0, 0, 0
        total, longest, count = total + length, max(longest, length), count + 1
    if count:
        sizes.append(count)
    return sizes


def fewest_chunks(lengths: list[int], budget: int, packed: bool) -> int:
    """How few contiguous micro-batches of at most ``budget`` tokens hold ``lengths`` (a row
    longer than the budget alone)."""
    return len(_greedy(lengths, budget, packed))


def chunk_sizes(lengths: list[int], count: int, packed: bool) -> list[int]:
    """Sizes of ``count`` contiguous micro-batches of ``lengths`` (``count`` <= its rows) whose
    largest forward is as small as a contiguous cut allows.

    Args:
        lengths: each row's tokens, in order.
        count: how many micro-batches.
        packed: forwards without padding (tokens are the sum of lengths).

    Returns:
        The rows of each micro-batch, in order; they sum to ``len(lengths)``.
    """
    low = max(forward_tokens([n], packed) for n in lengths)
    high = forward_tokens(lengths, packed)
    while low < high:  # the smallest budget that needs at most ``count`` micro-batches
        middle = (low + high) // 2
        if fewest_chunks(lengths, middle, packed) <= count:
            high = middle
        else:
            low = middle + 1
    sizes = _greedy(lengths, low, packed)
    while len(sizes) < count:  # more micro-batches than the budget needs: halve the largest
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        cost = [forward_tokens(lengths[s:s + n], packed) if n > 1 else -1
                for s, n in zip(starts, sizes)]
        i = cost.index(max(cost))
        part = lengths[starts[i]:starts[i] + sizes[i]]
        cut = min(range(1, len(part)), key=lambda c: max(forward_tokens(part[:c], packed),
                                                         forward_tokens(part[c:], packed)))
        sizes[i:i + 1] = [cut, len(part) - cut]
    return sizes


def _runs(lengths: list[int], steps: int) -> list[list[int]]:
    """``lengths`` as ``steps`` equal runs, in order (each optimizer step's rows)."""
    per_step = len(lengths) // steps
    return [lengths[s * per_step:(s + 1) * per_step] for s in range(steps)]


def step_counts(lengths: list[int], steps: int, budget: int, packed: bool) -> list[int]:
    """``fewest_chunks`` of each optimizer step's rows (``steps`` equal runs of ``lengths``)."""
    return [fewest_chunks(run, budget, packed) for run in _runs(lengths, steps)]


def budget_bounds(lengths: list[int], steps: int, budget: int, packed: bool,
                  most: list[int] | None = None) -> list[tuple[int, int, int]]:
    """Each optimizer step's rows (``steps`` equal runs of ``lengths``) cut into micro-batches.

    Args:
        lengths: a rank's rows' tokens, in order.
        steps: optimizer steps they train in (their rows split evenly, in order).
        budget: tokens per micro-batch.
        packed: forwards without padding.
        most: micro-batches per step (every rank's most of ``fewest_chunks``); None: this
            rank's own.

    Returns:
        ``(first row, end row, step)`` per micro-batch, in order.
    """
    counts = most or step_counts(lengths, steps, budget, packed)
    bounds, start = [], 0
    for step, (run, count) in enumerate(zip(_runs(lengths, steps), counts)):
        for size in chunk_sizes(run, count, packed):
            bounds.append((start, start + size, step))
            start += size
    return bounds


def agreed_bounds(strategy: Any, lengths: list[int], steps: int, budget: int,
                  packed: bool) -> list[tuple[int, int, int]]:
    """``budget_bounds`` with each step cut into the most micro-batches any rank needs
    (collective: every rank calls it alike, so their forwards pair up)."""
    own = torch.tensor(step_counts(lengths, steps, budget, packed))
    most = strategy.all_reduce(own, op="max").tolist()
    return budget_bounds(lengths, steps, budget, packed, most)
