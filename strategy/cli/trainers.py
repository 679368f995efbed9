"""Which trainer each command runs, and a command's arguments in our spellings."""

from __future__ import annotations

import sys
from typing import Sequence

from strategy.cli.dotted import dotted_argv
from strategy.dist import install_one_line_errors
from strategy.trainers import (
    DPOTrainer,
    GRPOTrainer,
    KTOTrainer,
    ORPOTrainer,
    PPOTrainer,
    RewardModelTrainer,
    SFTTrainer,
    SimPOTrainer,
)

# command -> (trainer, one line for ``strategy --help``)
TRAINERS = {
    "sft": (SFTTrainer, "supervised fine-tuning on prompt/response or chat data"),
    "rm": (RewardModelTrainer, "a reward model on preference pairs"),
    "dpo": (DPOTrainer, "DPO (sigmoid, IPO, hinge, robust) against a frozen reference"),
    "orpo": (ORPOTrainer, "ORPO: SFT plus an odds-ratio term, no reference"),
    "simpo": (SimPOTrainer, "SimPO: length-normalised rewards, no reference"),
    "kto": (KTOTrainer, "KTO on completions labelled desirable or not"),
    "grpo": (GRPOTrainer, "GRPO, REINFORCE++, RLOO: online RL from rewards, no critic"),
    "ppo": (PPOTrainer, "PPO with a critic (GAE): online RL"),
}


def command_argv(argv: Sequence[str] | None,
                 command: str | None = None) -> list[str]:
    """A command's arguments (``sys.argv`` when None) with OpenRLHF's dotted flags in our
    spellings (``dotted.dotted_argv``).

    Args:
        argv: the command line without the program name.
        command: the trainer's command, for flags whose meaning depends on it.

    Returns:
        The translated arguments.
    """
    install_one_line_errors()  # a refused flag is one line, as Run.from_args's errors are
    return dotted_argv(list(sys.argv[1:] if argv is None else argv), command)
