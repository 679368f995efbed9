"""``CheckpointConfig``: where resume checkpoints go and which of them are kept; ``Retention``: the
keep rules one save applies (the config's, unless a caller passes its own)."""

from __future__ import annotations

from dataclasses import dataclass

from strategy.config.fields import doc
from strategy.errors import fail

STORAGE_MODES = ("auto", "shared", "node_local")


@dataclass(frozen=True)
class CheckpointConfig:
    """Resume checkpoints and their retention; validated on construction. A checkpoint is deleted
    (oldest first) while more than ``max_ckpt_num`` or ``max_ckpt_mem`` GB remain, except the
    newest and the ``keep_best_ckpt`` best by ``best_metric``."""

    ckpt_path: str = doc("directory of resume checkpoints", "./outputs/ckpt")
    max_ckpt_num: int = doc("keep at most N resume checkpoints", 3)
    max_ckpt_mem: float = doc("keep at most this many GB of checkpoints (HF exports beside them "
                              "included)", 1000.0)
    keep_best_ckpt: int = doc("also keep the K checkpoints with the best eval metric (0: off)", 0)
    best_metric: str = doc("eval metric that ranks checkpoints for keep_best_ckpt, e.g. loss",
                           "loss")
    best_metric_higher: bool = doc("a higher best_metric is better (accuracy); "
                                   "default lower (loss)", False)
    checkpoint_storage: str = doc("auto: find out at start whether ckpt_path is shared by every "
                                  "node or each node's own disk; shared or node_local: insist",
                                  "auto")

    def __post_init__(self) -> None:
        validate_limits(self.max_ckpt_num, self.max_ckpt_mem, self.keep_best_ckpt,
                        ("max_ckpt_num", "max_ckpt_mem", "keep_best_ckpt"))
        if self.checkpoint_storage not in STORAGE_MODES:
            fail("checkpoint_storage", self.checkpoint_storage,
                 f"use one of {', '.join(STORAGE_MODES)}")
        if not self.best_metric:
            fail("best_metric", self.best_metric, "name an eval metric, e.g. loss or accuracy")


def validate_limits(max_num: int, max_mem: float, keep_best: int,
                    names: tuple[str, str, str] = ("max_num", "max_mem", "keep_best")) -> None:
    """Retention limits, named as the caller calls them."""
    if not isinstance(max_num, int) or max_num < 1:
        fail(names[0], max_num, "keep at least 1 checkpoint, e.g. 3")
    if max_mem <= 0:
        fail(names[1], max_mem, "use a positive size in GB, e.g. 1000")
    if not isinstance(keep_best, int) or keep_best < 0:
        fail(names[2], keep_best, "use 0 (off) or the number of best checkpoints to keep")


@dataclass(frozen=True)
class Retention:
    """Which checkpoints a save keeps; validated on construction. Oldest first, checkpoints (with
    their ``<tag>_hf`` exports) are deleted while more than ``max_num`` or ``max_mem`` GB remain,
    except the newest and the ``keep_best`` best by the metric each was saved with.

    Attributes:
        max_num: keep at most this many checkpoints (at least 1).
        max_mem: keep at most this many GB (HF exports beside them included).
        keep_best: also keep the K checkpoints with the best metric (0: off).
        higher_is_better: a higher metric is better (accuracy); default lower (loss).

    Raises:
        ConfigError: a limit is out of range.
    """

    max_num: int = 3  # keep at most this many checkpoints
    max_mem: float = 1000.0  # keep at most this many GB (HF exports beside them included)
    keep_best: int = 0  # also keep the K checkpoints with the best metric (0: off)
    higher_is_better: bool = False  # a higher metric is better (accuracy); default lower (loss)

    def __post_init__(self) -> None:
        validate_limits(self.max_num, self.max_mem, self.keep_best)

    @classmethod
    def from_config(cls, config: CheckpointConfig, max_num: int | None = None,
                    max_mem: float | None = None) -> Retention:
        """The rules ``config`` sets, with OpenRLHF's ``save_ckpt(..., max_num, max_mem)``
        limits in place of its count and size where given.

        Args:
            config: its ``max_ckpt_num``, ``max_ckpt_mem``, ``keep_best_ckpt`` and
                ``best_metric_higher`` become ``max_num``, ``max_mem``, ``keep_best`` and
                ``higher_is_better``.
            max_num: keep at most this many checkpoints instead of ``max_ckpt_num``.
            max_mem: keep at most this many GB instead of ``max_ckpt_mem`` (GiB, as OpenRLHF
                counts them: ``max_mem * 1024**3`` bytes).

        Returns:
            The ``Retention`` those settings describe.

        Raises:
            ConfigError: a limit is out of range.
        """
        return cls(config.max_ckpt_num if max_num is None else max_num,
                   config.max_ckpt_mem if max_mem is None else max_mem, config.keep_best_ckpt,
                   config.best_metric_higher)
