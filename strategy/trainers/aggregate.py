"""Turning per-micro-batch metrics into exact per-step and held-out figures.

A metric is a float (averaged over micro-batches and ranks) or a ``(sum, count)`` pair (an exact
mean over items: summed everywhere, then divided). Evaluation runs every rank through the same
number of forwards (ZeRO-3 gathers parameters in each one): a rank whose shard of the held-out set
ran out repeats a batch whose metrics are discarded, so no sample is counted twice or dropped.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class MetricSums:
    """Sums of one step's (or one evaluation's) metrics on this rank."""

    def __init__(self) -> None:
        self.means: dict[str, float] = {}
        self.pairs: dict[str, list[float]] = {}
        self.batches = 0

    def add(self, metrics: dict[str, Any], weight: int = 1) -> None:
        """Add one micro-batch's metrics; ``weight`` 0 only registers the keys (so every rank
        reduces the same keys even when its shard ran out)."""
        self.batches += weight
        for key, value in metrics.items():
            if isinstance(value, tuple):
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
        """Collective (one all-reduce): the metrics over all ranks, and ``extra`` summed."""
        packed = {"means": self.means, "pair_sums": {k: v[0] for k, v in self.pairs.items()},
                  "pair_counts": {k: v[1] for k, v in self.pairs.items()}, "batches": self.batches,
                  "extra": extra or {}}
        total = strategy.all_reduce(packed, op="sum")
        batches = max(total["batches"], 1)
        out = {key: value / batches for key, value in total.get("means", {}).items()}
        for key, value in total.get("pair_sums", {}).items():
            count = total["pair_counts"][key]
            out[key] = value / count if count else math.nan
        return out, total.get("extra", {})


def _filler(loader) -> dict:
    """A real batch for a rank whose shard ran out (its metrics are discarded)."""
    return loader.collate_fn([loader.dataset[0]])


def _lockstep_batches(loader):
    """(batch, real) pairs: this rank's batches, then fillers up to the longest rank's count."""
    real = 0
    for batch in loader:
        real += 1
        yield batch, True
    for _ in range(loader.sampler.max_batches(loader.batch_size) - real):
        yield _filler(loader), False


@torch.no_grad()
def evaluate_lockstep(trainer, loader) -> dict:
    """Exact held-out metrics: the items every loss averages over are counted over the whole set
    first (one collective), then each batch's loss is its share of the whole."""
    counts = dict.fromkeys(trainer.loss_counts(_filler(loader)), 0.0)  # the same keys everywhere
    batches = 0
    for batch in loader:
        batches += 1
        for key, value in trainer.loss_counts(batch).items():
            counts[key] = counts.get(key, 0.0) + float(value)
    totals = trainer.strategy.all_reduce({"counts": counts, "batches": batches}, op="sum",
                                         group="data")
    trainer.prepare_eval_counts(totals.get("counts", {}), int(totals["batches"]))
    sums = MetricSums()
    for batch, real in _lockstep_batches(loader):
        batch = trainer.to_device(batch)
        trainer.set_micro_counts(trainer.loss_counts(batch))
        batch = trainer.strategy.shard_sequence(batch)
        sums.add(trainer.eval_metrics(batch), weight=int(real))
    return sums.reduce(trainer.strategy)[0]
