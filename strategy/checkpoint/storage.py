"""Is the checkpoint directory one filesystem for every node (``shared``), or each node's own
disk (``node_local``)?

Shared: global rank 0 stages, publishes, writes ``latest`` and applies retention for all ranks.
Node-local: every node's local rank 0 does that for its own ranks' files (DeepSpeed's
``checkpoint.use_node_local_storage`` makes each node write its own copy of the model states),
and a resume picks the newest checkpoint complete on every node.

``find_storage`` tells them apart at start: global rank 0 writes a token into the directory and
every node looks for it. A setting can force either mode; a setting the directory contradicts is a
one-line error on every rank before training. ``CheckpointStorage`` is the policy a run holds:
each directory's kind found once, and every directory of the run's kind.
"""

from __future__ import annotations

import os
import time
import uuid

from strategy import dist
from strategy.checkpoint.config import STORAGE_MODES, CheckpointConfig
from strategy.errors import fail
from strategy.log import get_logger

log = get_logger("checkpoint")

_LOOKS_S = (0.0, 0.5, 1.0, 2.0)  # a network filesystem may show a new file a moment late


def _write_token(path: str, name: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, name), "w") as fh:
        fh.write(name)


def _remove_token(path: str, name: str) -> None:
    try:
        os.remove(os.path.join(path, name))
    except FileNotFoundError:
        pass


def _sees(path: str, name: str) -> bool:
    try:
        os.listdir(path)  # refreshes a network filesystem's cached view of the directory
        return os.path.isfile(os.path.join(path, name))
    except OSError:
        return False


def nodes_seeing_token(path: str) -> list[bool]:
    """Collective: for each node, whether its local rank 0 sees a file global rank 0 just wrote
    into ``path``."""
    name = dist.broadcast_object(f".storage-token-{uuid.uuid4().hex}")
    dist.on_rank_0(_write_token, path, name)
    try:
        for wait in _LOOKS_S:
            time.sleep(wait)
            seen = dist.on_node_writers(_sees, path, name)
            if all(seen):
                break
    finally:
        dist.on_rank_0(_remove_token, path, name)
    return seen


def find_storage(path: str, setting: str = "auto", name: str = "checkpoint_storage") -> str:
    """Collective: ``"shared"`` or ``"node_local"`` for ``path``, as ``setting`` asks and the
    directory allows; logged on rank 0. On one node the two are the same and the setting wins.

    Args:
        path: the checkpoint directory.
        setting: ``"auto"``, ``"shared"`` or ``"node_local"``.
        name: the setting's name in error messages.

    Returns:
        ``"shared"`` or ``"node_local"``.

    Raises:
        ConfigError: ``setting`` is unknown, ``path`` is shared by only some nodes, or it is of
            another kind than ``setting`` insists on.
    """
    if setting not in STORAGE_MODES:
        fail(name, setting, f"use one of {', '.join(STORAGE_MODES)}")
    nodes = dist.get_num_nodes()
    if nodes == 1:  # nothing to tell apart, nothing to write
        return "shared" if setting == "auto" else setting
    seen = nodes_seeing_token(path)
    if 1 < sum(seen) < nodes:  # node-local publishers would race on the shared part
        fail(name, setting, f"{path} is shared by only {sum(seen)} of {nodes} nodes; give every "
             "node the same shared directory, or each its own disk")
    found = "shared" if all(seen) else "node_local"
    if setting not in ("auto", found):
        fail(name, setting, f"{path} is {found.replace('_', '-')} storage (global rank 0's file "
             f"was seen by {sum(seen)} of {nodes} nodes); set --{name} {found} or auto")
    if found == "shared":
        log.info("%s: shared by all %d nodes; global rank 0 publishes", path, nodes)
    else:
        log.info("%s: node-local on each of %d nodes; each node's local rank 0 publishes its own "
                 "ranks' files", path, nodes)
    return found


def deepspeed_section(mode: str) -> dict:
    """The DeepSpeed config that makes each node's local rank 0 write the model states too.

    Args:
        mode: ``"shared"`` or ``"node_local"``.

    Returns:
        ``{"checkpoint": {"use_node_local_storage": ...}}``, True for ``"node_local"``.
    """
    return {"checkpoint": {"use_node_local_storage": mode == "node_local"}}


class CheckpointStorage:
    """The storage kind of each checkpoint directory a run uses, found once per directory.

    ``ckpt_path`` is the directory DeepSpeed is configured for; any other directory a run saves to
    or loads from must be of the same kind.

    Args:
        config: the run's checkpoint settings (``ckpt_path``, ``checkpoint_storage``).
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self._found: dict[str, str] = {}  # absolute directory -> "shared" | "node_local"

    def kind(self, directory: str | None = None) -> str:
        """Collective (the first time per directory): ``"shared"`` or ``"node_local"`` for
        ``directory``; a directory of another kind than ``ckpt_path`` is refused.

        Args:
            directory: the checkpoint directory (default ``ckpt_path``).

        Returns:
            ``"shared"`` or ``"node_local"``.

        Raises:
            ConfigError: ``find_storage`` refuses it, or it is of another kind than
                ``ckpt_path``.
        """
        path = os.path.abspath(directory or self.config.ckpt_path)
        if path not in self._found:
            self._found[path] = find_storage(path, self.config.checkpoint_storage)
        main = self._found.get(os.path.abspath(self.config.ckpt_path))
        if main is not None and self._found[path] != main:
            fail("save_dir", directory, f"it is {self._found[path]} storage but ckpt_path "
                 f"{self.config.ckpt_path} is {main} (DeepSpeed is configured for that); "
                 "use a directory of the same kind")
        return self._found[path]

    def is_node_local(self, directory: str | None = None) -> bool:
        """Collective, as ``kind``.

        Args:
            directory: the checkpoint directory (default ``ckpt_path``).

        Returns:
            Whether its kind is ``"node_local"``.
        """
        return self.kind(directory) == "node_local"

    def deepspeed_section(self) -> dict:
        """DeepSpeed's ``checkpoint`` section for ``ckpt_path``'s kind, once any directory's
        kind is known (``setup_distributed`` finds it).

        Returns:
            The section (see ``deepspeed_section``), or ``{}`` before any kind is known.
        """
        return deepspeed_section(self.kind()) if self._found else {}
