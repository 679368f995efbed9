"""Which checkpoints (and the HF exports beside them) to delete: a pure policy over ``scan``'s
entries, and the rank-0 step that applies it (deletions go through ``atomic_fs.remove_dir``)."""

from __future__ import annotations

import os

from strategy.atomic_fs import remove_dir
from strategy.checkpoint.config import Retention
from strategy.checkpoint.layout import STAGING, Entry, scan

GIB = 1024**3


def select_for_deletion(entries: list[Entry], max_num: int, max_bytes: float, keep_best: int = 0,
                        higher_is_better: bool = False) -> list[Entry]:
    """Oldest first, drop entries until at most ``max_num`` checkpoints and ``max_bytes`` remain.

    The newest checkpoint (the one a resume picks) and the ``keep_best`` checkpoints with the best
    ``metric`` are never dropped, even when that leaves the limits exceeded."""
    ckpts = [e for e in entries if e.is_ckpt]
    protected = {max(ckpts, key=lambda e: e.order).name} if ckpts else set()
    ranked = sorted((e for e in ckpts if e.metric is not None), key=lambda e: e.metric,
                    reverse=higher_is_better)
    protected |= {e.name for e in ranked[:keep_best]}
    num, size = len(ckpts), sum(e.size for e in entries)
    doomed = []
    for entry in sorted(entries, key=lambda e: e.order):
        if num <= max_num and size <= max_bytes:
            break
        if entry.name in protected or (not entry.is_ckpt and size <= max_bytes):
            continue
        doomed.append(entry)
        num -= entry.is_ckpt
        size -= entry.size
    return doomed


def apply_retention(save_dir: str, retention: Retention) -> list[str]:
    """Delete what :func:`select_for_deletion` picks; returns the deleted names. Rank 0 only."""
    doomed = select_for_deletion(scan(save_dir), retention.max_num, retention.max_mem * GIB,
                                 retention.keep_best, retention.higher_is_better)
    for entry in doomed:
        for path in entry.paths:
            remove_dir(path, os.path.join(save_dir, STAGING))
    return [e.name for e in doomed]
