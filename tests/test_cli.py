"""The installed commands: ``strategy <trainer>`` and ``strategy.cli.train_*``, each parsing the
shared configs and its own trainer's only; another trainer's flag refused in one line; shipped
configs by name; OpenRLHF 0.11's dotted flags; ``--packing_samples`` with OpenRLHF's meaning; and
the wheel, installed in a fresh venv, training from outside the checkout."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import typing
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("sft", "rm", "dpo", "orpo", "simpo", "kto", "grpo", "ppo", "distill")


def _flags_in_help(text: str) -> set[str]:
    return set(re.findall(r"^  --(?:\[no-\])?(\w+)", text, flags=re.M)) | set(
        re.findall(r"\[--(\w+)", text))  # option lines and the usage, not help texts


def _help(command: str, capsys) -> str:
    """``strategy <command> --help``'s text, in this process."""
    from strategy.cli.main import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_each_trainer_parses_the_shared_configs_and_its_own_only():
    from strategy.cli.trainers import TRAINERS
    from strategy.trainers.run import CONFIG_CLASSES, flag_names, shared_flags

    every_shared = shared_flags(None)
    for command, (trainer, _) in TRAINERS.items():
        own = {f.name for cls in trainer.config_classes for f in dataclasses.fields(cls)}
        mine = flag_names(trainer)
        assert mine == shared_flags(trainer) | own
        others = set().union(*(flag_names(t) for c, (t, _) in TRAINERS.items() if c != command))
        assert not (mine - every_shared - own), command  # nothing beyond shared + own
        assert others - mine, f"{command} parses every other trainer's flags"
    assert {"beta", "group_size", "chosen_key", "ref_offload", "kto_beta"} & flag_names(
        TRAINERS["sft"][0]) == set()
    assert {"beta", "ref_offload", "chosen_key"} <= flag_names(TRAINERS["dpo"][0])
    assert {"group_size", "reward_fn", "ref_offload", "input_key"} <= flag_names(
        TRAINERS["grpo"][0])
    assert len(CONFIG_CLASSES) == 7
    from strategy.cli.main import COMMANDS as LAUNCHED
    assert LAUNCHED == tuple(TRAINERS) == COMMANDS  # the launcher's quick list agrees


