"""Samplers: a training sampler whose position can be saved and restored mid-epoch, and a
held-out sampler that never pads."""

from __future__ import annotations

from typing import Iterator, Sized

from torch.utils.data import DistributedSampler, Sampler


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can skip the samples already consumed in the current epoch,
    so a resumed run sees exactly the batches the uninterrupted run would have seen."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0  # global samples of this epoch already consumed (all ranks together)

    def set_epoch(self, epoch: int, consumed_samples: int = 0) -> None:
        super().set_epoch(epoch)
        self.consumed = consumed_samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.consumed // self.num_replicas:])

    def __len__(self) -> int:
        return self.num_samples - self.consumed // self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(state["epoch"], state["consumed"])


class ShardSampler(Sampler[int]):
    """Held-out data without padding: rank ``r`` of ``n`` gets samples ``r, r + n, ...``, so
    every sample is seen exactly once even when the size does not divide by ``n`` (torch's
    ``DistributedSampler`` repeats samples to even the shards out). Shards then differ by at most
    one sample; ``max_batches`` tells every rank how many batches the longest shard has."""

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        self.size, self.num_replicas, self.rank = len(dataset), num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.num_replicas))

    def max_batches(self, batch_size: int) -> int:
        """Batches of the longest shard (rank 0's), the same number on every rank."""
        return -(-len(range(0, self.size, self.num_replicas)) // batch_size)
