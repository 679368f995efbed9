"""The package's logging: ``get_logger(topic)`` over the standard ``logging`` module.

A record prints to stdout as ``[topic] message``, on rank 0 only: other ranks' records are dropped
unless they are warnings or worse, which print as ``[topic rank r] message`` (a rank may have its
own problem to report). The topics, and so every prefix, are named in one place (``TOPICS``)::

    from strategy.log import get_logger

    log = get_logger("checkpoint")
    log.info("saved %s", path)                 # rank 0:  [checkpoint] saved /ckpt/global_step4
    log.warning("%s has no RNG state", path)   # any rank: [checkpoint rank 1] /ckpt/... has no ...

``print0`` (``strategy.print0``, ``DeepSpeedStrategy.print``) goes through the same handler, with
no prefix. The handler sits on the ``strategy`` logger, which does not propagate; to send the
package's records elsewhere, replace its handlers (``logging.getLogger("strategy")``) or set its
level. Layer 1: imports nothing of the package.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as torch_dist

ROOT = "strategy"
TOPICS = (
    "checkpoint",  # resume checkpoints: save, load, storage, retention
    "export",  # Hugging Face exports (save_model, the offline export)
    "train",  # the training loop and its trainers
    "eval",  # held-out evaluation
    "data",  # datasets: rows kept, truncated, skipped
    "parallel",  # sequence and tensor parallelism
    "ops",  # building DeepSpeed's compiled ops
)


def _rank() -> int:
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank()
    return int(os.environ.get("RANK", 0))


class RankZeroFilter(logging.Filter):
    """Keeps rank 0's records, and warnings or worse from every rank; notes the rank on each."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return record.rank == 0 or record.levelno >= logging.WARNING


class PrefixFormatter(logging.Formatter):
    """``[topic] message`` (``[topic rank r] message`` off rank 0); a bare message for
    ``print0``."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        topic = record.name[len(ROOT) + 1:]
        rank = getattr(record, "rank", 0)
        if topic:
            message = f"[{topic}{f' rank {rank}' if rank else ''}] {message}"
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        return message


class StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time (so redirections and test capture see
    it), flushing each record."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler's constructor sets it; stdout is read live
        pass


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, StdoutHandler) for h in root.handlers):
        handler = StdoutHandler()
        handler.addFilter(RankZeroFilter())
        handler.setFormatter(PrefixFormatter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


_ROOT_LOGGER = _configure()


def get_logger(topic: str) -> logging.Logger:
    """The logger whose records print as ``[topic] message`` on rank 0.

    Args:
        topic: one of ``TOPICS`` (its prefix).

    Returns:
        A standard ``logging.Logger`` (``strategy.<topic>``).

    Raises:
        ValueError: ``topic`` is not one of ``TOPICS``.
    """
    if topic not in TOPICS:
        raise ValueError(f"log topic {topic!r} is unknown: use one of {', '.join(TOPICS)}, or "
                         "add it to strategy.log.TOPICS")
    return logging.getLogger(f"{ROOT}.{topic}")


def print0(*args: object, sep: str = " ", end: str = "\n", flush: bool = True) -> None:
    """``print`` on rank 0 only, through the package's handler (no prefix).

    Args:
        *args: the values to print (each through ``str``).
        sep: put between the values.
        end: put after the last value (a trailing newline is the record's own).
        flush: accepted for ``print``'s sake; every record is flushed.
    """
    _ROOT_LOGGER.info(sep.join(str(a) for a in args) + end.removesuffix("\n"))
