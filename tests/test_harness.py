"""The test harness itself: under ``CI=true`` a skip for a missing capability fails (GPU-marked
tests stay skipped), and a hung test fails alone at its timeout (pytest-timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
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


def _pytest(path: Path, ci: bool) -> str:
    """pytest on ``path`` with this suite's conftest, a 3 s timeout and ``CI`` set or not."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, "-m", "pytest", str(path), "-q", "-rA",
                           "-p", "tests.conftest", "--rootdir", str(path.parent), "-c",
                           os.devnull, "--timeout", "3", "-W", "ignore"],
                          capture_output=True, text=True, cwd=path.parent, env=env, timeout=120)
    return proc.stdout + proc.stderr


def test_ci_turns_capability_skips_into_failures_and_hangs_time_out(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    ci = _pytest(probe, ci=True)
    assert "FAILED test_probe.py::test_needs_root - skipped under CI=true" in ci, ci
    assert "FAILED test_probe.py::test_hangs - Failed: Timeout" in ci, ci
    assert "FAILED test_probe.py::test_on_gpu" not in ci, ci  # GPU-marked: still skipped
    assert "2 failed, 1 passed, 1 skipped" in ci, ci
