"""The README's GRPO figures: ``bash examples/run_grpo.sh`` (the toy task's hard data, a short
SFT, then GRPO with ``configs/grpo_toy.yaml``, each evaluated from a fresh-process reload) run
``--rounds`` times with the install already done, each in a fresh output folder; per run the
held-out exact match after the SFT and after GRPO, and each launch's seconds (start-up included).
GRPO alone: no ``GRPO_CONFIG`` or ``TRAINER`` from the environment reaches the runs.

python benchmarks/bench_run_grpo.py [--rounds 2] [--results benchmarks/results/run_grpo.json]
python benchmarks/bench_run_grpo.py --readme   # the README's sentence, from --results

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
RESULTS = os.path.join(REPO, "benchmarks", "results", "run_grpo.json")
LAST = re.compile(r"\[grpo run\] SFT (\d+) s: held-out exact match ([0-9.]+)%; grpo (\d+) s: "
                  r"([0-9.]+)%")


def one_run(port: int) -> dict:
    for name in ("GRPO_CONFIG", "TRAINER", "GRPO_FLAGS"):  # GRPO with the shipped config alone
        os.environ.pop(name, None)
    with tempfile.TemporaryDirectory(prefix="bench-run-grpo-") as out:
        stdout = run_example(REPO, "run_grpo.sh", os.path.join(out, "o"), port, 1800)
    found = LAST.search(stdout)
    if found is None:
        raise SystemExit(f"run_grpo.sh's last line was not found:\n{stdout[-2000:]}")
    return {"sft_s": float(found[1]), "sft_accuracy": float(found[2]),
            "grpo_s": float(found[3]), "grpo_accuracy": float(found[4])}


def readme(rows: list[dict]) -> str:
    """The README's sentence on ``examples/run_grpo.sh``."""
    by = {r["figure"]: r for r in rows}
    first = rows[0]
    text = (f"Step 3 is what `bash examples/run_grpo.sh` runs, with a fresh-process evaluation "
            f"before and after: held-out exact match {span(by['run_grpo.sft_accuracy'], '.1f')}% "
            f"after the short SFT ({span(by['run_grpo.sft_s'], '.0f')} s), "
            f"{span(by['run_grpo.grpo_accuracy'], '.1f')}% after GRPO "
            f"({span(by['run_grpo.grpo_s'], '.0f')} s for the GRPO launch on 2 CPU ranks); "
            f"{first['rounds']} run{'s' * (first['rounds'] != 1)}, {first['date']}, "
            f"{first['commit']}, {first['machine']}, "
            f"`{first['command']}` (PPO and REINFORCE++: [Online RL](docs/online-rl.md)).")
    return paragraph(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--readme", action="store_true",
                        help="print the README's sentence from --results, run nothing")
    args = parser.parse_args()
    if args.readme:
        with open(args.results) as fh:
            print(readme(json.load(fh)), end="")
        return
    runs = []
    for rnd in range(args.rounds):
        runs.append(one_run(29641 + rnd))
        print(f"round {rnd + 1}: {runs[-1]}", flush=True)
    commit = commit_measured(REPO)
    command = "python benchmarks/bench_run_grpo.py " + " ".join(sys.argv[1:])
    units = {"sft_accuracy": "%", "sft_s": "s", "grpo_accuracy": "%", "grpo_s": "s"}
    write_rows(args.results, [row(f"run_grpo.{key}", [r[key] for r in runs], unit, command,
                                  commit) for key, unit in units.items()])


if __name__ == "__main__":
    main()
