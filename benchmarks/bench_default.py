"""The main job's figures, as the README states them: ``bash examples/run_default.sh`` run
``--rounds`` times with the install already done (``SKIP_SETUP=1``), each in a fresh output
folder; per run the held-out exact match of the fresh-process reload, how many of its answers
equal the in-training model's, the training steps' seconds (mean logged ``train/step_time`` x
steps) and the script's wall seconds (data, training, reload).

python benchmarks/bench_default.py [--rounds 4] [--results benchmarks/results/default.json]
python benchmarks/bench_default.py --readme   # the README's block, from --results; runs nothing

Each figure is written to ``--results`` (figure, value, range, rounds, date, commit, machine):
the median over rounds and its range. tests/test_benchmark_figures.py checks the README's block
against the file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import commit_measured, row  # noqa: E402 - the benchmarks' own helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "default.json")
ACCURACY = re.compile(r"held-out exact-match accuracy: ([0-9.]+)% \((\d+) samples")
AGREES = re.compile(r"agrees with the in-training model on (\d+)/(\d+) answers")


def one_run(port: int) -> dict:
    """One run of the script: its figures, read from its output and its metrics."""
    with tempfile.TemporaryDirectory(prefix="bench-default-") as out:
        env = {**os.environ, "SKIP_SETUP": "1", "OUT": os.path.join(out, "o"),
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(["bash", "examples/run_default.sh"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise SystemExit(f"run_default.sh failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(os.path.join(out, "o", "logs",
                                                               "metrics.jsonl"))]
    times = [r["train/step_time"] for r in rows if "train/step_time" in r]
    accuracy, agrees = ACCURACY.search(proc.stdout), AGREES.search(proc.stdout)
    wall = re.search(r"\[default run\] done in (\d+) s", proc.stdout)
    return {"heldout_accuracy": float(accuracy.group(1)), "samples": int(accuracy.group(2)),
            "reload_agrees": int(agrees.group(1)),
            "train_s": sum(times) / len(times) * max(r["step"] for r in rows),
            "wall_s": float(wall.group(1))}


def readme(rows: list[dict]) -> str:
    """The README's paragraph on the main job, from the results."""
    by = {r["figure"]: r for r in rows}

    def span(key: str, fmt: str) -> str:
        low, high = by[key]["range"]
        return f"{low:{fmt}}" if f"{low:{fmt}}" == f"{high:{fmt}}" else f"{low:{fmt}}-{high:{fmt}}"

    first, samples = rows[0], int(by["default.samples"]["value"])
    text = (f"What you will see from the main job, measured {first['rounds']} times "
            f"({first['date']}, {first['commit']}, {first['machine']}) with the install already "
            f"done (`SKIP_SETUP=1`; `{first['command']}`): one epoch, 256 steps, trained in "
            f"{span('default.train_s', '.0f')} s; **{span('default.heldout_accuracy', '.1f')}% "
            f"held-out exact match** on {samples} unseen strings, and the fresh-process reload "
            f"gives {span('default.reload_agrees', '.0f')} of the {samples} answers of the model "
            f"in training; **{span('default.wall_s', '.0f')} s** from start to the last line.")
    return textwrap.fill(text, width=99, break_on_hyphens=False, break_long_words=False) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--readme", action="store_true",
                        help="print the README's block from --results, run nothing")
    args = parser.parse_args()
    if args.readme:
        with open(args.results) as fh:
            print(readme(json.load(fh)), end="")
        return
    runs = []
    for rnd in range(args.rounds):
        runs.append(one_run(29611 + rnd))
        print(f"round {rnd + 1}: {runs[-1]}", flush=True)
    commit = commit_measured(REPO)
    command = "python benchmarks/bench_default.py " + " ".join(sys.argv[1:])
    units = {"heldout_accuracy": "%", "samples": "rows", "reload_agrees": "rows",
             "train_s": "s", "wall_s": "s"}
    rows = [row(f"default.{key}", [r[key] for r in runs], unit, command, commit)
            for key, unit in units.items()]
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as fh:
        json.dump(rows, fh, indent=1)
        fh.write("\n")
    print(f"written to {args.results}")


if __name__ == "__main__":
    main()
