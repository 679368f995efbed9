"""Which trainer each command runs, and a command's arguments in our spellings."""

from __future__ import annotations

import sys
from typing import Sequence

from strategy.cli.dotted import dotted_argv, openrlhf_argv
from strategy.dist import install_one_line_errors
from strategy.trainers.run import commands

SUMMARIES = {  # command -> one line for ``strategy --help``, in its order
    "sft": "supervised fine-tuning on prompt/response or chat data",
    "rm": "a reward model on preference pairs",
    "dpo": "DPO (sigmoid, IPO, hinge, robust) against a frozen reference",
    "orpo": "ORPO: SFT plus an odds-ratio term, no reference",
    "simpo": "SimPO: length-normalised rewards, no reference",
    "kto": "KTO on completions labelled desirable or not",
    "grpo": "GRPO, REINFORCE++, RLOO: online RL from rewards, no critic",
    "ppo": "PPO with a critic (GAE): online RL",
    "distill": "on-policy distillation (GKD) from a frozen teacher",
}
# command -> (trainer, summary): the built-in trainers by their ``Trainer.command``
TRAINERS = {name: (commands()[name], about) for name, about in SUMMARIES.items()}


def command_argv(argv: Sequence[str] | None,
                 command: str | None = None) -> list[str]:
    """A command's arguments (``sys.argv`` when None) with OpenRLHF's dotted flags and
    multi-value spellings in ours (``dotted.dotted_argv``, ``dotted.openrlhf_argv``).

    Args:
        argv: the command line without the program name.
        command: the trainer's command, for flags whose meaning depends on it.

    Returns:
        The translated arguments.
    """
    install_one_line_errors()  # a refused flag is one line, as Run.from_args's errors are
    return openrlhf_argv(dotted_argv(list(sys.argv[1:] if argv is None else argv), command))
