"""torch's private members we read: each with why, pinned by ``tests/test_internals.py``
(checked on torch 2.13.0)."""

from __future__ import annotations

from typing import Any

import torch.distributed as torch_dist
from torch import nn


def norm_base_classes() -> tuple[type, ...]:
    """BatchNorm variants share the private base ``_NormBase``; there is no public one."""
    return (nn.modules.batchnorm._NormBase,)


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Buffers registered with ``persistent=False`` (left out of ``state_dict``): torch keeps their
    names only in ``_non_persistent_buffers_set``."""
    return set(module._non_persistent_buffers_set)


def default_store() -> Any:
    """The process group's key-value store, where a failing rank leaves its message for its peers
    (``_get_default_store`` is private); None when unavailable."""
    try:
        if not torch_dist.is_initialized():
            return None
        return torch_dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - best effort: the store may be gone with rank 0
        return None
