"""Loading DeepSpeed's own ``.pt`` checkpoint files without unpickling arbitrary objects.

DeepSpeed calls ``torch.load(weights_only=False)``. While a checkpoint loads, ``torch.load`` runs
with ``weights_only=True`` and only the few DeepSpeed classes its files hold are allowed; and every
file is checked for being a complete archive first, so a damaged file fails naming itself on every
rank before any rank enters a collective.
"""

from __future__ import annotations

import glob
import os
import pickle
import zipfile
from contextlib import contextmanager
from typing import Iterator

import torch


class CheckpointFileError(RuntimeError):
    """A checkpoint file that is missing, damaged or holds objects we refuse to unpickle."""


def _deepspeed_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def verify_torch_files(ckpt_dir: str) -> None:
    """Every ``.pt`` under ``ckpt_dir`` must be a complete zip archive (what ``torch.save`` writes).
    Reads only each file's directory; every rank checks the same files and reaches the same verdict."""
    files = glob.glob(os.path.join(ckpt_dir, "**", "*.pt"), recursive=True)
    if not files:
        raise CheckpointFileError(f"{ckpt_dir}: no checkpoint files (*.pt); pick another tag or directory")
    for path in sorted(files):
        try:
            with zipfile.ZipFile(path) as archive:
                if not archive.namelist():
                    raise zipfile.BadZipFile("empty archive")
        except (zipfile.BadZipFile, OSError) as e:
            raise CheckpointFileError(f"{path}: damaged or truncated checkpoint file ({e}); restore it or load "
                                      f"an earlier checkpoint") from None


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within the block, ``torch.load`` always runs with ``weights_only=True``."""
    original, allowed = torch.load, _deepspeed_globals()

    def safe_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            try:
                return original(f, *args, **kwargs)
            except pickle.UnpicklingError as e:
                first = str(e).strip().splitlines()[0][:200]
                raise CheckpointFileError(f"{f}: refused to unpickle ({first}); it holds objects beyond "
                                          f"tensors and DeepSpeed's state") from None

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original
