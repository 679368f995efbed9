"""CI's own figures, as the README and docs/ci.md state them: ``CI=true bash .ci/run`` run
``--rounds`` times in a row in one folder (``--clone``: a fresh ``git clone`` of HEAD, so the
first round creates the venv and builds the DeepSpeed ops; removed after), each round's wall
seconds, its tests' seconds (pytest's summary), setup's (the rest), the share of the machine's
CPU time busy meanwhile, and its passed, skipped and failed counts and exit status. Each
round's log goes to ``--out``.

python benchmarks/bench_ci.py [--rounds 2] [--clone] [--out /tmp/bench_ci]
python benchmarks/bench_ci.py --docs     # docs/ci.md's block, from --results; runs nothing
python benchmarks/bench_ci.py --readme   # the README's sentence, from --results; runs nothing

Each figure is written to ``--results`` (figure, value, range, rounds, date, commit, machine):
round 1's figures (``ci.first.*``: on a fresh clone, setup included) and the later rounds'
(``ci.again.*``: the same folder right after, as a second CI run on one machine). pip's cache is
whatever the machine has (on the machine these were measured on: warm).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import commit_measured, measured, paragraph, row, write_rows  # noqa: E402 - ours

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "ci.json")
SUMMARY = re.compile(r"^=*\s*(?P<counts>(\d+ \w+,? ?)+) in (?P<seconds>[0-9.]+)s", re.M)
DURATION = re.compile(r"^(?P<seconds>[0-9.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S+)$",
                      re.M)
SLOWEST = 10  # of pytest's --durations list, the tests docs/ci.md names
ROUND_TIMEOUT_S = 3600.0


def cpu_times() -> tuple[float, float]:
    """The machine's busy and total CPU seconds so far, all cores (``/proc/stat``)."""
    with open("/proc/stat") as fh:
        ticks = [int(x) for x in fh.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz


def one_round(folder: str, log: str) -> dict:
    """``CI=true bash .ci/run`` in ``folder``: its figures (its output in ``log``), with the
    share of the machine's CPU time that was busy meanwhile (``cores_busy``: 1.0 is every core
    all the time)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(CI="true", PATH=os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if not p.startswith(REPO)))
    start, (busy, total) = time.monotonic(), cpu_times()
    with open(log, "w") as out:
        proc = subprocess.run(["bash", ".ci/run"], cwd=folder, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=ROUND_TIMEOUT_S)
    wall, (busy_end, total_end) = time.monotonic() - start, cpu_times()
    with open(log) as fh:
        text = fh.read()
    found = list(SUMMARY.finditer(text))
    if not found:
        raise SystemExit(f"no pytest summary in {log} (exit {proc.returncode})")
    counts = {name: int(n) for n, name in re.findall(r"(\d+) (\w+)", found[-1]["counts"])}
    tests = float(found[-1]["seconds"])
    slowest = {f"{m['test']} ({m['phase']})": float(m["seconds"])
               for m in list(DURATION.finditer(text))[:SLOWEST]}
    return {"wall_s": wall, "tests_s": tests, "setup_s": wall - tests,
            "passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0),
            "failed": counts.get("failed", 0) + counts.get("errors", 0) + counts.get("error", 0),
            "exit": proc.returncode, "cores_busy": (busy_end - busy) / (total_end - total),
            "slowest": slowest}


def run(args, each=None) -> list[dict]:
    """The rounds' figures; ``each(rounds so far)`` after every round."""
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench-ci-") if args.clone else None
    folder = REPO
    try:
        if scratch:
            folder = os.path.join(scratch, "strategy")
            subprocess.run(["git", "clone", "--quiet", REPO, folder], check=True)
        rounds = []
        for rnd in range(args.rounds):
            rounds.append(one_round(folder, os.path.join(args.out, f"round{rnd + 1}.log")))
            print(f"round {rnd + 1}: {rounds[-1]}", flush=True)
            if each is not None:
                each(rounds)
        return rounds
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def docs(rows: list[dict]) -> str:
    """docs/ci.md's block: each round as measured."""
    by = {r["figure"]: r for r in rows}
    first = rows[0]
    lines = [f"{measured(first)}:", "",
             "| round | wall | setup and the rest (wall - tests) | tests |"
             + (" cores busy |" if "ci.first.cores_busy" in by else "")
             + " passed | skipped | failed | exit |",
             "| --- " * (9 if "ci.first.cores_busy" in by else 8) + "|"]
    for name, label in (("first", "1 (fresh clone)" if "clone" in first["command"] else "1"),
                        ("again", "2 (right after, same folder)")):
        if f"ci.{name}.wall_s" not in by:
            continue
        cell = {key: by[f"ci.{name}.{key}"] for key in
                ("wall_s", "setup_s", "tests_s", "passed", "skipped", "failed", "exit")}
        busy = by.get(f"ci.{name}.cores_busy")  # measured since 2026-12-08
        busy = f" {busy['value']:.0%} |" if busy else ""
        lines.append(f"| {label} | {minutes(cell['wall_s']['value'])} | "
                     f"{cell['setup_s']['value']:.0f} s | {cell['tests_s']['value']:.0f} s |"
                     f"{busy} {cell['passed']['value']:.0f} | {cell['skipped']['value']:.0f} | "
                     f"{cell['failed']['value']:.0f} | {cell['exit']['value']:.0f} |")
    slow = [r for r in rows if r["figure"].startswith("ci.slowest.")]
    lines += ["", f"The {len(slow)} slowest tests of the last round (pytest's `--durations`):", "",
              "| seconds | test |", "| --- | --- |"]
    lines += [f"| {r['value']:.0f} | `{r['figure'].removeprefix('ci.slowest.')}` |"
              for r in slow]
    return "\n".join(lines) + "\n"


def readme(rows: list[dict]) -> str:
    """The README's sentence on CI."""
    by = {r["figure"]: r for r in rows}
    first = by["ci.first.wall_s"]
    where = "a fresh clone" if "clone" in first["command"] else "a checkout with its venv built"
    again = by.get("ci.again.wall_s")
    text = (f"`bash .ci/run` on {where} took {minutes(first['value'])} "
            f"(setup {by['ci.first.setup_s']['value']:.0f} s, tests "
            f"{by['ci.first.tests_s']['value']:.0f} s, {by['ci.first.passed']['value']:.0f} "
            f"passed, exit {by['ci.first.exit']['value']:.0f})")
    if again is not None:
        text += (f", and {minutes(again['value'])} run again right after "
                 f"(exit {by['ci.again.exit']['value']:.0f})")
    return paragraph(text + f" on {first['date']} at {first['commit']} ({first['machine']}).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clone", action="store_true", help="a fresh clone of HEAD")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_ci"))
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--docs", action="store_true", help="print docs/ci.md's block")
    parser.add_argument("--readme", action="store_true", help="print the README's sentence")
    args = parser.parse_args()
    if args.docs or args.readme:
        with open(args.results) as fh:
            print((docs if args.docs else readme)(json.load(fh)), end="")
        return
    commit = commit_measured(REPO)
    if args.clone:  # the clone holds HEAD as committed
        commit = commit.removesuffix("+changes")
    command = "python benchmarks/bench_ci.py " + " ".join(sys.argv[1:])

    def written(rounds: list[dict]) -> None:  # after each round: a stopped run keeps its rounds
        rows = []
        for name, part in (("first", rounds[:1]), ("again", rounds[1:])):
            for key in [k for k in (part[0] if part else {}) if k != "slowest"]:
                rows.append(row(f"ci.{name}.{key}", [r[key] for r in part], "s" if key.endswith(
                    "_s") else "", command, commit))
        for test, seconds in rounds[-1]["slowest"].items():  # the last round's
            rows.append(row(f"ci.slowest.{test}", [seconds], "s", command, commit))
        write_rows(args.results, rows)

    rounds = run(args, written)
    sys.exit(max(r["exit"] for r in rounds))


if __name__ == "__main__":
    main()
