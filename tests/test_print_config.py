"""``--print_config``: every command checks its settings as a run would, prints them as YAML that
``--config`` loads back to the same settings, and exits 0 without a model, a rank or Ray; a
refused setting is the run's own one line."""

from __future__ import annotations

import importlib

import pytest
import yaml

from strategy.errors import ConfigError

DATA = {"sft": "train.jsonl", "rm": "pairs_train.jsonl", "dpo": "pairs_train.jsonl",
        "orpo": "pairs_train.jsonl", "simpo": "pairs_train.jsonl", "kto": "pairs_train.jsonl",
        "grpo": "train.jsonl", "ppo": "train.jsonl", "distill": "train.jsonl"}
REWARD = ["--reward_fn", "strategy.demos.toy_task:reversal_reward", "--group_size", "3"]
NEEDS = {"grpo": REWARD, "ppo": REWARD,
         "distill": ["--teacher_pretrain", "TOY/init"]}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("print_config")
    toy_root(root, n_train=20, n_test=6, model_dir="init")
    return root


def _argv(toy, command: str) -> list[str]:
    argv = ["--pretrain", f"{toy}/init", "--dataset", f"{toy}/data/{DATA[command]}",
            "--save_path", f"{toy}/{command}/model", "--ckpt_path", f"{toy}/{command}/ckpt",
            "--log_dir", f"{toy}/{command}/logs", "--learning_rate", "3e-6", "--zero_stage", "3",
            "--adam_betas", "0.8", "0.99", "--micro_train_batch_size", "2",
            "--train_batch_size", "6", *NEEDS.get(command, [])]
    return [arg.replace("TOY", str(toy)) for arg in argv]


def _printed(capsys, main, argv: list[str]) -> str:
    """What ``main(argv + ['--print_config'])`` writes on stdout; it must exit 0."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--print_config"])
    assert stop.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("command", list(DATA))
def test_print_config_prints_what_config_loads_back(toy, tmp_path, capsys, monkeypatch, command):
    """Each trainer's module: the flags given are in the YAML with their values, the file loads
    back (``--config``) to the very same YAML, and no process group started."""
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch, world_size=None)
    main = importlib.import_module(f"strategy.cli.train_{command}").main
    first = _printed(capsys, main, _argv(toy, command))
    values = yaml.safe_load(first)
    assert values["learning_rate"] == 3e-6 and values["zero_stage"] == 3, first
    assert values["adam_betas"] == [0.8, 0.99] and values["train_batch_size"] == 6
    assert values["pretrain"] == f"{toy}/init"
    assert "# StrategyConfig\n" in first and "print_config" not in values
    saved = tmp_path / "settings.yaml"
    saved.write_text(first)
    assert _printed(capsys, main, ["--config", str(saved)]) == first


def test_print_config_refuses_a_setting_as_the_run_does(toy, capsys, monkeypatch):
    """``--train_batch_size 6`` of micro batches of 2 at 2 ranks (``strategy sft --nproc 2``;
    fine at 1): the run's own line, with or without ``--print_config``; the world size is the
    launch's."""
    from strategy.cli.main import main
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch, world_size=None)
    lines = []
    for extra in ([], ["--print_config"]):
        with pytest.raises(SystemExit) as stop:
            main(["sft", "--nproc", "2", *_argv(toy, "sft"), *extra])
        assert stop.value.code == 2
        lines.append(capsys.readouterr().err)
    assert lines[0] == lines[1], lines
    assert lines[0].startswith("error: train_batch_size=6 is invalid: ") and lines[0].endswith(
        "data-parallel ranks = 2 x 2 = 4\n") and lines[0].count("\n") == 1, lines


def test_the_strategy_command_prints_without_starting_ranks(toy, capsys, monkeypatch):
    """``strategy grpo --nproc 2 --print_config``: the settings at 2 ranks, exit 0, no launcher
    exec'd (``os.execve`` would replace this process)."""
    import os

    from strategy.cli.main import main

    def launched(*args):
        raise AssertionError("the launcher started")

    monkeypatch.setattr(os, "execve", launched)
    text = _printed(capsys, main, ["grpo", "--nproc", "2", *_argv(toy, "grpo"),
                                   "--train_batch_size", "12"])
    assert yaml.safe_load(text)["reward_fn"] == "strategy.demos.toy_task:reversal_reward"


def test_the_ray_entry_point_prints_without_joining_ray(toy, capsys):
    """``python -m strategy.cli.train_ppo_ray ... --print_config``: OpenRLHF's placement flags
    in our names (the actor group's world size checked), exit 0, Ray never initialised."""
    ray = pytest.importorskip("ray")
    from strategy.cli.train_ppo_ray import main

    argv = ["--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
            "--vllm.num_engines", "1", "--algo.advantage.estimator", "group_norm",
            "--rollout_engine", "vllm", *_argv(toy, "grpo"), "--train_batch_size", "12"]
    values = yaml.safe_load(_printed(capsys, main, argv))
    assert values["ray"] is True and values["actor_num_gpus_per_node"] == 2
    assert values["vllm_num_engines"] == 1 and values["advantage_estimator"] == "group_norm"
    assert not ray.is_initialized()


def test_serve_rm_prints_its_settings(toy, tmp_path, capsys):
    """``python -m strategy.cli.serve_rm`` with OpenRLHF's flags: its settings, no model loaded
    (the path is not one), loaded back the same by ``strategy serve-rm``."""
    from strategy.cli.serve_rm import main

    argv = ["--reward.model_name_or_path", f"{toy}/no_model_here", "--port", "5123",
            "--reward.normalize_enable"]
    first = _printed(capsys, main, argv)
    values = yaml.safe_load(first)
    assert values["reward_pretrain"] == f"{toy}/no_model_here" and values["port"] == 5123
    assert values["normalize_reward"] is True and values["host"] == "127.0.0.1"
    saved = tmp_path / "serve.yaml"
    saved.write_text(first)
    from strategy.cli.main import main as strategy  # the same as `strategy serve-rm`

    assert _printed(capsys, strategy, ["serve-rm", "--config", str(saved)]) == first


def test_a_bad_setting_is_the_same_error_with_print_config(toy, monkeypatch):
    """In a trainer's module too (``Run.check_args``), the ConfigError is the run's."""
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch, world_size=None)
    errors = []
    for extra in ([], ["--print_config"]):
        with pytest.raises(ConfigError) as err:
            Run.check_args([*_argv(toy, "sft"), "--learning_rate", "-1", *extra])
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "learning_rate=-1.0 is invalid" in errors[0]
