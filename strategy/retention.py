"""Which checkpoints (and the HF exports beside them) to delete, and deleting them safely.

Layout under ``save_dir``: one directory per checkpoint tag (complete ones hold ``strategy_state.json``),
an HF export of a checkpoint at ``<tag>_hf``, other HF exports (a ``config.json`` or
``adapter_config.json`` inside) counted on their own, and the hidden ``.incomplete`` staging area.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

META = "strategy_state.json"  # written last into a checkpoint: its presence marks the checkpoint complete
STAGING = ".incomplete"  # saves in progress and directories being deleted live here
HF_SUFFIX = "_hf"  # an HF export of checkpoint <tag> lives at <save_dir>/<tag>_hf
GIB = 1024**3


@dataclass
class Entry:
    """One deletable unit: a checkpoint with its HF export, or an HF export on its own."""

    name: str  # checkpoint tag or export directory name
    order: float  # save time; larger is newer
    size: int = 0  # bytes of every path together
    paths: list[str] = field(default_factory=list)
    is_ckpt: bool = True
    metric: float | None = None  # the value best-K retention ranks by (None: not ranked)


def dir_size(path: str) -> int:
    """Bytes of the regular files under ``path`` (links are not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


def read_meta(ckpt_dir: str) -> dict | None:
    """The checkpoint's state file, or None if the directory is not a complete checkpoint."""
    try:
        with open(os.path.join(ckpt_dir, META)) as fh:
            return json.load(fh)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _is_hf_export(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json"))


def scan(save_dir: str) -> list[Entry]:
    """Every complete checkpoint (with its ``<tag>_hf`` export) and every other HF export under ``save_dir``."""
    if not os.path.isdir(save_dir):
        return []
    names = sorted(n for n in os.listdir(save_dir) if not n.startswith("."))
    dirs = [n for n in names if os.path.isdir(os.path.join(save_dir, n))
            and not os.path.islink(os.path.join(save_dir, n))]
    entries: dict[str, Entry] = {}
    for name in dirs:
        path = os.path.join(save_dir, name)
        meta = read_meta(path)
        if meta is not None:
            entries[name] = Entry(name, float(meta.get("saved_at", os.path.getmtime(path))), dir_size(path), [path],
                                  True, meta.get("metric"))
    for name in dirs:
        path = os.path.join(save_dir, name)
        owner = name[: -len(HF_SUFFIX)] if name.endswith(HF_SUFFIX) else None
        if owner in entries:
            entries[owner].paths.append(path)
            entries[owner].size += dir_size(path)
        elif name not in entries and (owner is not None or _is_hf_export(path)):
            entries[name] = Entry(name, os.path.getmtime(path), dir_size(path), [path], False)
    return sorted(entries.values(), key=lambda e: e.order)


def select_for_deletion(entries: list[Entry], max_num: int, max_bytes: float, keep_best: int = 0,
                        higher_is_better: bool = False) -> list[Entry]:
    """Oldest first, drop entries until at most ``max_num`` checkpoints and ``max_bytes`` remain.

    The newest checkpoint (the one a resume picks) and the ``keep_best`` checkpoints with the best
    ``metric`` are never dropped, even when that leaves the limits exceeded."""
    ckpts = [e for e in entries if e.is_ckpt]
    protected = {max(ckpts, key=lambda e: e.order).name} if ckpts else set()
    ranked = sorted((e for e in ckpts if e.metric is not None), key=lambda e: e.metric, reverse=higher_is_better)
    protected |= {e.name for e in ranked[:keep_best]}
    num, size = len(ckpts), sum(e.size for e in entries)
    out = []
    for e in sorted(entries, key=lambda e: e.order):
        if num <= max_num and size <= max_bytes:
            break
        if e.name in protected or (not e.is_ckpt and size <= max_bytes):
            continue
        out.append(e)
        num -= e.is_ckpt
        size -= e.size
    return out


def remove_dir(path: str, save_dir: str) -> None:
    """Move ``path`` into the staging area first (atomic), so a crash never leaves half a checkpoint."""
    staging = os.path.join(save_dir, STAGING)
    os.makedirs(staging, exist_ok=True)
    trash = os.path.join(staging, f"deleting-{os.path.basename(path)}-{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def apply_retention(save_dir: str, max_num: int, max_mem_gb: float, keep_best: int = 0,
                    higher_is_better: bool = False) -> list[str]:
    """Delete what :func:`select_for_deletion` picks; returns the deleted names. Rank 0 only."""
    doomed = select_for_deletion(scan(save_dir), max_num, max_mem_gb * GIB, keep_best, higher_is_better)
    for e in doomed:
        for path in e.paths:
            remove_dir(path, save_dir)
    return [e.name for e in doomed]


def validate_limits(max_num: int, max_mem: float, keep_best: int) -> None:
    from strategy.config import fail

    if not isinstance(max_num, int) or max_num < 1:
        fail("max_num", max_num, "keep at least 1 checkpoint, e.g. max_num=3")
    if max_mem <= 0:
        fail("max_mem", max_mem, "use a positive size in GB, e.g. max_mem=1000")
    if not isinstance(keep_best, int) or keep_best < 0:
        fail("keep_best", keep_best, "use 0 (off) or the number of best checkpoints to keep")
