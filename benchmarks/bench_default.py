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
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import (  # noqa: E402 - the benchmarks' own helpers
    commit_measured,
    paragraph,
    row,
    run_example,
    span,
    write_rows,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "default.json")
ACCURACY = re.compile(r"held-out exact-match accuracy: ([0-9.]+)% \((\d+) samples")
AGREES = re.compile(r"agrees with the in-training model on (\d+)/(\d+) answers")


def one_run(port: int) -> dict:
    """One run of the script: its figures, read from its output and its metrics."""
    with tempfile.TemporaryDirectory(prefix="bench-default-") as out:
        stdout = run_example(REPO, "run_default.sh", os.path.join(out, "o"), port, 900)
        rows = [json.loads(line) for line in open(os.path.join(out, "o", "logs",
                                                               "metrics.jsonl"))]
    times = [r["train/step_time"] for r in rows if "train/step_time" in r]
    accuracy, agrees = ACCURACY.search(stdout), AGREES.search(stdout)
    wall = re.search(r"\[default run\] done in (\d+) s", stdout)
    return {"heldout_accuracy": float(accuracy.group(1)), "samples": int(accuracy.group(2)),
            "reload_agrees": int(agrees.group(1)),
            "train_s": sum(times) / len(times) * max(r["step"] for r in rows),
            "wall_s": float(wall.group(1))}


def readme(rows: list[dict]) -> str:
    """The README's paragraph on the main job, from the results."""
    by = {r["figure"]: r for r in rows}
    first, samples = rows[0], int(by["default.samples"]["value"])
    train, wall = span(by["default.train_s"], ".0f"), span(by["default.wall_s"], ".0f")
    accuracy = span(by["default.heldout_accuracy"], ".1f")
    agrees = span(by["default.reload_agrees"], ".0f")
    text = (f"What you will see from the main job, measured {first['rounds']} times "
            f"({first['date']}, {first['commit']}, {first['machine']}) with the install already "
            f"done (`SKIP_SETUP=1`; `{first['command']}`): one epoch, 256 steps, trained in "
            f"{train} s; **{accuracy}% held-out exact match** on {samples} unseen strings, and "
            f"the fresh-process reload gives {agrees} of the {samples} answers of the model in "
            f"training; **{wall} s** from start to the last line.")
    return paragraph(text)


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
    write_rows(args.results, rows)


if __name__ == "__main__":
    main()
