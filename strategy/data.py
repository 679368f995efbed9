"""A distributed sampler whose position can be saved and restored mid-epoch."""

from __future__ import annotations

from typing import Iterator

from torch.utils.data import DistributedSampler


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
