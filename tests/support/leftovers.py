"""What a test session leaves behind on the machine: /dev/shm entries it made, processes it
started (found by a variable every child inherits, so orphans count too), files in its own
temp root and entries in the user's datasets cache (``datasets`` caches every JSON file it
reads there: the session points it into its temp root). ``conftest.py`` fails the session when
any is left, names each, then removes it so the next run starts clean.

Under pytest-xdist (``-n 2``) each worker is a session of its own inside the controller's: its
marker extends the controller's and its temp root sits in the controller's. A worker checks
its own processes and temp root; /dev/shm and the datasets cache are the machine's, shared by
the workers, so the controller checks them once every worker has ended (``conftest.py``), each
entry still named with the test that made it (the workers hand their ``seen`` over in a file)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time

SESSION_VAR = "STRATEGY_TEST_SESSION"
ROOT_VAR = "STRATEGY_TEST_ROOT"  # the session's temp root, for its xdist workers
SEEN = "seen-{}.json"  # a worker's ``seen``, handed to the controller in its temp root
SHM = "/dev/shm"
DATASETS_CACHE = "hf_datasets"  # the session's datasets cache, in its temp root


def _datasets_home() -> str:
    """Where ``datasets`` caches by default (``HF_HOME``, else ``XDG_CACHE_HOME``)."""
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(os.environ.get("HF_HOME", os.path.join(cache, "huggingface")),
                        "datasets")


def _cached(home: str) -> set[str]:
    """The datasets cache's entries two levels deep (a builder's folder, a lock)."""
    out = set()
    for top in os.listdir(home) if os.path.isdir(home) else []:
        out.add(top)
        if os.path.isdir(os.path.join(home, top)):
            out.update(f"{top}/{name}" for name in os.listdir(os.path.join(home, top)))
    return out


def _mapped_here(path: str) -> bool:
    """Whether this process maps ``path``'s file. Matched by inode: glibc creates a named
    semaphore under a temporary name, maps it, links it to its name and unlinks the temporary,
    so the creator's map shows ``sem.XXXXXX (deleted)``, never ``sem.mp-...``."""
    try:
        inode = os.stat(path).st_ino
    except OSError:
        return False
    with open("/proc/self/maps") as f:
        return any(SHM + "/" in line and int(line.split()[4]) == inode for line in f)


