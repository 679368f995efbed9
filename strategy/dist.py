"""Ranks and collectives over torch.distributed, device-agnostic through DeepSpeed's accelerator.

Also the two rules every multi-rank write follows: ``on_rank_0`` (rank 0 acts; every rank gets its
result or raises its error, so no rank waits in a later collective for a rank that failed; and
``on_node_writers``, the same for each node's local rank 0 on node-local storage) and
``raise_if_any_failed`` (each rank may have failed; every rank raises the same one-line error).
And the failure hook: ``setup_distributed`` installs it so an uncaught exception names its rank
and exits at once (the launcher then stops the others), ``close()`` removes it.
"""

from __future__ import annotations

import gc
import os
import random
import socket
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator

import deepspeed
import numpy as np
import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator

from strategy.errors import ConfigError, RankFailedError, StrategyError
from strategy.internals import default_store, shm_allreduce_buffer_path
from strategy.internals.vllm import engine_holds_world
from strategy.log import print0  # noqa: F401 - ``print`` on rank 0 only, re-exported

_OPS = {"sum": torch_dist.ReduceOp.SUM, "mean": torch_dist.ReduceOp.SUM,
        "max": torch_dist.ReduceOp.MAX, "min": torch_dist.ReduceOp.MIN}


def is_initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_rank() -> int:
    return torch_dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size() -> int:
    return torch_dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_local_world_size() -> int:
    """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, the deepspeed launcher's
    ``LOCAL_SIZE``, else one node holds them all."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return get_world_size()


def get_num_nodes() -> int:
    return max(get_world_size() // get_local_world_size(), 1)


def get_node_rank() -> int:
    """Both launchers give a node contiguous ranks: node ``k`` holds ranks ``k * local`` on."""
    return get_rank() // get_local_world_size()


def is_rank_0() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_initialized():
        torch_dist.barrier()


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()  # two threads asking at once get two ports


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself (Linux's ``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(v) for v in fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free TCP port for a rendezvous, below the kernel's ephemeral range: the kernel never
    numbers a socket there by itself (binding port 0 and closing it gave a port that gloo's own
    connections could take before the launcher bound it), each process starts at its own offset,
    and one process is never given the same port twice, from any of its threads."""
    with _PORTS_LOCK:
        return _free_port()


def _free_port() -> int:
    low, _ = _ephemeral_range()
    first, count = 10000, max(low - 10000, 0)
    start = os.getpid() * 7919 % count if count else 0
    for step in range(count):
        port = first + (start + step) % count
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as sock:  # no such range here: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------ start-up


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables ``ensure_launch_env`` may fill in this process's environment."""


def from_slurm() -> None:
    """Under ``srun`` (``deepspeed --launcher slurm`` starts the script once per task, with no
    rank variables of its own) the ranks come from Slurm's task variables."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return
    if "MASTER_ADDR" not in env:
        raise ConfigError("MASTER_ADDR=None is invalid: under srun export MASTER_ADDR (the first "
                          "node's address) and MASTER_PORT before launching")
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_STEP_TASKS_PER_NODE", "1")
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"],
               LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
               LOCAL_SIZE=per_node.split("(")[0].split(",")[0])
    env.setdefault("MASTER_PORT", "29500")


def ensure_launch_env() -> None:
    """Fill the rendezvous variables a launcher would set: from Slurm's under ``srun``, or for a
    plain ``python script.py`` run."""
    from_slurm()
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
    """The accelerator's backend; gloo on CPU unless Intel's oneCCL bindings are installed."""
    name = get_accelerator().communication_backend_name()
    on_cpu = get_accelerator().device_name() == "cpu"
    return "gloo" if name == "ccl" and on_cpu and not _has_ccl() else name


def _has_ccl() -> bool:
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401 - optional: only its presence matters
    except ImportError:
        return False
    return True


def init_distributed(timeout: timedelta) -> None:
    """Start the process group once (idempotent), then drop this rank's /dev/shm buffer."""
    ensure_launch_env()
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(get_local_rank())
    if not is_initialized():
        deepspeed.init_distributed(dist_backend=backend_name(), timeout=timeout)
    remove_shm_buffer()


def end_process_group() -> None:
    """End this process's group while the interpreter still runs, as PyTorch asks of a script:
    left to the interpreter's teardown, gloo's threads now and then abort a rank that had finished
    ("terminate called without an active exception", exit -6). A vLLM engine still alive in this
    process (``external_launcher``) joined the group: its own shutdown ends it."""
    if torch_dist.is_available() and torch_dist.is_initialized() and not engine_holds_world():
        torch_dist.destroy_process_group()


