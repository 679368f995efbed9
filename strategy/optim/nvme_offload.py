"""Optimizer-state files for ``HybridAdam(nvme_offload_fraction=...)``.

A chosen share of the CPU parameters (by element count) keeps its Adam moments in files between
steps: read back (one parameter ahead, on an I/O thread) before the parameter's update, written out
and freed after it. DeepSpeed's ``async_io`` op does the I/O when it builds (Debian's libaio-dev)
and the directory accepts O_DIRECT; otherwise plain file reads and writes do.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

import torch
from deepspeed.ops.op_builder import AsyncIOBuilder

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def plan_offload(params: Iterable[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """Parameters, in order, whose states go to files: each taken while the running element count
    stays within ``fraction`` x the total (a parameter that would overshoot is skipped)."""
    params = list(params)
    budget = int(fraction * sum(p.numel() for p in params))
    chosen, used = [], 0
    for p in params:
        if used + p.numel() <= budget:
            chosen.append(p)
            used += p.numel()
    return chosen


def _load_aio():
    """DeepSpeed's async I/O op, or None when it cannot build here (no libaio)."""
    try:
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None
        return builder.load(verbose=False)
    except Exception:  # noqa: BLE001 - any build or load failure means: use plain files
        return None


class StateFiles:
    """One file per (parameter, moment) under a private directory, removed by ``close()``."""

    def __init__(self, directory: str | None, use_aio: bool = True) -> None:
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="hybrid_adam_", dir=directory)
        self.align = 1
        self.handle = self._aio_handle() if use_aio else None
        self.keys: dict[torch.Tensor, str] = {}
        # one I/O thread: reads and writes run in submission order, so a read never passes a write
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid_adam_io")
        self._writes: list[Future] = []

    def _aio_handle(self):
        aio = _load_aio()
        if aio is None:
            return None
        handle = aio.aio_handle(1024 * 1024, 32, False, False, 1)
        probe, path = torch.arange(1024, dtype=torch.float32), os.path.join(self.dir, "probe.bin")
        # some file systems (tmpfs, some overlays) refuse O_DIRECT; a short file would abort a read
        try:
            handle.sync_pwrite(probe, path)
            back = torch.empty_like(probe)
            ok = os.path.getsize(path) == probe.nbytes and handle.sync_pread(back, path) >= 0
            ok = ok and torch.equal(probe, back)
        except Exception:  # noqa: BLE001
            ok = False
        finally:
            if os.path.exists(path):
                os.unlink(path)
        self.align = handle.get_alignment() if ok else 1
        return handle if ok else None

    def padded_numel(self, param: torch.Tensor, dtype: torch.dtype) -> int:
        """Elements in a state file: O_DIRECT moves whole aligned blocks, so async_io files are
        padded."""
        per_block = max(1, self.align // torch.empty(0, dtype=dtype).element_size())
        return -(-param.numel() // per_block) * per_block

    @property
    def backend(self) -> str:
        return "async_io" if self.handle is not None else "file"

    def add(self, param: torch.Tensor) -> None:
        self.keys[param] = f"p{len(self.keys)}"

    def __contains__(self, param: torch.Tensor) -> bool:
        return param in self.keys

    def path(self, param: torch.Tensor, key: str) -> str:
        return os.path.join(self.dir, f"{self.keys[param]}.{key}.bin")

    def write(self, param: torch.Tensor, state: dict) -> None:
        """Write the moments of ``param`` to its files and drop them from ``state``."""
        for key in STATE_KEYS:
            tensor, path = state.pop(key), self.path(param, key)
            if self.handle is not None:
                self.handle.sync_pwrite(self._padded_buffer(param, tensor), path)
            else:
                with open(path, "wb") as fh:
                    fh.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def _padded_buffer(self, param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """The whole padded storage behind ``tensor`` (read() allocates it so), else a padded
        copy."""
        numel = self.padded_numel(param, tensor.dtype)
        storage = tensor.untyped_storage()
        nbytes = numel * tensor.element_size()
        if tensor.is_contiguous() and tensor.storage_offset() == 0 and storage.nbytes() == nbytes:
            return torch.empty(0, dtype=tensor.dtype).set_(storage, 0, (numel,))
        buf = torch.zeros(numel, dtype=tensor.dtype)
        buf[:tensor.numel()].copy_(tensor.reshape(-1))
        return buf

    def read(self, param: torch.Tensor, state: dict, dtype: torch.dtype) -> None:
        """Put the moments of ``param`` back into ``state`` from its files."""
        for key in STATE_KEYS:
            path = self.path(param, key)
            if self.handle is not None:
                buf = torch.empty(self.padded_numel(param, dtype), dtype=dtype)
                self.handle.sync_pread(buf, path)
                tensor = buf[:param.numel()].view(param.shape)
            else:
                tensor = torch.empty(param.shape, dtype=dtype)
                with open(path, "rb") as fh:
                    fh.readinto(tensor.reshape(-1).view(torch.uint8).numpy())
            state[key] = tensor

    def read_async(self, param: torch.Tensor, dtype: torch.dtype) -> Future:
        """Read the moments of ``param`` on the I/O thread; the future gives ``{key: tensor}``."""
        def work() -> dict:
            out: dict = {}
            self.read(param, out, dtype)
            return out

        return self._io.submit(work)

    def write_async(self, param: torch.Tensor, state: dict) -> None:
        """Take the moments out of ``state`` now and write them on the I/O thread (see
        ``drain``)."""
        moments = {key: state.pop(key) for key in STATE_KEYS}
        self._writes.append(self._io.submit(self.write, param, moments))

    def drain(self) -> None:
        """Wait for every pending write (and raise its error, if any)."""
        writes, self._writes = self._writes, []
        for future in writes:
            future.result()

    def close(self) -> None:
        self._io.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)