class Leftovers:
    """A session's marker and temp root, set up in this process's environment, and what it had
    in /dev/shm before it started."""

    def __init__(self) -> None:
        self.worker = None  # an xdist worker's id ("gw0"), set by conftest's pytest_configure
        self.parent_root = os.environ.get(ROOT_VAR)  # a session this one runs inside of
        inside = f"{os.environ[SESSION_VAR]}/" if SESSION_VAR in os.environ else ""
        self.marker = f"{inside}{os.getpid()}-{time.time_ns()}"
        os.environ[SESSION_VAR] = self.marker  # inherited by every process the tests start
        self.root = tempfile.mkdtemp(prefix="strategy-tests-")
        os.environ["TMPDIR"] = os.environ[ROOT_VAR] = self.root
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        self.datasets_home = _datasets_home()
        self.datasets_before = _cached(self.datasets_home)
        os.environ["HF_DATASETS_CACHE"] = os.path.join(self.root, DATASETS_CACHE)
        self.shm_before = set(os.listdir(SHM)) if os.path.isdir(SHM) else set()
        self.test = "(between tests)"  # the test running now, set by conftest's hook
        self.seen: dict[str, str] = {}  # each /dev/shm entry made since, and during which test
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self, every: float = 0.5) -> None:
        """Notes which test was running when each /dev/shm entry first appeared, so what is
        left at the end names the test that made it (the session only sees it at its end)."""
        while os.path.isdir(SHM):
            for name in set(os.listdir(SHM)) - self.shm_before:
                self.seen.setdefault(name, self.test)
            time.sleep(every)

    def processes(self) -> list[tuple[int, str]]:
        """Live processes of this session (and of its xdist workers' sessions) other than this
        one: (pid, command line)."""
        needle = f"{SESSION_VAR}={self.marker}".encode()
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if not any(x == needle or x.startswith(needle + b"/")
                               for x in f.read().split(b"\0")):
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{pid}/stat") as f:
                    state, parent = f.read().rsplit(")", 1)[1].split()[:2]
                if state == "Z":
                    continue  # a zombie holds nothing; its parent reaps it
                if int(parent) == os.getpid() and "multiprocessing.resource_tracker" in command:
                    continue  # this process's own tracker: it ends with it, freeing its queues
            except OSError:  # ended meanwhile, or not ours to read
                continue
            found.append((int(pid), command[:200]))
        return found

    def shm(self) -> list[str]:
        """/dev/shm entries made since the session started, but those this process still maps
        (its own queues' semaphores, freed at its exit)."""
        now = set(os.listdir(SHM)) if os.path.isdir(SHM) else set()
        return sorted(n for n in now - self.shm_before if not _mapped_here(os.path.join(SHM, n)))

    def temp(self) -> list[str]:
        """What is left in the session's temp root, pytest's own folders, torch's compile cache
        and the datasets cache (kept on purpose, as in ~/.cache, until the root goes) aside."""
        return sorted(n for n in os.listdir(self.root)
                      if not n.startswith(("pytest-of-", "torchinductor_", DATASETS_CACHE)))

    def datasets(self) -> list[str]:
        """Entries the session added to the user's datasets cache (a process that did not get
        the session's ``HF_DATASETS_CACHE``)."""
        return sorted(_cached(self.datasets_home) - self.datasets_before)

    def machine_wide(self) -> bool:
        """Whether this session checks what the machine shares (/dev/shm, the datasets cache):
        a session of its own, or an xdist controller; not one of its workers."""
        return self.worker is None

    def report(self, grace: float = 15.0, settle: bool = False) -> str:
        """What is left (after ``grace`` seconds for processes just ending and, with ``settle``,
        for /dev/shm entries that processes ending remove: an xdist controller's workers' own
        queues), one kind a line; '' when nothing. An xdist worker hands its ``seen`` to the
        controller instead of checking the machine's entries."""
        deadline = time.monotonic() + grace
        while (self.processes() or settle and self.shm()) and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        if not self.machine_wide():
            with open(os.path.join(self.parent_root, SEEN.format(self.worker)), "w") as f:
                json.dump(self.seen, f)
        shm = self.shm() if self.machine_wide() else []
        datasets = self.datasets() if self.machine_wide() else []
        seen, lines = self._workers_seen(), []
        for what, items in (("processes", self.processes()), ("/dev/shm entries", shm),
                            (f"temp files in {self.root}", self.temp()),
                            (f"entries in {self.datasets_home}", datasets)):
            if items:
                lines.append(f"{what}: {items}")
        for name in shm:
            lines.append(f"  {name} first seen during {seen.get(name, 'the last test')}")
        return "\n".join(lines)

    def _workers_seen(self) -> dict[str, str]:
        """``seen`` merged with what the xdist workers handed over (their files removed): the
        test a worker ran names an entry before anything the controller noted."""
        seen, (head, tail) = dict(self.seen), SEEN.split("{}")
        for name in os.listdir(self.root):
            if name.startswith(head) and name.endswith(tail):
                path = os.path.join(self.root, name)
                with open(path) as f:
                    theirs = json.load(f)
                os.unlink(path)
                for entry, test in theirs.items():
                    if "::" not in seen.get(entry, ""):  # the test a worker ran names it
                        seen[entry] = test
        return seen

    def clear(self) -> None:
        """Removes what is left, so the next run starts clean."""
        for pid, _ in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for name in self.shm() if self.machine_wide() else []:
            try:
                os.unlink(os.path.join(SHM, name))
            except OSError:
                pass
        for name in self.datasets() if self.machine_wide() else []:
            path = os.path.join(self.datasets_home, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(self.root, ignore_errors=True)
