"""Every RNG a training step may draw from (Python, NumPy, torch CPU, accelerator), saved per rank
as safetensors (tensors plus string metadata) so loading never unpickles."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from safetensors import safe_open
from safetensors.torch import save_file


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Python, NumPy, torch CPU and accelerator RNG states as tensors plus string metadata."""
    version, py_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"python": torch.tensor(py_state, dtype=torch.int64),
               "numpy": torch.from_numpy(keys.astype(np.int64)), "torch_cpu": torch.get_rng_state()}
    if get_accelerator().device_name() != "cpu":
        tensors["accelerator"] = get_accelerator().get_rng_state().cpu()
    meta = {"python": json.dumps([version, gauss]),
            "numpy": json.dumps([name, pos, has_gauss, cached])}
    return tensors, meta


def save_rng(rng: tuple[dict, dict], ckpt_dir: str, rank: int) -> None:
    save_file(rng[0], os.path.join(ckpt_dir, f"rng_state_{rank}.safetensors"), metadata=rng[1])


def restore_rng(ckpt_dir: str, rank: int) -> bool:
    """Restore this rank's RNG states; False when the checkpoint has none for this rank."""
    path = os.path.join(ckpt_dir, f"rng_state_{rank}.safetensors")
    if not os.path.isfile(path):
        return False
    with safe_open(path, "pt") as fh:
        meta, saved = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    version, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(saved["python"].tolist()), gauss))
    name, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, saved["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(saved["torch_cpu"])
    if "accelerator" in saved and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(saved["accelerator"])
    return True
