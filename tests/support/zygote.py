"""``python -m MODULE ARGS`` started as a fork of a warm process: the imports a driver pays
before its first line of work (torch, transformers, Ray, the package: ~5 s of one core, on the
critical path of every Ray job a test starts) are paid once, by the zygote, and every job after
is a fork of it.

``Zygote(preload)`` starts ``python -m tests.support.zygote MODULE...`` (it imports them, then
takes requests on its stdin: one JSON line each, answered on its stdout with the child's pid, and
later with its exit status). ``zygote.start(module, argv, env=..., cwd=...)`` (``script=PATH``
for ``python PATH``; ``ranks=N``: N such ranks, as torchrun starts them) returns a
``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``, ``send_signal``, ``communicate``,
``returncode``); ``zygote.run(...)`` waits as ``helpers.run_job`` does. The child leads a session
of its own (``helpers.kill_group`` kills it and what it started), has exactly the environment,
working directory and ``sys.argv`` it was given, ``sys.path[0]`` at its working directory, and
ends as the interpreter would: an uncaught exception through ``sys.excepthook``, then the
``atexit`` functions, then its exit status. The zygote ends when its stdin closes (``close()``, or
the test process gone), so nothing outlives the tests.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tests.support.forked import end_child, exit_status


class Child:
    """A forked ``python -m``: as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, zygote: "Zygote", pid: int, out: str, err: str, argv: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, argv
        self._out, self._err = out, err
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if not self.zygote.alive():
                raise RuntimeError(f"the zygote died before child {self.pid} ended")
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out = []
        for path in (self._out, self._err):
            with open(path, errors="replace") as f:
                out.append(f.read())
        return out[0], out[1]

    def close(self) -> None:
        """Its output files removed (they are in the session's temp root)."""
        for path in (self._out, self._err):
            if os.path.exists(path):
                os.unlink(path)


class Zygote:
    def __init__(self, preload: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, env=env)
        self.exits: dict[int, int] = {}
        self._started: list[int] = []
        self._ready = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:  # a line an import printed: not an answer
                continue
            if not isinstance(answer, dict):
                continue
            if "exit" in answer:
                self.exits[answer["pid"]] = answer["exit"]
            elif "pid" in answer:
                self._started.append(answer["pid"])
                self._ready.set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, module: str | None, argv: list[str], env: dict, cwd: str | None = None,
              script: str | None = None, ranks: int = 0) -> Child:
        """``python -m MODULE ARGV`` (or ``python SCRIPT ARGV``) forked; ``ranks=N``: a
        launcher of N such ranks at one node, with torchrun's environment (a free port of its
        own)."""
        from strategy.dist import free_port

        out = tempfile.mkstemp(prefix="zygote-out-")
        err = tempfile.mkstemp(prefix="zygote-err-")
        for fd, _ in (out, err):
            os.close(fd)
        request = {"module": module, "script": script, "argv": [str(a) for a in argv],
                   "env": dict(env), "cwd": str(cwd or os.getcwd()), "out": out[1],
                   "err": err[1], "ranks": ranks, "port": free_port() if ranks else None}
        with self._lock:
            self._ready.clear()
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            if not self._ready.wait(60):
                raise RuntimeError("the zygote did not fork within 60 s")
            pid = self._started.pop()
        return Child(self, pid, out[1], err[1], [module or script, *argv])

    def run(self, module: str | None, argv: list[str], timeout: float, env: dict,
            cwd: str | None = None, script: str | None = None,
            ranks: int = 0) -> subprocess.CompletedProcess:
        """``start`` and wait, as ``helpers.run_job``: on ``timeout`` the child's session is
        killed and the test fails with the output's tail."""
        from tests.support.helpers import kill_group

        child = self.start(module, argv, env, cwd, script, ranks)
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(child)
            out, err = child.communicate(timeout=30)
            raise AssertionError(f"{child.args[0]} still running after {timeout} s (killed with "
                                 f"its process group):\n{(out + err)[-3000:]}") from None
        finally:
            kill_group(child)  # a driver that returned may leave processes behind
            child.close()
        return subprocess.CompletedProcess(child.args, child.returncode, out, err)

    def close(self) -> None:
        """The zygote ends (its stdin closed), within 30 s, else killed."""
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------ the zygote's side
def _child(request: dict) -> None:
    """In the forked child: become ``python -m MODULE ARGV`` (or, with ``ranks``, a launcher of
    that many ranks of ``python SCRIPT ARGV``) and never return."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if request["ranks"]:
        os._exit(_launch(request))
    _become(request)


def _launch(request: dict) -> int:
    """As torchrun at one node: ``ranks`` forks, each a rank (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the first to fail has the others stopped
    (SIGTERM, SIGKILL 30 s later) and its exit status is the launcher's."""
    n, pids = request["ranks"], []
    for rank in range(n):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(request["port"])}
        pid = os.fork()
        if pid == 0:
            os.environ.update(env)
            _become(request)
        pids.append(pid)
    code, stop_at = 0, None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            pids.remove(pid)
            exit_code = os.waitstatus_to_exitcode(status)
            if exit_code and not code:
                code = exit_code if exit_code > 0 else 128 - exit_code
                stop_at = time.monotonic() + 30
                for other in pids:
                    os.kill(other, signal.SIGTERM)
        elif stop_at is not None and time.monotonic() > stop_at:
            for other in pids:
                os.kill(other, signal.SIGKILL)
        else:
            time.sleep(0.05)
    return code


def _become(request: dict) -> None:
    """``python -m MODULE ARGV`` or ``python SCRIPT ARGV`` in this process; never returns."""
    code = 1
    try:
        target = request["module"] or request["script"]
        # what `python -m` (the working directory) or `python SCRIPT` (its folder) puts first
        sys.path[0] = request["cwd"] if request["module"] else os.path.dirname(
            os.path.abspath(target))
        sys.argv = [target, *request["argv"]]
        try:
            if request["module"]:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = exit_status(stop)
        except BaseException:  # noqa: BLE001 - as the interpreter reports it
            sys.excepthook(*sys.exc_info())
        atexit._run_exitfuncs()
    finally:
        end_child(code)


def _serve(preload: list[str]) -> None:
    for name in preload:
        __import__(name)
    children: set[int] = set()
    answer = sys.stdout
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.1)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            children.discard(pid)
            answer.write(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})
                         + "\n")
            answer.flush()
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:  # the tests' end
            return
        answer.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _child(json.loads(line))
            finally:  # never back into the zygote's loop
                os._exit(1)
        children.add(pid)
        answer.write(json.dumps({"pid": pid}) + "\n")
        answer.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
