"""Loading checkpoint and weight files without trusting them.

DeepSpeed's ``.pt`` files: every file is checked for being a complete archive first (so a damaged
file fails naming itself on every rank before any rank enters a collective), then loaded with
``weights_only=True`` and only DeepSpeed's own classes allowed (``load_torch_file``, optionally
memory-mapped, or DeepSpeed's own loads inside ``weights_only_loads``). Safetensors weights: every
shard the index names exists and every file is as long as its header says.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import re
import struct
import zipfile
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from strategy.errors import CheckpointFileError, CorruptWeightsError
from strategy.internals import deepspeed_checkpoint_globals, weights_only_torch_load


def verify_torch_files(ckpt_dir: str) -> None:
    """Every ``.pt`` under ``ckpt_dir`` must be a complete zip archive (what ``torch.save`` writes).
    Reads only each file's directory; every rank checks the same files and reaches the same
    verdict."""
    files = glob.glob(os.path.join(ckpt_dir, "**", "*.pt"), recursive=True)
    if not files:
        raise CheckpointFileError(f"{ckpt_dir}: no checkpoint files (*.pt); "
                                  "pick another tag or directory")
    for path in sorted(files):
        try:
            with zipfile.ZipFile(path) as archive:
                if not archive.namelist():
                    raise zipfile.BadZipFile("empty archive")
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointFileError(f"{path}: damaged or truncated checkpoint file ({exc}); "
                                      "restore it or load an earlier checkpoint") from None


def _refused(path: object, message: str) -> CheckpointFileError:
    """One line out of torch's many: the global it refused (``Unsupported global: GLOBAL x.y``)."""
    found = re.search(r"WeightsUnpickler error: (.+?)(?:\. Please|\n|$)", message)
    lines = message.strip().splitlines() or ["?"]
    reason = (found.group(1) if found else lines[0])[:200]
    return CheckpointFileError(f"{path}: refused to unpickle ({reason}); it holds objects beyond "
                               "tensors and DeepSpeed's state: use a checkpoint from a trusted "
                               "source")


def load_torch_file(path: str | os.PathLike, mmap: bool = False) -> Any:
    """One ``.pt`` file through ``torch.load(weights_only=True)``, on the CPU, with only DeepSpeed's
    own classes allowed; a refused file raises ``CheckpointFileError`` naming it. ``mmap=True`` maps
    the file instead of reading it: a tensor's bytes are read when first touched."""
    with torch.serialization.safe_globals(deepspeed_checkpoint_globals()):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise _refused(path, str(exc)) from None


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within the block, ``torch.load`` always runs with ``weights_only=True``."""
    with weights_only_torch_load(_refused):
        yield


def check_safetensors_dir(path: str) -> None:
    """Before loading an HF directory: every shard the index names exists, and every .safetensors
    file is as long as its header says (a truncated copy otherwise fails deep inside, or loads
    garbage lazily)."""
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if os.path.isfile(index):
        with open(index) as fh:
            needed = set(json.load(fh).get("weight_map", {}).values())
        missing = sorted(needed - set(files))
        if missing:
            raise CorruptWeightsError(f"{index} names missing shard(s) {missing}; "
                                      "re-export the model")
    for name in files:
        check_safetensors_file(os.path.join(path, name))


def _read_header(path: str, size: int) -> tuple[int, dict | None]:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CorruptWeightsError(f"{path}: truncated ({size} bytes, no safetensors header); "
                                      "re-export it")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return length, None
        try:
            return length, json.loads(fh.read(length))
        except ValueError:
            return length, None


def check_safetensors_file(path: str) -> None:
    size = os.path.getsize(path)
    length, header = _read_header(path, size)
    if header is None:
        raise CorruptWeightsError(f"{path}: corrupt safetensors header; "
                                  "re-export it or restore a copy")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size != 8 + length + end:
        raise CorruptWeightsError(f"{path}: {size} bytes but its header needs {8 + length + end} "
                                  "(truncated or padded copy); "
                                  "re-export it or restore a complete copy")
