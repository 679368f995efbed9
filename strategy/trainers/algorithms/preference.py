"""What the pair trainers share: per-sequence log-probabilities of a pair batch (sums, or means
per response token), the items their losses average over, and the reference-free trainers ORPO
and SimPO.

Under sequence parallelism each rank holds a slice of every sequence: log-probability sums and
token counts are added over the group (the sums with a gradient-carrying all-reduce whose backward
sums every rank's gradient), so a pair term, the same on every rank, is divided by the group size;
an NLL term is a sum over this rank's own tokens and needs no such care.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from strategy.config import StrategyConfig
from strategy.errors import fail
from strategy.log import get_logger
from strategy.rollout.remote_models import remote_group
from strategy.trainers.config import LoraConfig, ModelConfig, ORPOConfig, SimPOConfig
from strategy.trainers.data import PAIRS
from strategy.trainers.data.packing import pair_count, per_sample_sums
from strategy.trainers.loop import Trainer
from strategy.trainers.losses import IGNORE, orpo_losses, simpo_losses, token_logps

__all__ = ["ORPOTrainer", "ReferenceFreeTrainer", "SimPOTrainer", "pair_loss_counts",
           "reference_model", "sequence_logps", "sequence_logp_sums"]

log = get_logger("train")


def sequence_logp_sums(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of each sample's response tokens and their count (this rank's
    slice): chosen samples first, then rejected, for plain or packed pair batches.

    Args:
        model: the engine (or module) to score with.
        batch: a pair batch (``collate_pairs`` or ``collate_packed_pairs``), on the device.

    Returns:
        ``(sums, counts)``, one value per sample.
    """
    logp, mask = token_logps(model, batch)
    if "sample_index" not in batch:
        return logp.sum(-1), mask.sum(-1)
    index = batch.get("shift_sample_index")  # a sequence-parallel slice's, shifted with it
    if index is None:
        index = batch["sample_index"][:, 1:]  # the sample each next-token target belongs to
    samples = 2 * pair_count(batch)
    return per_sample_sums(logp, index, samples), per_sample_sums(mask.long(), index, samples)


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Summed log-probability of each sample's response tokens (of this rank's slice).

    Args:
        model: the engine (or module) to score with.
        batch: a pair batch, on the device.

    Returns:
        One sum per sample, chosen samples first.
    """
    return sequence_logp_sums(model, batch)[0]


def pair_loss_counts(batch: dict) -> dict[str, int]:
    """A pair batch's pairs and scored chosen tokens (what pair and NLL terms average over).

    Args:
        batch: a collated pair batch (whole sequences).

    Returns:
        ``{"pairs": ..., "chosen_tokens": ...}``.
    """
    pairs = pair_count(batch)
    if "sample_index" in batch:  # packed: chosen samples are numbered below `pairs`
        chosen = (batch["sample_index"][:, 1:] < pairs) & (batch["sample_index"][:, 1:] >= 0)
        tokens = chosen & (batch["labels"][:, 1:] != IGNORE)
    else:
        tokens = batch["labels"][:pairs, 1:] != IGNORE
    return {"pairs": pairs, "chosen_tokens": int(tokens.sum())}


def reference_model(run: Any, model):
    """The frozen reference of DPO, KTO and the on-policy KL: ``--ref_pretrain``, else
    ``--pretrain`` loaded again (in 4-bit too with ``--load_in_4bit``); from ``--model_config``, a
    copy of ``model``'s fresh weights (ZeRO 0-2, no LoRA).

    Args:
        run: the ``Run`` (its strategy, model config and attention settings).
        model: the policy (from ``Run.model``), copied when there is no checkpoint to load.

    Returns:
        The reference model, frozen (the strategy's ``prepare`` makes it an eval engine); in a
        Ray job whose reference has a group of its own, that group (``RemoteReference``).

    Raises:
        ConfigError: from ``--model_config`` under ZeRO-3 or LoRA.
    """
    remote = remote_group("ref")
    if remote is not None:
        return remote
    source = run.model_cfg.ref_pretrain or run.model_cfg.pretrain
    if source:  # QLoRA: the same 4-bit base
        return run.strategy.from_pretrained(source, frozen=True, **run.attention(),
                                            **run.quantization())
    check_reference_source({ModelConfig: run.model_cfg, StrategyConfig: run.strategy.config,
                            LoraConfig: run.lora})
    return copy.deepcopy(model).requires_grad_(False)


def check_reference_source(configs: dict) -> None:
    """A frozen reference needs weights to load, or fresh ones it can copy (``reference_model``).

    Args:
        configs: the parsed configs by class.

    Raises:
        ConfigError: a model built from ``--model_config`` under ZeRO-3 or LoRA.
    """
    model = configs[ModelConfig]
    if model.ref_pretrain or model.pretrain:
        return
    if configs[StrategyConfig].partitions_parameters or configs[LoraConfig].lora_rank:
        fail("model_config", model.model_config, "a reference copied from fresh weights needs "
             "ZeRO 0-2 without LoRA; pass --pretrain MODEL_DIR (or --ref_pretrain) instead")


def refuse_reference(configs: dict, trainer: str) -> None:
    """A reference-free trainer refuses a reference model (DPO's flags it does not parse)."""
    ref = configs[ModelConfig].ref_pretrain
    if ref:
        fail("ref_pretrain", ref, f"{trainer} is reference-free (no reference model); drop it")


class ReferenceFreeTrainer(Trainer):
    """Pairs scored by the policy alone, on mean per-token log-probs: no reference engine is built
    (one forward per micro-batch, one model's memory). Subclasses give ``pair_losses`` and
    ``nll_coef``.

    Args:
        strategy: the ``DeepSpeedStrategy``.
        model: the policy to train.
        *args: ``Trainer``'s (optimizer, scheduler, loaders, config, tokenizer).
        **kwargs: ``Trainer``'s, by name.
    """

    data = PAIRS
    nll_coef = 0.0  # weight of the chosen responses' NLL (mean over their tokens)

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:
        refuse_reference(configs, cls.__name__)

    def __init__(self, strategy, model, *args, **kwargs) -> None:
        super().__init__(strategy, model, *args, **kwargs)
        log.info("%s: reference-free, no reference model built", type(self).__name__)

    def pair_losses(self, chosen: torch.Tensor,
                    rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Per-pair losses and metrics from mean per-token log-probs.

        Args:
            chosen: the chosen responses' mean log-probs (whole sequences).
            rejected: the rejected responses'.

        Returns:
            ``(losses, metrics)``.

        Raises:
            NotImplementedError: a subclass must implement it.
        """
        raise NotImplementedError

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return pair_loss_counts(batch)

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        local, counts = sequence_logp_sums(self.model, batch)
        sums = self.strategy.sequence_sum(local.float(), keep_gradient=True)
        means = sums / self.strategy.sequence_sum(counts.float()).clamp(min=1)
        half = means.shape[0] // 2
        losses, metrics = self.pair_losses(means[:half], means[half:])
        loss = self.normalize(losses.sum(), "pairs") / self.strategy.sequence_parallel_size
        if self.nll_coef > 0:
            nll = self.normalize(-local[:half].sum(), "chosen_tokens")
            loss = loss + self.nll_coef * nll
            metrics["nll"] = (-local[:half].sum().item(), float(counts[:half].sum()))
        return loss, metrics


class ORPOTrainer(ReferenceFreeTrainer):
    """ORPO (Hong et al. 2024): the chosen responses' NLL plus ``orpo_lambda`` times the
    odds-ratio loss, as TRL's ``ORPOTrainer`` computes it. The NLL is a mean over every chosen
    token of the step; the odds-ratio term a mean over its pairs.

    Args:
        strategy: the ``DeepSpeedStrategy``.
        model: the policy to train.
        *args: ``Trainer``'s (optimizer, scheduler, loaders, config, tokenizer).
        orpo: the ``ORPOConfig`` (default: ``ORPOConfig()``).
        **kwargs: ``Trainer``'s, by name.
    """

    command = "orpo"
    config_classes = (ORPOConfig,)
    nll_coef = 1.0

    def __init__(self, strategy, model, *args, orpo: ORPOConfig | None = None, **kwargs) -> None:
        super().__init__(strategy, model, *args, **kwargs)
        self.orpo = orpo or ORPOConfig()

    def pair_losses(self, chosen: torch.Tensor,
                    rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return orpo_losses(chosen, rejected, self.orpo.orpo_lambda)


class SimPOTrainer(ReferenceFreeTrainer):
    """SimPO (Meng et al. 2024): ``-log sigmoid(beta (mean log-prob chosen - rejected) - gamma)``
    per pair, optionally with the chosen NLL (CPO-SimPO).

    Args:
        strategy: the ``DeepSpeedStrategy``.
        model: the policy to train.
        *args: ``Trainer``'s (optimizer, scheduler, loaders, config, tokenizer).
        simpo: the ``SimPOConfig`` (default: ``SimPOConfig()``).
        **kwargs: ``Trainer``'s, by name.
    """

    command = "simpo"
    config_classes = (SimPOConfig,)

    def __init__(self, strategy, model, *args, simpo: SimPOConfig | None = None,
                 **kwargs) -> None:
        super().__init__(strategy, model, *args, **kwargs)
        self.simpo = simpo or SimPOConfig()
        self.nll_coef = self.simpo.simpo_nll_coef

    def pair_losses(self, chosen: torch.Tensor,
                    rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
        cfg = self.simpo
        return simpo_losses(chosen, rejected, cfg.simpo_beta, cfg.simpo_gamma,
                            cfg.simpo_label_smoothing)
