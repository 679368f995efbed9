"""What the benchmark scripts that write results files share: one row per figure (figure, value,
range, rounds, date, commit, machine, command) and the commit measured. A figure the docs state
is rendered from these rows, and tests/test_benchmark_figures.py checks each page against its
file."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess


def row(figure: str, values: list[float], unit: str, command: str, commit: str) -> dict:
    """The median of ``values`` and their range, with when, where and how it was measured."""
    return {"figure": figure, "value": round(statistics.median(values), 4), "unit": unit,
            "range": [round(min(values), 4), round(max(values), 4)], "rounds": len(values),
            "date": datetime.date.today().isoformat(), "commit": commit,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
            "command": command}


def commit_measured(repo: str) -> str:
    """HEAD's short hash, ``+changes`` when the tracked tree differs from it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                            capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                      capture_output=True, text=True).stdout.strip():
        commit += "+changes"  # the tree measured is not that commit's
    return commit
