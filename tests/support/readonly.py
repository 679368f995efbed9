"""A read-only view of a directory for one rank: a private mount namespace in which the directory
is bind-mounted read-only, so any write from that rank fails with EROFS, from Python or from native
code (safetensors, tokenizers). Needs root, as the tmpfs disk-full tests do. Only the rank's main
thread (where saves run) moves into that namespace, and only for the block: on leaving it goes
back to the host's (``setns``), so the long-lived ranks serve later tests as they were."""

from __future__ import annotations

import ctypes
import os
import subprocess
from contextlib import contextmanager
from typing import Iterator

import pytest

CLONE_NEWNS, CLONE_FS = 0x00020000, 0x00000200
_state: dict = {"unshared": False, "host": None, "cwd": None}


def _private_mounts() -> None:
    """Move this thread (the rank's main thread, where saves run) into its own mount namespace
    that still receives the host's later mounts (slave) but never sends its own back."""
    if _state["unshared"]:
        return
    if os.geteuid() != 0:
        pytest.skip("a read-only view needs root (mount namespaces)")
    libc = ctypes.CDLL(None, use_errno=True)
    host = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY)
    if libc.unshare(CLONE_NEWNS) != 0:
        os.close(host)
        pytest.skip(f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}")
    subprocess.run(["mount", "--make-rslave", "/"], check=True)
    _state.update(unshared=True, host=host, cwd=os.getcwd())


def _leave_private_mounts() -> None:
    """Back to the host's mount namespace (a no-op where this process never left it); entering a
    mount namespace resets the working directory, which is restored."""
    if not _state["unshared"]:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    # threads started since share this thread's filesystem context, which setns refuses (EINVAL)
    if libc.unshare(CLONE_FS) != 0 or libc.setns(_state["host"], CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "setns back to the host's mount namespace failed")
    os.close(_state["host"])
    os.chdir(_state["cwd"])
    _state.update(unshared=False, host=None, cwd=None)


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
        _leave_private_mounts()


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
        _leave_private_mounts()
