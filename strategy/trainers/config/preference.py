"""The preference trainers' own settings: DPO (and IPO, cDPO...), ORPO, SimPO, KTO, the reward
model."""

from __future__ import annotations

from dataclasses import dataclass

from strategy.config.fields import doc
from strategy.errors import fail
from strategy.trainers.config.common import positive

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


@dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimization."""

    beta: float = doc("DPO: strength of the KL penalty to the reference model", 0.1)
    label_smoothing: float = doc("DPO: probability that a preference label is flipped "
                                 "(conservative DPO with sigmoid; rDPO with robust)", 0.0)
    nll_loss_coef: float = doc("DPO: weight of an extra NLL loss on the chosen response", 0.0)
    loss_type: str = doc("DPO loss: sigmoid (DPO), ipo ((margin - 1/(2 beta))^2), hinge (SLiC, "
                         "relu(1 - beta margin)) or robust (rDPO, needs --label_smoothing)",
                         "sigmoid")
    ipo: bool = doc("OpenRLHF's spelling of --loss_type ipo", False)

    def __post_init__(self) -> None:
        if self.ipo:  # OpenRLHF's flag: the same as --loss_type ipo
            if self.loss_type not in ("sigmoid", "ipo"):
                fail("ipo", True, f"it means --loss_type ipo, but --loss_type {self.loss_type} "
                     "was given too; pass one")
            object.__setattr__(self, "loss_type", "ipo")
        if self.beta <= 0:
            fail("beta", self.beta, "use a positive DPO beta, e.g. 0.1")
        if not 0 <= self.label_smoothing < 0.5:
            fail("label_smoothing", self.label_smoothing, "use a value in [0, 0.5)")
        if self.nll_loss_coef < 0:
            fail("nll_loss_coef", self.nll_loss_coef, "use a weight >= 0")
        if self.loss_type not in DPO_LOSS_TYPES:
            fail("loss_type", self.loss_type, f"use one of {', '.join(DPO_LOSS_TYPES)}")
        if self.label_smoothing and self.loss_type in ("ipo", "hinge"):
            fail("label_smoothing", self.label_smoothing, f"the {self.loss_type} loss has no "
                 "label smoothing; set 0 or use --loss_type sigmoid or robust")


@dataclass(frozen=True)
class ORPOConfig:
    """Odds-ratio preference optimization: SFT on the chosen response plus an odds-ratio term."""

    orpo_lambda: float = doc("ORPO: weight of the odds-ratio term against the chosen NLL (the "
                             "paper's lambda, TRL's beta)", 0.1)

    def __post_init__(self) -> None:
        positive(self, "orpo_lambda")


@dataclass(frozen=True)
class SimPOConfig:
    """Simple preference optimization: length-normalised rewards, no reference model."""

    simpo_beta: float = doc("SimPO: reward scale beta on mean per-token log-probs", 2.0)
    simpo_gamma: float = doc("SimPO: target reward margin gamma (the paper's gamma; TRL's "
                             "simpo_gamma)", 1.0)
    simpo_label_smoothing: float = doc("SimPO: probability that a preference label is flipped",
                                       0.0)
    simpo_nll_coef: float = doc("SimPO: weight of an NLL loss on the chosen response (CPO-SimPO; "
                                "TRL's cpo_alpha)", 0.0)

    def __post_init__(self) -> None:
        positive(self, "simpo_beta")
        if self.simpo_gamma < 0:
            fail("simpo_gamma", self.simpo_gamma, "use a margin >= 0, e.g. 1.0")
        if not 0 <= self.simpo_label_smoothing < 0.5:
            fail("simpo_label_smoothing", self.simpo_label_smoothing, "use a value in [0, 0.5)")
        if self.simpo_nll_coef < 0:
            fail("simpo_nll_coef", self.simpo_nll_coef, "use a weight >= 0")


@dataclass(frozen=True)
class KTOConfig:
    """Kahneman-Tversky optimization on unpaired completions labelled desirable or not."""

    kto_beta: float = doc("KTO: reward scale beta", 0.1)
    desirable_weight: float = doc("KTO: weight of desirable completions' losses", 1.0)
    undesirable_weight: float = doc("KTO: weight of undesirable completions' losses", 1.0)

    def __post_init__(self) -> None:
        positive(self, "kto_beta", "desirable_weight", "undesirable_weight")


@dataclass(frozen=True)
class RewardConfig:
    """Reward-model training."""

    loss: str = doc("RM pairwise loss: sigmoid, -log sigmoid(chosen - rejected) (OpenRLHF's "
                    "logexpsigmoid, log(1 + exp(rejected - chosen)), is the same function)",
                    "sigmoid")

    def __post_init__(self) -> None:
        if self.loss not in ("sigmoid", "logexpsigmoid"):
            fail("loss", self.loss, "use sigmoid (or logexpsigmoid, the same function)")

