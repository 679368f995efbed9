"""Turning per-micro-batch metrics into exact per-step and held-out figures.

A metric is a float (averaged over micro-batches and ranks), a ``(sum, count)`` pair (an exact
mean over items: summed everywhere, then divided) or a ``Largest`` (the maximum everywhere).
Evaluation runs every rank through the same number of forwards (ZeRO-3 gathers parameters in
each one): a rank whose shard of the held-out set ran out repeats a batch whose metrics are
discarded, so no sample is counted twice or dropped.
"""

from __future__ import annotations

import math
from typing import Any


class Largest(float):
    """A metric reduced as its maximum over micro-batches and ranks."""


class MetricSums:
    """Sums of one step's (or one evaluation's) metrics on this rank."""

    def __init__(self) -> None:
        self.means: dict[str, float] = {}
        self.pairs: dict[str, list[float]] = {}
        self.largest: dict[str, float] = {}
        self.batches = 0

    def add(self, metrics: dict[str, Any], weight: int = 1) -> None:
        """Add one micro-batch's metrics; ``weight`` 0 only registers the keys (so every rank
        reduces the same keys even when its shard ran out)."""
        self.batches += weight
        for key, value in metrics.items():
            if isinstance(value, Largest):
                seen = float(value) if weight else -math.inf
                self.largest[key] = max(self.largest.get(key, -math.inf), seen)
            elif isinstance(value, tuple):
                total = self.pairs.setdefault(key, [0.0, 0.0])
                total[0] += weight * float(value[0])
                total[1] += weight * float(value[1])
            else:
                self.means[key] = self.means.get(key, 0.0) + weight * float(value)

    def add_totals(self, metrics: dict[str, tuple[float, float]]) -> None:
        """Add (sum, count) metrics that belong to the step, not to one micro-batch."""
        for key, (total, count) in metrics.items():
            pair = self.pairs.setdefault(key, [0.0, 0.0])
            pair[0] += float(total)
            pair[1] += float(count)

    def reduce(self, strategy, extra: dict | None = None) -> tuple[dict, dict]:
        """Collective (one all-reduce; a second where there are ``Largest`` metrics, whose keys
        every rank has alike): the metrics over all ranks, and ``extra`` summed."""
        packed = {"means": self.means, "pair_sums": {k: v[0] for k, v in self.pairs.items()},
                  "pair_counts": {k: v[1] for k, v in self.pairs.items()}, "batches": self.batches,
                  "extra": extra or {}}
        total = strategy.all_reduce(packed, op="sum")
        batches = max(total["batches"], 1)
        out = {key: value / batches for key, value in total.get("means", {}).items()}
        for key, value in total.get("pair_sums", {}).items():
            count = total["pair_counts"][key]
            out[key] = value / count if count else math.nan
        if self.largest:
            out.update(strategy.all_reduce(dict(self.largest), op="max"))
        return out, total.get("extra", {})


def one_sample_batch(loader) -> dict:
    """A real batch of one sample (the metrics of a filler batch are discarded)."""
    return loader.collate_fn([loader.dataset[0]])


def lockstep_batches(loader):
    """(batch, real) pairs: this rank's batches, then fillers up to the longest rank's count, so
    every rank runs the same number of forwards."""
    real = 0
    for batch in loader:
        real += 1
        yield batch, True
    for _ in range(loader.sampler.max_batches(loader.batch_size) - real):
        yield one_sample_batch(loader), False
