#!/usr/bin/env python
"""A stand-in for Slurm's ``srun`` (tests only): ``srun -n N [options] --export=ALL,K=V cmd...``
runs N copies of ``cmd`` on this machine, each with the task variables srun gives a task on its
own node (``SLURM_PROCID``, ``SLURM_LOCALID=0``, ``SLURM_STEP_NUM_TASKS``, ...), and exits with
the worst exit status."""

import os
import subprocess
import sys


def main() -> int:
    args = sys.argv[1:]
    tasks = int(args[args.index("-n") + 1])
    start = next(i for i, a in enumerate(args) if a.startswith("--export="))
    exports = dict(kv.split("=", 1) for kv in args[start][len("--export="):].split(",")[1:])
    command = args[start + 1:]
    procs = []
    for task in range(tasks):
        env = {**os.environ, **exports, "SLURM_PROCID": str(task), "SLURM_LOCALID": "0",
               "SLURM_NODEID": str(task), "SLURM_STEP_NUM_TASKS": str(tasks),
               "SLURM_STEP_TASKS_PER_NODE": f"1(x{tasks})"}
        procs.append(subprocess.Popen(command, env=env))
    return max(proc.wait() for proc in procs)


if __name__ == "__main__":
    sys.exit(main())