def test_help_lists_the_trainers_and_each_trainers_flags_alone(capsys):
    from strategy.cli.main import main
    from strategy.cli.trainers import TRAINERS
    from strategy.trainers.run import flag_names

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    listing = capsys.readouterr().out
    assert done.value.code == 0
    assert all(re.search(rf"^\s+{c}\s", listing, flags=re.M) for c in COMMANDS), listing
    assert all(re.search(rf"^\s+{t}\s", listing, flags=re.M) for t in ("serve-rm",
                                                                        "lora-combiner"))
    for command in COMMANDS:
        shown = _flags_in_help(_help(command, capsys)) - {"help", "config", "local_rank",
                                                          "print_config"}
        assert shown == flag_names(TRAINERS[command][0]), (command, shown ^ flag_names(
            TRAINERS[command][0]))
    sft = _help("sft", capsys)
    for foreign in ("--beta", "--loss_type", "--ipo", "--group_size", "--kl_coef", "DPOConfig"):
        assert foreign not in sft, foreign
    dpo = subprocess.run([sys.executable, "-m", "strategy.cli.train_dpo", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert dpo.returncode == 0 and "--beta" in dpo.stdout and "--group_size" not in dpo.stdout


def _one_line(cmd: list[str], cwd=ROOT) -> str:
    env = {**os.environ, "WORLD_SIZE": "2"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error", "Traceback"))]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_a_foreign_flag_is_refused_in_one_line_naming_who_takes_it(tmp_path, monkeypatch):
    from strategy.errors import ConfigError
    from tests.support.helpers import forbid_process_group, load_example

    base = ["--config", "sft_zero2", "--dataset", "missing.jsonl"]
    line = _one_line([sys.executable, "-m", "strategy.cli.train_sft", *base, "--beta", "0.1"])
    assert line == "error: --beta is not a flag of sft; distill and dpo take it"
    line = _one_line([sys.executable, "-m", "strategy.cli.main", "sft", "--nproc", "2", *base,
                      "--group_size", "4"])
    assert line == "error: --group_size is not a flag of sft; grpo and ppo take it"
    forbid_process_group(monkeypatch)
    config = tmp_path / "sft.yaml"
    config.write_text("zero_stage: 2\nkl_coef: 0.1\n")
    for script, argv, message in [
            ("train_orpo", [*base, "--ref_pretrain", "x"],
             "--ref_pretrain is not a flag of orpo; dpo, grpo, kto and ppo take it"),
            ("train_sft", ["--config", str(config)],
             f"{config}: --kl_coef is not a flag of sft; grpo and ppo take it"),
            ("train_sft", [*base, "--lerning_rate", "1"],
             "--lerning_rate is not a flag here; did you mean --learning_rate?"),
            ("train_grpo", [*base, "--critic_learning_rate", "1e-5"],
             "--critic_learning_rate is not a flag of grpo; ppo takes it"),
            ("train_rm", [*base, "--messages_key", "chat"],
             "--messages_key is not a flag of rm; distill and sft take it")]:
        with pytest.raises(ConfigError) as refused:
            load_example(script)(argv)
        assert str(refused.value) == message


def test_shipped_configs_are_found_by_name_and_a_path_still_works(tmp_path):
    from strategy.config.cli import config_path, read_yaml, shipped_configs

    shipped = shipped_configs()
    assert {"sft_zero2", "dpo_zero3", "grpo_toy", "ppo_toy", "default"} <= set(shipped)
    assert read_yaml("sft_zero2") == read_yaml(str(ROOT / "configs" / "sft_zero2.yaml"))
    assert config_path("sft_zero2.yaml") == shipped["sft_zero2"]
    own = tmp_path / "sft_zero2"  # a file of that name in the working directory wins
    own.write_text("zero_stage: 1\n")
    assert read_yaml(str(own)) == {"zero_stage": 1}
    from strategy.errors import ConfigError
    with pytest.raises(ConfigError, match="did you mean 'sft_zero3'"):
        read_yaml("sft_zero9")


# ------------------------------------------------------------ OpenRLHF 0.11's dotted flags
def _value_for(tp) -> list[str]:
    from strategy.config.cli import _base_type

    base = _base_type(tp)
    if typing.get_origin(base) is tuple:
        return ["0.5", "0.75", "0.875"][:len(typing.get_args(base))]  # apart: order shows
    return {int: ["3"], float: ["0.25"], str: ["abc"], dict: ['{"a": 1}'], bool: ["True"]}[base]


def _slots(template: tuple[str, ...]) -> dict[str, list[str]]:
    """Each of our flags in a mapping's template and the value tokens that follow it."""
    out: dict[str, list[str]] = {}
    for token in template:
        if token.startswith("--"):
            name = token[2:].removeprefix("no-")
            out[name] = []
        else:
            out[name].append(token)
    return out


def _parsed(name: str, tp, value) -> object:
    """``value`` (a parsed flag, or the tokens given for it) as the field's type would hold it."""
    from strategy.config.cli import coerce

    if isinstance(value, list):  # the tokens given
        value = (",".join(value) if name == "target_modules" else value[0] if len(value) == 1
                 else [yaml.safe_load(v) if isinstance(v, str) else v for v in value])
    if isinstance(value, str) and _base(tp) is not str:
        value = yaml.safe_load(value)
    return coerce(name, tp, value)


def _base(tp):
    from strategy.config.cli import _base_type

    return _base_type(tp)


def _our_parser(command: str):
    import argparse

    from strategy.cli.trainers import TRAINERS
    from strategy.config.cli import add_config_args
    from strategy.trainers.run import CONFIG_CLASSES, hidden_flags

    trainer = TRAINERS[command][0]
    hidden = hidden_flags(trainer)
    parser = argparse.ArgumentParser()
    return add_config_args(parser, *CONFIG_CLASSES, *trainer.config_classes, hidden=hidden)


def _fields(command: str) -> dict:
    from strategy.cli.trainers import TRAINERS
    from strategy.trainers.run import CONFIG_CLASSES

    classes = CONFIG_CLASSES + TRAINERS[command][0].config_classes
    return {name: tp for cls in classes for name, tp in typing.get_type_hints(cls).items()
            if name in {f.name for f in dataclasses.fields(cls)}}


OURS = {"train_sft": ("sft",), "train_rm": ("rm",), "train_dpo": ("dpo",),
        "train_ppo_ray": ("grpo", "ppo")}


def test_every_openrlhf_flag_is_mapped_or_refused_and_each_mapping_sets_our_field():
    """Each flag of OpenRLHF 0.11's train_sft/rm/dpo/ppo_ray parsers is in exactly one table
    (mapped, refused, or taken for the device's value); each mapped one, given a value, sets
    the field it names on our trainer's parser to it."""
    from strategy.cli.dotted import dotted_argv, openrlhf_argv
    from strategy.cli.openrlhf_flags import (
        DEVICE_FLAGS,
        DOTTED,
        PARSERS,
        PER_PARSER,
        REFUSED,
        VALUE_MAPS,
    )
    from strategy.cli.trainers import TRAINERS
    from strategy.errors import ConfigError
    from strategy.trainers.run import flag_names, foreign_flags

    assert set(PARSERS) == set(OURS)
    checked = 0
    for parser_name, flags in PARSERS.items():
        for flag in flags:
            tables = [flag in DOTTED or flag in PER_PARSER.get(parser_name, {}),
                      flag in REFUSED, flag in DEVICE_FLAGS]
            assert sum(tables) == 1, (parser_name, flag, tables)
            if flag in DEVICE_FLAGS:  # tests/test_openrlhf_cli.py checks each value
                continue
            for command in OURS[parser_name]:
                if flag in REFUSED:
                    with pytest.raises(ConfigError, match=f"--{re.escape(flag)} .*not supported"):
                        dotted_argv([f"--{flag}", "1"], command)
                    continue
                template = PER_PARSER.get(parser_name, {}).get(flag) or DOTTED[flag]
                if not template:
                    continue  # what this framework always does
                fields, wanted = {"local_rank": int, **_fields(command)}, template.count("{}")
                targets = [t[2:].removeprefix("no-") for t in template if t.startswith("--")]
                trainer = TRAINERS[command][0]
                takes = flag_names(trainer) | {"local_rank"}
                if not set(targets) <= takes:  # another trainer's: refused in one line
                    lines = foreign_flags(trainer)
                    assert all(t in lines for t in set(targets) - takes), (flag, command)
                    continue
                values = (list(VALUE_MAPS[flag])[:1] * wanted if flag in VALUE_MAPS
                          else [v for t in targets for v in _value_for(fields[t])][:wanted])
                argv = openrlhf_argv(dotted_argv([f"--{flag}", *values], command))
                namespace = vars(_our_parser(command).parse_args(argv))
                given = iter(VALUE_MAPS[flag][v] if flag in VALUE_MAPS else v for v in values)
                for target, tokens in _slots(template).items():
                    got, field = namespace[target], fields[target]
                    if not tokens:  # a switch
                        assert got is (not template[0].startswith("--no-")), (flag, got)
                        continue
                    want = [next(given) if t == "{}" else t for t in tokens]
                    assert _parsed(target, field, got) == _parsed(target, field, want), (
                        flag, command, argv, got, want)
                checked += 1
    assert checked > 200, checked


def test_dotted_flags_set_the_same_settings_through_a_real_parse():
    from strategy.cli.dotted import dotted_argv, openrlhf_argv

    argv = dotted_argv(["--ds.zero_stage", "3", "--ds.packing_samples", "--optim", "adam",
                        "--ds.lora.target_modules", "q_proj", "v_proj", "--train.max_epochs",
                        "2", "--rollout.n_samples_per_prompt", "4", "--actor.eps_clip_low_high",
                        "0.2", "0.28"], "grpo")
    ns = vars(_our_parser("grpo").parse_args(openrlhf_argv(argv)))
    assert ns["target_modules"] == "q_proj,v_proj"
    assert (ns["zero_stage"], ns["packing_samples"], ns["optimizer"], ns["ppo_epochs"],
            ns["group_size"], ns["clip_eps_low"], ns["clip_eps_high"]) == (
        3, True, "fused_adam", 2, 4, 0.2, 0.28)
    assert vars(_our_parser("sft").parse_args(dotted_argv(["--train.max_epochs", "2"], "sft")))[
        "max_epochs"] == 2
    line = _one_line([sys.executable, "-m", "strategy.cli.train_grpo", "--vllm.sync_with_ray"])
    assert line.startswith("error: --vllm.sync_with_ray (OpenRLHF's) is not supported here")


# ------------------------------------------------------------ --packing_samples: OpenRLHF's
def counted_sft(root: str, name: str, **extra) -> dict:
    """SFT 2 steps; every training micro-batch's samples counted (packed rows by the position
    ids that restart at each sample)."""
    import torch

    from strategy.trainers import Run, SFTTrainer

    class Counting(SFTTrainer):
        seen: list = []

        def compute_loss(self, batch):
            if torch.is_grad_enabled():
                rows = batch["input_ids"].shape[0]
                n = int((batch["position_ids"] == 0).sum()) if "position_ids" in batch else rows
                self.seen.append((self.global_step, n, rows))
            return super().compute_loss(batch)

    args = {"model_config": "configs/tiny_llama.json", "tokenizer": f"{root}/data/tokenizer",
            "dataset": f"{root}/data/train.jsonl", "max_len": 32, "zero_stage": 2,
            "micro_train_batch_size": 3, "train_batch_size": 12, "max_steps": 2,
            "learning_rate": 1e-3, "save_path": f"{root}/{name}/model",
            "ckpt_path": f"{root}/{name}/ckpt", "log_dir": f"{root}/{name}/logs", **extra}
    argv = [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items()]
    with Run.from_args(argv, trainer=SFTTrainer) as run:
        trainer = run.trainer(Counting, run.model())
        trainer.fit()
        attention = trainer.model.module.config._attn_implementation
    return {"seen": Counting.seen, "history": trainer.history, "attention": attention}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("cli")
    toy_root(root, n_train=203, n_test=7, model_dir="model")  # 203: no size divides it
    return root


def _steps(results: list[dict]) -> dict[int, tuple[int, int]]:
    """Per optimizer step: (samples, rows) over every rank's micro-batches."""
    out: dict[int, list[int]] = {}
    for rank in results:
        for step, samples, rows in rank["seen"]:
            out.setdefault(step, [0, 0])
            out[step][0] += samples
            out[step][1] += rows
    return {k: tuple(v) for k, v in out.items()}


def test_packing_samples_counts_samples_and_equals_the_unpacked_step(ranks, toy):
    plain = ranks.run(counted_sft, str(toy), "plain")
    packed = ranks.run(counted_sft, str(toy), "packed", packing_samples=True)
    dataset = ranks.run(counted_sft, str(toy), "dataset", pack_dataset=True)
    assert _steps(plain) == {0: (12, 12), 1: (12, 12)}
    # OpenRLHF's meaning: train_batch_size samples a step, each micro-batch one padding-free row
    assert _steps(packed) == {0: (12, 4), 1: (12, 4)}, _steps(packed)
    assert packed[0]["attention"] == "sdpa_varlen" and plain[0]["attention"] == "sdpa"
    loss = [[r["loss"] for r in res[0]["history"]] for res in (plain, packed)]
    assert loss[0][0] == pytest.approx(loss[1][0], rel=1e-5, abs=1e-6), loss
    assert loss[0][1] == pytest.approx(loss[1][1], rel=1e-4), loss  # after one equal update
    # --pack_dataset: batch sizes count max_len rows of several samples each
    rows = _steps(dataset)
    assert all(r == 12 and s > 12 for s, r in rows.values()), rows


# ------------------------------------------------------------ the wheel, installed
def _venv_bin(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout and installed (not editable) in a fresh venv that
    borrows the test environment's dependencies (a .pth to its site-packages)."""
    import site
    import sysconfig

    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"  # a clean copy: no build/ of an earlier wheel can fill this one
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "outputs", "runs", "*.egg-info", "__pycache__", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(work / "dist"), str(source)], check=True, timeout=300,
                   capture_output=True)
    wheel = next((work / "dist").glob("strategy-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pure = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    pure.mkdir(parents=True, exist_ok=True)
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (pure / "deps.pth").write_text("\n".join(deps) + "\n")
    python = _venv_bin(venv) / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300, capture_output=True, env={**os.environ,
                                                                    "PYTHONNOUSERSITE": "1"})
    return {"wheel": wheel, "venv": venv, "python": python, "work": work}


def test_the_wheel_holds_the_configs_and_the_command(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    shipped = {Path(n).name for n in names if n.startswith("strategy/configs/")}
    assert {p.name for p in (ROOT / "configs").glob("*.yaml")} <= shipped
    assert "tiny_llama.json" in shipped
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "strategy = strategy.cli.main:main" in zipfile.ZipFile(installed["wheel"]).read(
        entry).decode()
    assert {f"strategy/cli/train_{c}.py" for c in COMMANDS} <= set(names)


def test_the_readme_tour_runs_as_written_on_the_installed_command(installed):
    """The README's tour (SFT, DPO, GRPO), each command as written, shortened to 2 optimizer
    steps, on the wheel's installed ``strategy`` command and modules (not the checkout's: the
    packaging), from a directory outside the checkout holding only the default run's data."""
    from tests.support.helpers import run_job

    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## A tour", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in tour.splitlines()]
    commands = [c for c in commands if c.startswith(("strategy ", "python -m strategy"))
                and "--help" not in c]  # the help texts: test_help_lists_the_trainers...
    trains = [c for c in commands if c.startswith("strategy ")]
    assert [c.split()[1] for c in trains] == ["sft", "dpo", "sft", "grpo"], commands
    outside, python = installed["work"] / "elsewhere", str(installed["python"])
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1",
               PATH=f"{_venv_bin(installed['venv'])}:{env['PATH']}")
    where = subprocess.run([python, "-c", "import strategy; print(strategy.__file__)"],
                           cwd=outside, env=env, capture_output=True, text=True, check=True)
    where = where.stdout.strip().splitlines()[-1]
    assert where.startswith(str(installed["venv"])), where  # the wheel's copy, not the checkout
    made = run_job([python, "-m", "strategy.demos.toy_task", "make", "outputs/default/data"],
                   300, cwd=outside, env=env)
    assert made.returncode == 0, made.stderr[-2000:]
    for command in commands:
        argv = command.split()
        if argv[0] == "strategy":
            argv += ["--nproc", "2", "--max_steps", "2", "--logging_steps", "1",
                     "--save_steps", "-1"]
        argv[0] = python if argv[0] == "python" else str(_venv_bin(installed["venv"]) / argv[0])
        proc = run_job(argv, 600, cwd=outside, env=env)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
    for out in ("sft_zero2", "dpo_zero3", "grpo"):
        rows = [json.loads(line) for line in open(outside / "outputs" / out / "logs" /
                                                    "metrics.jsonl")]
        assert [r["step"] for r in rows if "train/loss" in r] == [1, 2], (out, rows)
    for out in ("sft_zero2/model", "dpo_zero3/model", "grpo/sft", "grpo/model"):
        assert (outside / "outputs" / out / "config.json").is_file(), out


def test_the_docs_list_every_openrlhf_flag_as_the_tables_say():
    from strategy.cli.dotted import markdown_table

    page = (ROOT / "docs" / "commands.md").read_text()
    generated = page.split("(tests/test_cli.py checks it) -->\n", 1)[1].split("<!-- end", 1)[0]
    assert generated == markdown_table(), "run python -m strategy.cli.dotted into docs/commands.md"
