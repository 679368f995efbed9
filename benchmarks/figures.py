"""What the benchmark scripts that write results files share: one row per figure (figure, value,
range, rounds, date, commit, machine, command) and the commit measured. A figure the docs state
is rendered from these rows, and tests/test_benchmark_figures.py checks each page against its
file."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import textwrap


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


def run_example(repo: str, script: str, out: str, port: int, timeout: float) -> str:
    """``bash examples/SCRIPT`` with the install already done, its outputs in ``out``; its
    stdout, or the run's end of stderr as the reason it stopped."""
    env = {**os.environ, "SKIP_SETUP": "1", "OUT": out, "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", f"examples/{script}"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def write_rows(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)
        fh.write("\n")
    print(f"written to {path}")


def measured(row: dict) -> str:
    """Where, when and how a results file's rows were measured, as the docs' blocks open."""
    return (f"Measured {row['date']} at {row['commit']} ({row['machine']}), "
            f"`{row['command']}`")


def span(row: dict, fmt: str) -> str:
    """A row's range as text (one value when both ends read alike)."""
    low, high = (f"{v:{fmt}}" for v in row["range"])
    return low if low == high else f"{low}-{high}"


def paragraph(text: str) -> str:
    """``text`` wrapped as the docs' lines are."""
    return textwrap.fill(text, width=99, break_on_hyphens=False, break_long_words=False) + "\n"
