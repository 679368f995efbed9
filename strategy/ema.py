"""An exponential moving average of the trained weights, kept where each rank keeps its weights.

``ema = beta * ema + (1 - beta) * weights`` after every optimizer step, for each trainable
parameter, on this rank's own part of it: under ZeRO-3 its flat partition (``ds_tensor``), so the
average is partitioned like the parameters and never gathered whole; otherwise the parameter (a
tensor-parallel slice under AutoTP). Held in fp32 whatever the training precision. Checkpoints
hold each rank's part (``ema_<rank>.safetensors``); ``swapped_in`` puts the average into the
weights for an export and back afterwards.

``moving_average`` is OpenRLHF's form: the average kept in a second model (an eval engine), each
pair of parameters gathered whole under ZeRO-3 for the update.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import deepspeed
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from strategy.errors import CheckpointFileError, fail
from strategy.internals import engine_counters, local_partition


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


def just_stepped(engine: nn.Module) -> bool:
    """Whether ``engine`` (a training engine) has just finished an optimizer step: its micro-steps
    are a whole number of accumulations. A module that is no engine counts as stepped.

    Args:
        engine: the training engine.

    Returns:
        True right after an accumulation boundary's step.
    """
    if not hasattr(engine, "gradient_accumulation_steps"):
        return True
    micro = engine_counters(engine)[2]
    return micro > 0 and micro % engine.gradient_accumulation_steps() == 0


@torch.no_grad()
def moving_average(model: nn.Module, model_ema: nn.Module, beta: float,
                   device: str | torch.device = "cpu") -> None:
    """Collective under ZeRO-3: ``ema = beta * ema + (1 - beta) * weights`` for each trainable
    parameter of ``model`` and the parameter at the same place in ``model_ema``, when ``model``
    has just stepped (``just_stepped``; OpenRLHF counts calls to the same end). Partitioned
    parameters are gathered pair by pair and the new average is kept (rank 0's, which every rank
    computed alike, is partitioned again).

    Args:
        model: the trained model or engine.
        model_ema: the model (or eval engine) holding the average, built like ``model``.
        beta: the decay, in (0, 1).
        device: where the arithmetic runs (fp32); the result goes back where ``model_ema`` keeps it.

    Raises:
        ConfigError: ``beta`` is outside (0, 1), or the two models' parameters differ in number.
    """
    if not 0 < beta < 1:
        fail("beta", beta, "use a decay in (0, 1), e.g. 0.992")
    if not just_stepped(model):
        return
    params, averages = list(model.parameters()), list(model_ema.parameters())
    if len(params) != len(averages):
        fail("model_ema", f"{len(averages)} parameters", f"build it like the model ({len(params)} "
             "parameters), e.g. from the same config or checkpoint")
    for param, average in zip(params, averages):
        if not param.requires_grad:
            continue
        # the trained weight is only read; the average's new value is kept on leaving
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None), \
                deepspeed.zero.GatheredParameters([average], modifier_rank=0):
            blended = average.data.to(device, torch.float32)
            blended.lerp_(param.data.to(device, torch.float32), 1.0 - beta)
            average.data.copy_(blended)
