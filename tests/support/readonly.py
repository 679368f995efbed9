"""A read-only view of a directory for one rank: a private mount namespace in which the directory
is bind-mounted read-only, so any write from that rank fails with EROFS, from Python or from native
code (safetensors, tokenizers). Needs root, as the tmpfs disk-full tests do. The rank's main thread
stays in that namespace (a multi-threaded process cannot go back), so a test module using it must
discard its rank pool afterwards (``ranks.discard()``): later mounts on the host would not reach
it."""

from __future__ import annotations

import ctypes
import os
import subprocess
from contextlib import contextmanager
from typing import Iterator

import pytest

CLONE_NEWNS = 0x00020000
_state = {"unshared": False}


def _private_mounts() -> None:
    """Move this thread (the rank's main thread, where saves run) into its own mount namespace
    that still receives the host's later mounts (slave) but never sends its own back."""
    if _state["unshared"]:
        return
    if os.geteuid() != 0:
        pytest.skip("a read-only view needs root (mount namespaces)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        pytest.skip(f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}")
    subprocess.run(["mount", "--make-rslave", "/"], check=True)
    _state["unshared"] = True


@contextmanager
def read_only_view(path: str) -> Iterator[None]:
    """Within the block, ``path`` is read-only for this process (and only for it)."""
    _private_mounts()
    subprocess.run(["mount", "--bind", path, path], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", path], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", path], check=True)


@contextmanager
def own_view(disk: str, path: str) -> Iterator[None]:
    """Within the block, this process (and only it) sees ``disk`` at ``path``: a node's own disk
    mounted where every node's is (node-local storage, one rank per node)."""
    _private_mounts()
    subprocess.run(["mount", "--bind", disk, path], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", path], check=True)
