"""Build DeepSpeed's C++ ops ahead of a run, only those a job uses, in parallel:
``python -m strategy.ops [default|tests|all]``.

Otherwise they JIT-compile inside the first job that needs them (about a minute each on a CPU),
silently. Ops compiled into DeepSpeed's install (``.ci/ops_wheel``) are left as they are. Each
op builds in its own process (its own lock and build directory), up to ``--jobs`` at a time,
with a line when it starts and when it finishes.

- ``default``: what the main job uses (launched by torchrun): FusedAdam, its optimizer.
- ``tests``: also DeepSpeedCPUAdam (offload, HybridAdam), async_io (NVMe state files; only where
  Debian's libaio-dev is installed) and, on the CPU accelerator, the shared-memory allreduce that
  ``deepspeed.init_distributed`` builds under the deepspeed launcher.
- ``nvme``: async_io alone (``.ci/run`` builds the others with ``--skip AsyncIOBuilder``, then
  this one at the lowest priority beside the tests, before the NVMe tests load it).

On 2 cores one op's files already fill both (ninja compiles them in parallel), so ops build one
after another there (measured: 112 s for FusedAdam + shm_comm in turn, 129 s side by side);
with more cores, ``cores / 2`` ops at a time.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import installed_ops
from torch.utils.cpp_extension import get_default_build_root

from strategy.log import get_logger

DEFAULT = ("FusedAdamBuilder",)
TESTS = ("FusedAdamBuilder", "ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder")
SETS = {"default": DEFAULT, "tests": TESTS, "all": TESTS, "nvme": ("AsyncIOBuilder",)}
STALE_S = 60.0  # a live build's lock is younger, or has ninja working in its folder
log = get_logger("ops")
_BUILD_ONE = ("import sys; from deepspeed.accelerator import get_accelerator; "
              "get_accelerator().create_op_builder(sys.argv[1]).load(verbose=False)")


def buildable(names: tuple[str, ...]) -> list[str]:
    """The ops of ``names`` this machine can build (async_io needs libaio; shm_comm is CPU-only)."""
    out = []
    for name in names:
        if name == "ShareMemCommBuilder" and get_accelerator().device_name() != "cpu":
            continue
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            out.append(name)
    return out


def compiled_in(name: str) -> bool:
    """Whether DeepSpeed was installed with op ``name`` built (``DS_BUILD_*``: .ci/ops_wheel):
    it loads without a JIT build."""
    return bool(installed_ops.get(get_accelerator().create_op_builder(name).NAME))


def _build(name: str) -> tuple[str, float, str]:
    op = get_accelerator().create_op_builder(name).NAME
    start = time.monotonic()
    log.info("%s: started %s", op, time.strftime("%H:%M:%S"))
    # every op may use every core: one op's files compile while another's link or wait
    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 2)}
    proc = subprocess.run([sys.executable, "-c", _BUILD_ONE, name], env=env, capture_output=True,
                          text=True)
    seconds = time.monotonic() - start
    status = "finished" if proc.returncode == 0 else "FAILED"
    log.log(logging.INFO if proc.returncode == 0 else logging.WARNING, "%s: %s %s (%.0f s)", op,
            status, time.strftime("%H:%M:%S"), seconds)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] if proc.returncode else []
    return op, seconds, tail[0] if tail else ""


def stale_locks(ops: list[str], older_than: float = STALE_S) -> list[str]:
    """The build locks of ``ops`` (torch's, in each op's build folder) that no build holds: the
    lock is older than ``older_than`` seconds and no process works in its folder (ninja and the
    compilers run there). A build killed part way leaves its lock, and torch then waits on it
    forever, in this job and every later one on the machine."""
    own = os.environ.get("TORCH_EXTENSIONS_DIR")  # as torch finds an op's folder
    roots = [own] if own else glob.glob(os.path.join(glob.escape(get_default_build_root()), "*"))
    now = time.time()
    old = []
    for lock in (os.path.join(root, op, "lock") for root in roots for op in ops):
        try:
            if now - os.stat(lock).st_mtime > older_than:
                old.append(lock)
        except OSError:  # no build there, or it ended meanwhile
            continue
    if not old:
        return []
    busy = set()  # where processes work (ninja's folder), read only when a lock is old
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            busy.add(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [lock for lock in old if not any(
        cwd == os.path.dirname(lock) or cwd.startswith(os.path.dirname(lock) + os.sep)
        for cwd in busy)]


def remove_stale_locks(ops: list[str]) -> None:
    """Remove ``stale_locks(ops)``, a line each."""
    for lock in stale_locks(ops):
        log.warning("removed %s: a build killed part way left it (no process builds there)", lock)
        os.unlink(lock)


def build_ops(which: str = "tests", jobs: int = 1,
              skip: tuple[str, ...] = ()) -> list[tuple[str, float, str]]:
    """Build the ``which`` set but ``skip``'s builders, ``jobs`` ops at a time; (op, seconds,
    error or "") per op. A lock a killed build left is removed first (``stale_locks``)."""
    names = []
    for name in buildable(tuple(name for name in SETS[which] if name not in skip)):
        if compiled_in(name):
            log.info("%s: compiled into DeepSpeed's install",
                     get_accelerator().create_op_builder(name).NAME)
        else:
            names.append(name)
    remove_stale_locks([get_accelerator().create_op_builder(name).NAME for name in names])
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(_build, names))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m strategy.ops",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("which", nargs="?", default="tests", choices=sorted(SETS))
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="ops built at the same time (default: cores / 2)")
    parser.add_argument("--skip", action="append", default=[], choices=TESTS,
                        help="a builder of the set not to build now (repeatable)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    results = build_ops(args.which, args.jobs, tuple(args.skip))
    failed = [f"{op}: {error}" for op, _, error in results if error]
    log.info("%s: %d of %d ops ready in %.0f s", args.which, len(results) - len(failed),
             len(results), time.monotonic() - start)
    if failed:
        raise SystemExit("[ops] failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
