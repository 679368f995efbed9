"""What lives under a checkpoint directory, and reading it.

``save_dir/<tag>/`` is one checkpoint; a complete one holds ``strategy_state.json`` (written last).
``save_dir/<tag>_hf/`` is an HF export of that checkpoint; other directories with a ``config.json``
or ``adapter_config.json`` are HF exports on their own. ``save_dir/latest`` names the newest tag;
``save_dir/.incomplete/`` holds saves in progress and directories being deleted. ``RunLayout`` is
the run's shape a checkpoint records (and a resume checks).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

META = "strategy_state.json"  # written last into a checkpoint: its presence marks it complete
STAGING = ".incomplete"
HF_SUFFIX = "_hf"
LATEST = "latest"
UNIVERSAL = "universal"  # <tag>/universal: DeepSpeed's universal conversion, made on first use


@dataclass(frozen=True)
class RunLayout:
    """What a checkpoint records of the run's shape, for its resume to check and count.

    Attributes:
        sequence_parallel_size: a checkpoint resumes at the size it was saved at.
        tensor_parallel_size: likewise.
        samples_per_step: the global batch (None: DeepSpeed's own sample count).
    """

    sequence_parallel_size: int = 1  # a checkpoint resumes at the size it was saved at
    tensor_parallel_size: int = 1  # likewise
    samples_per_step: int | None = None  # the global batch (None: DeepSpeed's own sample count)

    def recorded(self) -> dict:
        """The keys written into ``strategy_state.json`` (the sizes a resume checks).

        Returns:
            ``sequence_parallel_size`` and ``tensor_parallel_size`` by name.
        """
        return {"sequence_parallel_size": self.sequence_parallel_size,
                "tensor_parallel_size": self.tensor_parallel_size}

    def mismatch(self, meta: dict) -> tuple[str, int, int] | None:
        """The first recorded size ``meta`` was saved at that differs from this run's.

        Args:
            meta: a checkpoint's ``strategy_state.json`` (a size it does not record was 1).

        Returns:
            ``(name, saved, now)`` of that size, or None when every size matches.
        """
        for name, now in self.recorded().items():
            saved = meta.get(name, 1)
            if saved != now:
                return name, saved, now
        return None


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
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
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
    return any(os.path.isfile(os.path.join(path, name))
               for name in ("config.json", "adapter_config.json"))


def _subdirs(save_dir: str) -> list[str]:
    names = sorted(name for name in os.listdir(save_dir) if not name.startswith("."))
    return [name for name in names if os.path.isdir(os.path.join(save_dir, name))
            and not os.path.islink(os.path.join(save_dir, name))]


def scan(save_dir: str) -> list[Entry]:
    """Every complete checkpoint (with its ``<tag>_hf`` export) and every other HF export under
    ``save_dir``, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    dirs = _subdirs(save_dir)
    entries: dict[str, Entry] = {}
    for name in dirs:
        path = os.path.join(save_dir, name)
        meta = read_meta(path)
        if meta is not None:
            saved_at = float(meta.get("saved_at", os.path.getmtime(path)))
            entries[name] = Entry(name, saved_at, dir_size(path), [path], True, meta.get("metric"))
    for name in dirs:
        path = os.path.join(save_dir, name)
        owner = name[: -len(HF_SUFFIX)] if name.endswith(HF_SUFFIX) else None
        if owner in entries:
            entries[owner].paths.append(path)
            entries[owner].size += dir_size(path)
        elif name not in entries and (owner is not None or _is_hf_export(path)):
            entries[name] = Entry(name, os.path.getmtime(path), dir_size(path), [path], False)
    return sorted(entries.values(), key=lambda e: e.order)


def complete_tags(save_dir: str) -> list[str]:
    """Tags of the complete checkpoints under ``save_dir``, oldest first."""
    return [e.name for e in scan(save_dir) if e.is_ckpt]
