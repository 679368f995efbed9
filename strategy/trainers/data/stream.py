"""Datasets larger than memory (``--streaming``): rows read lazily through ``datasets``'
streaming mode, shuffled through a seeded buffer, dealt to data-parallel ranks and tokenized as
they come, pass after pass (each reshuffled) until ``--max_steps`` is reached.

Resume is exact: the stream is deterministic (seed, pass, rank), so a resumed run skips the
samples this rank already took (``global_step x accumulation x micro batch``) and continues with
the very next one. Skipping re-reads those rows: it costs their reading and tokenizing, not
training.
"""

from __future__ import annotations

from itertools import count
from typing import Any, Callable, Iterator

import datasets
import torch
from datasets.distributed import split_dataset_by_node

from strategy.errors import DataError
from strategy.trainers.data.files import Stats, admitted_parts, load_table, mix_tables


def open_stream(path: str, split: str, cfg: Any) -> datasets.IterableDataset:
    """``--dataset`` streamed: each comma-separated source through ``load_table``, mixed by
    ``--dataset_probs`` as ``read_rows`` mixes.

    Args:
        path: the source(s), as ``--dataset`` takes them.
        split: the split of folders and Hub ids.
        cfg: the ``DataConfig`` (``--dataset_probs``).

    Returns:
        The rows, streamed.

    Raises:
        DataError: a source that cannot be read, or sources that cannot be mixed.
    """
    tables = [load_table(part.strip(), split, streaming=True) for part in path.split(",")]
    return mix_tables(path, tables, cfg.probabilities())


class TokenStream(torch.utils.data.IterableDataset):
    """This data-parallel rank's samples of a streamed dataset, pass after pass.

    Args:
        rows: the streamed rows (all ranks alike; this class deals them out).
        make: ``make(row, where) -> parts`` (``files.sft_parts``...).
        assemble: parts to one sample (``files.sft_sample``...).
        cfg: the ``DataConfig`` (overlong policy, bad rows, shuffle buffer).
        name: the source, for messages.
        rank: this rank's data-parallel rank.
        world: the data-parallel size.
        seed: the shuffle seed (each pass adds its number).
    """

    def __init__(self, rows: datasets.IterableDataset, make: Callable, assemble: Callable,
                 cfg: Any, name: str, rank: int, world: int, seed: int) -> None:
        super().__init__()
        shuffled = rows.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer)
        self.rows = split_dataset_by_node(shuffled, rank=rank, world_size=world)
        self.make, self.assemble, self.cfg, self.name = make, assemble, cfg, name
        self.skip = 0  # samples of this rank already trained on (set on resume)

    def resume_at(self, samples: int) -> None:
        """Continue after this rank's first ``samples`` samples."""
        self.skip = samples

    def __iter__(self) -> Iterator[dict]:
        taken = 0
        for epoch in count():
            self.rows.set_epoch(epoch)
            found = False
            for parts in admitted_parts(self.rows, self.name, f"stream pass {epoch}", self.cfg,
                                  Stats(self.name), self.make):
                found, taken = True, taken + 1
                if taken > self.skip:
                    yield self.assemble(parts)
            if not found:
                raise DataError(f"dataset={self.name!r}: the stream gave this rank no usable "
                                "rows; check the data or use fewer ranks")
