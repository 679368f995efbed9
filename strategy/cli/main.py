"""``strategy``: the console command. ``strategy <trainer> [--nproc N] FLAGS...`` checks the
settings once, in this process (a bad one is one line, before any rank starts), then starts N
ranks of ``strategy.cli.train_<trainer>`` on this machine with torch's launcher (``torchrun``).

``strategy serve-rm ...`` and ``strategy lora-combiner ...`` run those tools in this process.

strategy --help
strategy sft --help
strategy sft --nproc 2 --config sft_zero2 --pretrain MODEL_DIR --dataset data.jsonl
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from strategy.errors import ConfigError, RankFailedError, StrategyError

COMMANDS = ("sft", "rm", "dpo", "orpo", "simpo", "kto", "grpo", "ppo", "distill")
TOOLS = {  # one process each, no ranks: ``strategy serve-rm ...`` is ``python -m`` of the module
    "serve-rm": ("strategy.cli.serve_rm", "serve a reward model over HTTP (OpenRLHF's "
                 "serve_rm protocol)"),
    "lora-combiner": ("strategy.cli.lora_combiner", "merge a LoRA adapter into its base model "
                      "(OpenRLHF's lora_combiner)"),
}
CPU_RANKS = 2  # ranks on a machine without accelerators: the tested CPU setting
LAUNCH_FLAGS = {"nproc": int, "master_port": int, "master_addr": str, "nnodes": int,
                "node_rank": int}


def _usage() -> str:
    from strategy.cli.trainers import TRAINERS  # deferred: importing trainers takes seconds

    lines = ["usage: strategy <trainer> [--nproc N] [--master_port P] [--nnodes N --node_rank R "
             "--master_addr HOST] [flags...]", "", "trainers:"]
    lines += [f"  {name:<6} {about}" for name, (_, about) in TRAINERS.items()]
    lines += ["", "tools (one process, no ranks):"]
    lines += [f"  {name:<13} {about}" for name, (_, about) in TOOLS.items()]
    lines += ["", "strategy <trainer> --help lists a trainer's flags; --config NAME takes a "
              "shipped config by name (e.g. sft_zero2) or a YAML path.",
              f"--nproc: ranks on this machine (default: every local GPU, else {CPU_RANKS} on a "
              "CPU machine)."]
    return "\n".join(lines)


def split_launch_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """The launcher's own flags (``--nproc``, ``--master_port``...) apart from the trainer's.

    Args:
        argv: the arguments after the trainer's name.

    Returns:
        ``({flag: value}, the trainer's arguments)``.

    Raises:
        ConfigError: a launcher flag without a value of its type.
    """
    found, rest, args = {}, [], list(argv)
    while args:
        arg = args.pop(0)
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in LAUNCH_FLAGS:
            rest.append(arg)
            continue
        if not eq:
            value = args.pop(0) if args else ""
        try:
            found[name] = LAUNCH_FLAGS[name](value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is invalid: expected "
                              f"{LAUNCH_FLAGS[name].__name__}") from None
    return found, rest


def default_nproc() -> int:
    """Ranks to start on this machine: one per local accelerator, or ``CPU_RANKS`` on CPU.

    Returns:
        The count.
    """
    from deepspeed.accelerator import get_accelerator  # deferred: not for --help

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return CPU_RANKS
    return max(accelerator.device_count(), 1)


def launcher_argv(command: str, launch: dict, argv: list[str]) -> list[str]:
    """The ``torch.distributed.run`` command line that starts ``command``'s ranks.

    Args:
        command: the trainer's command (``sft``...).
        launch: the launcher flags (``split_launch_flags``), ``nproc`` set.
        argv: the trainer's arguments.

    Returns:
        The arguments after ``python``.
    """
    # --log-dir /dev/null: torchrun otherwise leaves a torchelastic_* folder in /tmp each run
    out = ["-m", "torch.distributed.run", "--nproc_per_node", str(launch["nproc"]),
           "--log-dir", os.devnull]
    if launch.get("nnodes", 1) > 1:
        out += ["--nnodes", str(launch["nnodes"]), "--node_rank", str(launch.get("node_rank", 0)),
                "--master_addr", launch.get("master_addr", "127.0.0.1"),
                "--master_port", str(launch.get("master_port", 29500))]
    elif "master_port" in launch:
        out += ["--master_addr", "127.0.0.1", "--master_port", str(launch["master_port"])]
    else:
        out += ["--standalone"]  # a free port of its own
    return out + ["-m", f"strategy.cli.train_{command}", *argv]


def check(command: str, launch: dict, argv: list[str]) -> None:
    """Every setting checked once, here, as a rank would (world size from the launch).

    Raises:
        ConfigError: a setting is invalid.
    """
    from strategy.cli.trainers import TRAINERS, command_argv  # deferred, as in _usage
    from strategy.trainers.run import Run  # deferred, as in _usage

    world = launch["nproc"] * launch.get("nnodes", 1)
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        Run.check_args(command_argv(argv, command), trainer=TRAINERS[command][0])
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved


def main(argv: list[str] | None = None) -> None:
    """``strategy <trainer> ...``: check, then exec the launcher (its exit status is ours).

    Args:
        argv: the command line without the program name (None: ``sys.argv``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command in TOOLS:
        sys.argv[0] = f"strategy {command}"  # argparse's program name in --help
        importlib.import_module(TOOLS[command][0]).main(rest)
        raise SystemExit(0)
    if command not in COMMANDS:
        sys.stderr.write(f"error: {command!r} is not a trainer nor a tool; use one of "
                         f"{', '.join([*COMMANDS, *TOOLS])} (strategy --help)\n")
        raise SystemExit(2)
    try:
        launch, rest = split_launch_flags(rest)
        if "-h" in rest or "--help" in rest:
            _help(command)
        if "--ray" in rest:  # this process drives; Ray places the ranks (strategy.cluster)
            run_ray_job(command, rest)
        launch.setdefault("nproc", default_nproc())
        check(command, launch, rest)
    except StrategyError as error:
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(2) from None
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    os.execve(sys.executable, [sys.executable, *launcher_argv(command, launch, rest)], env)


def run_ray_job(command: str, argv: list[str]) -> None:
    """``strategy <trainer> --ray ...``: the job on Ray, driven from here; exit 0, or one line
    and exit 2 (a setting, a placement) or 1 (a rank or engine failed)."""
    from strategy.cli.trainers import command_argv  # deferred: importing trainers takes seconds
    from strategy.cluster import run_on_ray  # deferred: Ray jobs only

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run_on_ray(command, command_argv(argv, command))
    except StrategyError as error:
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(1 if isinstance(error, RankFailedError) else 2) from None
    except KeyboardInterrupt as stop:  # SIGTERM or Ctrl-C, after the teardown
        signum = getattr(stop, "signum", signal.SIGINT)
        sys.stderr.write(f"error: the Ray job was stopped by {signal.Signals(signum).name}; its "
                         "actors and placement groups are removed\n")
        raise SystemExit(128 + signum) from None
    raise SystemExit(0)


def _help(command: str) -> None:
    """Print ``command``'s flags (its trainer's and the shared ones) and exit 0."""
    sys.argv[0] = f"strategy {command}"  # argparse's program name
    importlib.import_module(f"strategy.cli.train_{command}").main(["--help"])


if __name__ == "__main__":
    main()
