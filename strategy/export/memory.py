"""Handing memory back to the OS while an export streams, so its peak stays near one tensor.

- ``trim_heap``: glibc keeps freed blocks under its (adaptive, up to 32 MB) mmap threshold on the
  heap, so without a trim after each tensor group the resident size creeps up group by group.
- ``MappedPages``: a file that ``torch.load(mmap=True)`` mapped counts in the resident size page by
  page as it is read, up to the whole file. ``release(tensor)`` drops the pages under a tensor read
  from such a file (``madvise(MADV_DONTNEED)``); touched again, they are read again from the file.
  It only ever acts inside the tracked files' mappings: on anonymous memory the same call would
  zero the data.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import torch

_MADV_DONTNEED = 4  # Linux <sys/mman.h>


def _libc_function(name: str, argtypes: list | None = None):
    try:
        function = getattr(ctypes.CDLL("libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):  # not glibc: nothing is handed back, results are the same
        return None
    if argtypes is not None:
        function.argtypes = argtypes
    return function


_malloc_trim = _libc_function("malloc_trim", [ctypes.c_size_t])
_madvise = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def trim_heap() -> None:
    """Return the heap's freed memory to the OS (a no-op without glibc)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def file_mappings(path: str | Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps ``path`` (from ``/proc/self/maps``)."""
    real = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].rstrip("\n") == real:
                    low, high = fields[0].split("-")
                    ranges.append((int(low, 16), int(high, 16)))
    except OSError:  # no procfs: nothing is tracked, so nothing is released
        pass
    return ranges


class MappedPages:
    """The mappings of the files ``track`` was given; ``release`` drops pages inside them only.

    The owner keeps the loaded objects (hence the mappings) alive for as long as it calls
    ``release``, and calls ``clear`` before letting them go."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def track(self, path: str | Path) -> None:
        self.ranges += file_mappings(path)

    def clear(self) -> None:
        self.ranges = []

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the whole pages holding ``tensor``'s bytes, if they lie in a tracked mapping."""
        if _madvise is None or tensor.numel() == 0:
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for low, high in self.ranges:
            if low <= start and end <= high:
                first = start - start % mmap.PAGESIZE
                last = min(high, end + (-end) % mmap.PAGESIZE)
                _madvise(first, last - first, _MADV_DONTNEED)
                return
