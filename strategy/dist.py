"""Rank helpers over torch.distributed, device-agnostic through DeepSpeed's accelerator."""

from __future__ import annotations

import builtins
import os
import random
import socket
import sys
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_rank_0() -> bool:
    return get_rank() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only."""
    if is_rank_0():
        builtins.print(*args, **kwargs, flush=True)


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_launch_env() -> None:
    """Fill the rendezvous variables a launcher would set, for a plain ``python script.py`` run."""
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


def backend_name() -> str:
    name = get_accelerator().communication_backend_name()
    return "gloo" if name == "ccl" and get_accelerator().device_name() == "cpu" and not _has_ccl() else name


def _has_ccl() -> bool:
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def init_distributed(timeout: timedelta) -> None:
    """Start the process group once (idempotent), then drop this rank's /dev/shm buffer."""
    import deepspeed

    ensure_launch_env()
    if not get_accelerator().device_name() == "cpu":
        get_accelerator().set_device(get_local_rank())
    if not is_initialized():
        deepspeed.init_distributed(dist_backend=backend_name(), timeout=timeout)
    remove_shm_buffer()
    install_failure_hook()


def install_failure_hook() -> None:
    """On an uncaught exception: say which rank failed (and which peer failed first, when a
    collective broke because of it), then exit at once instead of hanging in teardown, so the
    launcher stops the other ranks."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        previous(exc_type, exc, tb)
        rank, world = get_rank(), get_world_size()
        first = _failed_peers(rank, world)
        _mark_failed(rank, f"{exc_type.__name__}: {exc}"[:300])
        cause = f"; rank {first[0]} failed first ({first[1]})" if first else ""
        sys.stderr.write(f"[strategy] rank {rank} of {world} failed: {exc_type.__name__}: "
                         f"{str(exc)[:300]}{cause}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    if getattr(sys.excepthook, "__name__", "") != "hook":
        sys.excepthook = hook


def _store():
    try:
        return dist.distributed_c10d._get_default_store() if is_initialized() else None
    except Exception:  # noqa: BLE001 - best effort: the store may be gone with rank 0
        return None


def _mark_failed(rank: int, message: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(f"strategy_failed/{rank}", message)
        except Exception:  # noqa: BLE001
            pass


def _failed_peers(rank: int, world: int) -> tuple[int, str] | None:
    store = _store()
    for peer in range(world):
        if store is None or peer == rank:
            continue
        try:
            if store.check([f"strategy_failed/{peer}"]):
                return peer, store.get(f"strategy_failed/{peer}").decode()
        except Exception:  # noqa: BLE001
            return None
    return None


def shm_buffer_path(rank: int | None = None) -> str:
    """The file DeepSpeed's CPU shared-memory allreduce creates for a rank (and never removes)."""
    rank = get_rank() if rank is None else rank
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def remove_shm_buffer() -> None:
    """Unlink this rank's buffer once every rank has mapped all buffers (mappings stay valid)."""
    path = shm_buffer_path()
    if not os.path.exists(path):
        return
    barrier()  # init returns only after a rank mapped every peer; the barrier makes that global
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _to_tensor(x: Any) -> torch.Tensor:
    device = get_accelerator().current_device_name()
    if isinstance(x, torch.Tensor):
        return x.detach().to(device)
    return torch.tensor(x, dtype=torch.float64 if get_accelerator().device_name() == "cpu"
                        else torch.float32, device=device)


def all_reduce(data: Any, op: str = "mean") -> Any:
    """Reduce a tensor, a number, or a (nested) dict of them across ranks: mean, sum, max or min."""
    if op not in _OPS:
        raise ValueError(f"op={op!r} is invalid: use one of {sorted(_OPS)}")
    if isinstance(data, dict):
        return _all_reduce_dict(data, op)
    t = _to_tensor(data)
    t = t.clone() if isinstance(data, torch.Tensor) else t
    if is_initialized():
        dist.all_reduce(t, op=_OPS[op])
    if op == "mean":
        t = t / get_world_size()
    if isinstance(data, torch.Tensor):
        return t.to(device=data.device, dtype=data.dtype if data.is_floating_point() else t.dtype)
    return t.item()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (small objects: messages, decisions)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def first_error(error: str | None) -> tuple[int, str] | None:
    """Collective: the lowest rank whose ``error`` is not None, with its message; None when all are."""
    errors = [error]
    if is_initialized():
        errors = [None] * get_world_size()
        dist.all_gather_object(errors, error)
    return next(((r, e) for r, e in enumerate(errors) if e is not None), None)


def _flatten(data: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    for key, value in data.items():
        out += _flatten(value, prefix + (key,)) if isinstance(value, dict) else [(prefix + (key,), value)]
    return out


def _all_reduce_dict(data: dict, op: str) -> dict:
    """Numbers in a nested dict travel in one collective; tensors each in their own."""
    leaves = _flatten(data)
    numbers = [(path, v) for path, v in leaves if not isinstance(v, torch.Tensor)]
    reduced = dict(zip([p for p, _ in numbers], all_reduce(torch.tensor([float(v) for _, v in numbers],
                                                                        dtype=torch.float64), op).tolist()))
    reduced.update({path: all_reduce(v, op) for path, v in leaves if isinstance(v, torch.Tensor)})
    out: dict = {}
    for path, _ in leaves:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = reduced[path]
    return out


def all_gather(data: Any) -> Any:
    """Gather a tensor, number or dict of them from every rank: tensors concatenate on dim 0
    after each is made 1-d or more, numbers become a list in rank order."""
    if isinstance(data, dict):
        return {k: all_gather(v) for k, v in data.items()}
    t = _to_tensor(data)
    t = t.reshape(1) if t.dim() == 0 else t
    parts = [torch.empty_like(t) for _ in range(get_world_size())]
    if is_initialized():
        dist.all_gather(parts, t)
    else:
        parts = [t]
    if isinstance(data, torch.Tensor):
        return torch.cat(parts).to(data.device)
    return [p.item() for p in parts]
