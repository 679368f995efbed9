"""Run a test's child process as a fork of the pytest process: the imports (torch, DeepSpeed,
transformers: ~6 s per interpreter) are already paid, the kill is as real as a subprocess's.

``forked(fn, *args, env=...)`` returns a handle with ``pid`` (the child leads its own session, so
``kill_group`` kills it and anything it started), ``lines`` (a queue of its stdout and stderr
lines, ``None`` at the end, read by a thread so a silent child cannot block a deadline) and
``wait(timeout)``, which returns the exit status as ``subprocess`` reports it (``-9`` for SIGKILL).
Only for children that need no process group of the parent's (the parent must have none).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable


class Forked:
    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid, self.returncode = pid, None
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._pump, args=(read_fd,), daemon=True)
        self._reader.start()

    def _pump(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as stream:
            for line in stream:
                self.output.append(line)
                self.lines.put(line)
        self.lines.put(None)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            time.sleep(0.05)
        self._reader.join(timeout=5)
        return self.returncode

    def text(self) -> str:
        return "".join(self.output)


def exit_status(stop: SystemExit) -> int:
    """The status an interpreter ends with on ``stop``: its code, 0 for none, else 1 with the
    message printed to stderr."""
    if isinstance(stop.code, int):
        return stop.code
    if stop.code is None:
        return 0
    print(stop.code, file=sys.stderr)
    return 1


def end_child(code: int) -> None:
    """A forked child's end: its buffered output flushed, then ``os._exit(code)`` (never the
    parent's cleanup: its ``atexit`` functions and finalizers are the parent's to run)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def forked(fn: Callable, *args: Any, env: dict | None = None) -> Forked:
    """``fn(*args)`` in a forked child with ``env`` added to its environment; exit status 0 when it
    returns, 1 on an exception (traceback in its output), the code of a ``SystemExit``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("forked() needs a parent without a process group")
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setsid()
            os.close(read_fd)
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            os.environ.update(env or {})
            fn(*args)
            code = 0
        except SystemExit as e:
            code = exit_status(e)
        except BaseException:  # noqa: BLE001 - reported through the output, like an interpreter
            traceback.print_exc()
        finally:
            end_child(code)
    os.close(write_fd)
    return Forked(pid, read_fd)


def run_forked(fn: Callable, *args: Any, timeout: float, env: dict | None = None) -> Forked:
    """``forked`` and wait for it; on ``timeout`` its process group is killed and the test fails
    with the output's tail."""
    from tests.support.helpers import kill_group

    child = forked(fn, *args, env=env)
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(child)
        child.wait()
        raise AssertionError(f"forked {fn.__name__} still running after {timeout} s (killed):\n"
                             f"{child.text()[-3000:]}") from None
    finally:
        kill_group(child)
    return child
