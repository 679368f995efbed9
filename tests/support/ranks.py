"""Run a test body in N real ranks (spawned processes, 127.0.0.1 rendezvous).

The ranks stay up between tests (start-up costs ~6 s of imports per process), and each test
sends them a module-level function. A rank's exception or ``pytest.skip`` comes back to pytest;
a hang fails after a timeout and the ranks are replaced; a test that leaves a DeepSpeed
shared-memory buffer in /dev/shm fails.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable

import pytest

from strategy.dist import free_port

GRACE_S = 20  # how long the other ranks get to finish after one rank failed


def _worker(rank: int, env: dict, tasks: mp.Queue, results: mp.Queue) -> None:
    # a spawned child inherits "spawn" as its default start method, under which a lock made
    # with the default context (tqdm's, one per process) is a named semaphore unlinked only at a
    # clean exit: a rank killed at close left it in /dev/shm. A launcher's rank has "fork", which
    # unlinks it at once: so do these
    mp.set_start_method("fork", force=True)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except pytest.skip.Exception as e:
            results.put((rank, "skip", str(e)))
        except BaseException:  # noqa: BLE001 - everything goes back to pytest
            results.put((rank, "error", traceback.format_exc()))
        finally:
            _reset_globals()


def _reset_globals() -> None:
    """Undo process-wide state a test may leave (transformers' ZeRO-3 construction hook)."""
    import gc

    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    except ImportError:
        pass
    gc.collect()
    # what survives a full collection (modules, classes, caches) is frozen out of later ones: a
    # full collection over every imported module took ~0.3 s per test
    gc.freeze()


def shm_buffers(port: int | str = "*") -> list[str]:
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")


class RankPool:
    """``world_size`` long-lived ranks that run test bodies on request."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.port = free_port()
        ctx = mp.get_context("spawn")
        env = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, env, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 300, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        for q in self.tasks:
            q.put((fn, args, kwargs))
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            if any(kind == "error" for kind, _ in got.values()):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            try:
                rank, kind, value = self.results.get(timeout=1)
                got[rank] = (kind, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
                for r in dead:
                    got[r] = ("error", f"rank {r} died with exit code {self.procs[r].exitcode}")
                if time.monotonic() > deadline:
                    break
        missing = [r for r in range(self.world_size) if r not in got]
        if missing or any(kind == "error" for kind, _ in got.values()):
            self.close()  # a failed rank may leave its peers inside a collective
        return self._collect(got, missing, timeout)

    def _collect(self, got: dict, missing: list[int], timeout: float) -> list:
        errors = [f"--- rank {r} ---\n{v}" for r, (k, v) in sorted(got.items()) if k == "error"]
        if missing:
            errors.append(f"rank(s) {missing} did not finish within {timeout:.0f}s (hang?)")
        if errors:
            pytest.fail("\n".join(errors), pytrace=False)
        leftover = shm_buffers(self.port)
        if leftover:
            pytest.fail(f"shared-memory buffers left in /dev/shm: {leftover}", pytrace=False)
        skips = [v for k, v in got.values() if k == "skip"]
        if skips:
            pytest.skip(skips[0])
        return [got[r][1] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for path in shm_buffers(self.port):  # a killed rank cannot clean up after itself
            os.unlink(path)


class Ranks:
    """Session-wide access to pools by world size, recreated after a failure."""

    def __init__(self) -> None:
        self.pools: dict[int, RankPool] = {}

    def run(
        self, fn: Callable, *args: Any, world_size: int = 2, timeout: float = 300, **kwargs: Any
    ) -> list:
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self.pools[world_size] = RankPool(world_size)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        """Every pool ended, and their queues' semaphores unlinked now (collected), not at some
        later collection: the session's leftovers check comes next."""
        import gc

        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        gc.collect()