def run_script(main: Callable[[], Any]) -> None:
    """A launched rank's whole life: ``main()``, what it left collected (an engine in this
    process ends there, through vLLM's own shutdown), then the process group ended."""
    main()
    gc.collect()
    end_process_group()


def remove_shm_buffer() -> None:
    """DeepSpeed's CPU shared-memory allreduce leaves one ~69 MB file per rank in /dev/shm; unlink
    ours once every rank has mapped all buffers (mappings stay valid)."""
    path = shm_allreduce_buffer_path(get_rank())
    if not os.path.exists(path):
        return
    barrier()  # init returns only after a rank mapped every peer; the barrier makes that global
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------ failure hook


def _failure_hook(exc_type, exc, tb) -> None:
    """Say which rank failed (and which peer failed first, when a collective broke because of
    it), then exit at once instead of hanging in teardown, so the launcher stops the others. Our
    own errors (``StrategyError``: a bad setting, file or row) are that one line, without a
    traceback; anything else shows its traceback first."""
    if not issubclass(exc_type, StrategyError):
        _previous_hook(exc_type, exc, tb)
    rank, world = get_rank(), get_world_size()
    first = _failed_peer(rank, world)
    _mark_failed(rank, f"{exc_type.__name__}: {exc}"[:300])
    cause = f"; rank {first[0]} failed first ({first[1]})" if first else ""
    sys.stderr.write(f"[strategy] rank {rank} of {world} failed: {exc_type.__name__}: "
                     f"{str(exc)[:300]}{cause}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


_previous_hook: Callable = sys.excepthook


def install_failure_hook() -> None:
    """Chain ``_failure_hook`` in front of the current ``sys.excepthook`` (once)."""
    global _previous_hook
    if sys.excepthook is not _failure_hook:
        _previous_hook, sys.excepthook = sys.excepthook, _failure_hook


def install_one_line_errors() -> None:
    """Before any process group: an uncaught ``StrategyError`` (a bad setting, file or row) is
    one line on stderr and exit status 2, without a traceback; other errors are untouched. (Once
    ranks run, ``install_failure_hook`` does this and names the rank.)"""
    if getattr(sys.excepthook, "strategy_one_line", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        if not issubclass(exc_type, StrategyError):
            return previous(exc_type, exc, tb)
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(2)

    hook.strategy_one_line = True
    sys.excepthook = hook


def remove_failure_hook() -> None:
    """Put back the ``sys.excepthook`` that was there before ``install_failure_hook``."""
    if sys.excepthook is _failure_hook:
        sys.excepthook = _previous_hook


def _mark_failed(rank: int, message: str) -> None:
    store = default_store()
    if store is not None:
        try:
            store.set(f"strategy_failed/{rank}", message)
        except Exception:  # noqa: BLE001 - best effort while failing
            pass


def _failed_peer(rank: int, world: int) -> tuple[int, str] | None:
    store = default_store()
    if store is None:
        return None
    for peer in range(world):
        if peer == rank:
            continue
        try:
            if store.check([f"strategy_failed/{peer}"]):
                return peer, store.get(f"strategy_failed/{peer}").decode()
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            return None
    return None


# ------------------------------------------------------------ every rank agrees


_THREAD = threading.local()  # .group: this thread's world-wide group (``collectives_on``)


@contextmanager
def collectives_on(group: Any) -> Iterator[None]:
    """This thread's collectives of this module's (``checked``, ``all_reduce``,
    ``all_gather_object``, ``broadcast_object``...) over ``group``, a process group of every
    rank, instead of the default one: a thread working beside the main one (episodes played
    ahead) keeps its collectives apart from the main thread's, which may run at the same time."""
    before = getattr(_THREAD, "group", None)
    _THREAD.group = group
    try:
        yield
    finally:
        _THREAD.group = before


def _group(group: Any = None) -> Any:
    """``group``, else this thread's (``collectives_on``), else None: the default group."""
    return group if group is not None else getattr(_THREAD, "group", None)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (small objects: messages, decisions)."""
    if not is_initialized():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src, group=_group())
    return box[0]


def all_gather_object(obj: Any) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    if not is_initialized():
        return [obj]
    out = [None] * get_world_size()
    torch_dist.all_gather_object(out, obj, group=_group())
    return out


def _rebuild(error: BaseException) -> BaseException:
    """A fresh exception of the same type and message, to raise on a rank that did not fail."""
    try:
        return type(error)(*error.args)
    except Exception:  # noqa: BLE001 - a type that cannot be rebuilt from its args
        return RankFailedError(str(error))


def on_rank_0(fn: Callable, *args: Any) -> Any:
    """Collective: run ``fn(*args)`` on rank 0 only; every rank returns its result, or raises its
    error, so a failure on rank 0 never leaves the other ranks waiting in a later collective."""
    value, error = None, None
    if is_rank_0():
        try:
            value = fn(*args)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    value, shared = broadcast_object((value, error))
    if shared is not None:
        raise error if error is not None else _rebuild(shared)
    return value


def on_node_writers(fn: Callable, *args: Any) -> list:
    """Collective: run ``fn(*args)`` on every node's local rank 0 (storage each node has its own
    of); every rank returns the list of their results in node order, or raises the first error."""
    value, error = None, None
    if get_local_rank() == 0:
        try:
            value = fn(*args)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    local = get_local_world_size()
    gathered = all_gather_object((value, error))[::local]
    failed = [shared for _, shared in gathered if shared is not None]
    if failed:
        raise error if error is not None else _rebuild(failed[0])
    return [value for value, _ in gathered]


def first_error(error: str | None) -> tuple[int, str] | None:
    """Collective: the lowest rank whose ``error`` is not None, with its message; None when all
    are."""
    failed = [(rank, e) for rank, e in enumerate(all_gather_object(error)) if e is not None]
    return failed[0] if failed else None


def raise_if_any_failed(error: BaseException | None, make: Callable[[int, str], BaseException],
                        detail: str = "") -> None:
    """Collective: when some rank passes an error, every rank raises ``make(rank, message)`` for the
    lowest such rank, the message (its error's first line, plus ``detail``) made on that rank."""
    described = None if error is None else f"{type(error).__name__}: {first_line(error)}{detail}"
    failed = first_error(described)
    if failed is not None:
        raise make(*failed) from error


def checked(fn: Callable, *args: Any,
            make: Callable[[int, str], BaseException] | None = None) -> Any:
    """Collective: every rank runs ``fn(*args)``; an error on any rank is raised on all of them
    (the lowest failing rank's, as one line naming it), so none waits in a later collective.
    ``make(rank, message)`` builds that error (default: ``RankFailedError("rank N: ...")``)."""
    value, error = None, None
    try:
        value = fn(*args)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    raise_if_any_failed(error, make or (lambda rank, message: RankFailedError(
        f"rank {rank}: {message}")))
    return value


def first_line(error: BaseException) -> str:
    """An error's message as one line (its first, at most 300 characters)."""
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""


# ------------------------------------------------------------ reductions


def _to_tensor(value: Any) -> torch.Tensor:
    device = get_accelerator().current_device_name()
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    on_cpu = get_accelerator().device_name() == "cpu"
    return torch.tensor(value, dtype=torch.float64 if on_cpu else torch.float32, device=device)


def all_reduce(data: Any, op: str = "mean", group: Any = None) -> Any:
    """Reduce a tensor, a number, or a (nested) dict of them across ranks (or a process
    ``group``'s): mean, sum, max or min."""
    if op not in _OPS:
        raise ValueError(f"op={op!r} is invalid: use one of {sorted(_OPS)}")
    group = _group(group)
    if isinstance(data, dict):
        return _all_reduce_dict(data, op, group)
    tensor = _to_tensor(data)
    tensor = tensor.clone() if isinstance(data, torch.Tensor) else tensor
    if is_initialized():
        torch_dist.all_reduce(tensor, op=_OPS[op], group=group)
    if op == "mean":
        tensor = tensor / (get_world_size() if group is None else torch_dist.get_world_size(group))
    if isinstance(data, torch.Tensor):
        dtype = data.dtype if data.is_floating_point() else tensor.dtype
        return tensor.to(device=data.device, dtype=dtype)
    return tensor.item()


def _flatten(data: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _flatten(value, prefix + (key,))
        else:
            out.append((prefix + (key,), value))
    return out


def _all_reduce_dict(data: dict, op: str, group: Any = None) -> dict:
    """Numbers in a nested dict travel in one collective; tensors each in their own."""
    leaves = _flatten(data)
    numbers = [(path, v) for path, v in leaves if not isinstance(v, torch.Tensor)]
    packed = torch.tensor([float(v) for _, v in numbers], dtype=torch.float64)
    reduced = dict(zip([path for path, _ in numbers], all_reduce(packed, op, group).tolist()))
    reduced.update({path: all_reduce(v, op, group) for path, v in leaves
                    if isinstance(v, torch.Tensor)})
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
    tensor = _to_tensor(data)
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    parts = [tensor]
    if is_initialized():
        parts = [torch.empty_like(tensor) for _ in range(get_world_size())]
        torch_dist.all_gather(parts, tensor, group=_group())
    if isinstance(data, torch.Tensor):
        return torch.cat(parts).to(data.device)
    return [part.item() for part in parts]


class RankFlag(int):
    """``is_rank_0`` read both ways: as a flag (``if strategy.is_rank_0:``) and called, as
    OpenRLHF does (``strategy.is_rank_0()``); either way it is this rank's answer."""

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))
