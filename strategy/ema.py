"""An exponential moving average of the trained weights, kept where each rank keeps its weights.

``ema = beta * ema + (1 - beta) * weights`` after every optimizer step, for each trainable
parameter, on this rank's own part of it: under ZeRO-3 its flat partition (``ds_tensor``), so the
average is partitioned like the parameters and never gathered whole; otherwise the parameter (a
tensor-parallel slice under AutoTP). Held in fp32 whatever the training precision. Checkpoints
hold each rank's part (``ema_<rank>.safetensors``); ``swapped_in`` puts the average into the
weights for an export and back afterwards.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from strategy.errors import CheckpointFileError, fail
from strategy.internals import local_partition


class EMA:
    """The moving average of ``module``'s trainable parameters (starting from their values now).

    Args:
        module: the model (or engine) being trained.
        beta: the decay per step, in (0, 1).

    Raises:
        ConfigError: ``beta`` is outside (0, 1).
    """

    def __init__(self, module: nn.Module, beta: float) -> None:
        if not 0 < beta < 1:
            fail("ema_beta", beta, "use a decay in (0, 1), e.g. 0.999")
        self.beta = beta
        self.params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self.shadow = {name: local_partition(p).detach().float().clone()
                       for name, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: fold this rank's current weights into the average."""
        for name, p in self.params.items():
            self.shadow[name].lerp_(local_partition(p).float(), 1.0 - self.beta)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the weights hold the average (an export gathers them as usual)."""
        saved = {name: local_partition(p).detach().clone() for name, p in self.params.items()}
        try:
            with torch.no_grad():
                for name, p in self.params.items():
                    local_partition(p).copy_(self.shadow[name])
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    local_partition(p).copy_(saved[name])

    def file(self, ckpt_dir: str, rank: int) -> str:
        """Where a rank's part lives in a checkpoint.

        Args:
            ckpt_dir: the checkpoint (tag) directory.
            rank: the rank whose part it is.

        Returns:
            The path of ``ema_<rank>.safetensors``.
        """
        return os.path.join(ckpt_dir, f"ema_{rank}.safetensors")

    def save(self, ckpt_dir: str, rank: int) -> None:
        """Write this rank's part into a checkpoint.

        Args:
            ckpt_dir: the checkpoint (tag) directory.
            rank: this rank.
        """
        tensors = {name: t.contiguous().cpu() for name, t in self.shadow.items()}
        save_file(tensors, self.file(ckpt_dir, rank), metadata={"beta": repr(self.beta)})

    def load(self, ckpt_dir: str, rank: int) -> None:
        """Read this rank's part from a checkpoint saved with the same parameters and world size.

        Args:
            ckpt_dir: the checkpoint (tag) directory.
            rank: this rank.

        Raises:
            CheckpointFileError: the part is missing, or a weight is missing or shaped otherwise.
        """
        path = self.file(ckpt_dir, rank)
        if not os.path.isfile(path):
            raise CheckpointFileError(f"{path}: no EMA weights for rank {rank} (saved without "
                                      "--ema_beta, or at another world size); resume without "
                                      "--ema_beta or from a checkpoint that has them")
        saved = load_file(path)
        for name, tensor in self.shadow.items():
            if name not in saved or saved[name].shape != tensor.shape:
                raise CheckpointFileError(f"{path}: EMA weight {name!r} is missing or shaped "
                                          f"otherwise than {tuple(tensor.shape)}; resume at the "
                                          "same world size and model")
            tensor.copy_(saved[name])
