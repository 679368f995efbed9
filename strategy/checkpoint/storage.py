"""Is the checkpoint directory one filesystem for every node (``shared``), or each node's own
disk (``node_local``)?

Shared: global rank 0 stages, publishes, writes ``latest`` and applies retention for all ranks.
Node-local: every node's local rank 0 does that for its own ranks' files (DeepSpeed's
``checkpoint.use_node_local_storage`` makes each node write its own copy of the model states),
and a resume picks the newest checkpoint complete on every node.

``find_storage`` tells them apart at start: global rank 0 writes a token into the directory and
every node looks for it. A setting can force either mode; a setting the directory contradicts is a
one-line error on every rank before training.
"""

from __future__ import annotations

import os
import time
import uuid

from strategy import dist
from strategy.checkpoint.config import STORAGE_MODES
from strategy.errors import fail

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
    directory allows; logged on rank 0. On one node the two are the same and the setting wins."""
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
        dist.print0(f"[checkpoint] {path}: shared by all {nodes} nodes; global rank 0 publishes")
    else:
        dist.print0(f"[checkpoint] {path}: node-local on each of {nodes} nodes; each node's "
                    "local rank 0 publishes its own ranks' files")
    return found


def deepspeed_section(mode: str) -> dict:
    """The DeepSpeed config that makes each node's local rank 0 write the model states too."""
    return {"checkpoint": {"use_node_local_storage": mode == "node_local"}}
