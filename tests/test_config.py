"""Single-process tests: configs, YAML/argparse binding, DeepSpeed config, groups, schedules."""

from __future__ import annotations

import glob
import math
import re
from pathlib import Path

import pytest
import torch

from strategy import ConfigError, OptimConfig, StrategyConfig, build_ds_config, build_eval_ds_config
from strategy.config import build_configs, parse_configs
from strategy.optim import get_param_groups, split_decay_params
from strategy.optim.scheduler import create_scheduler
from tests.support.models import FAMILIES

CLASSES = [StrategyConfig, OptimConfig]


def test_defaults_validate_and_match_common_use():
    s, o = build_configs(CLASSES, {})
    assert (s.zero_stage, s.bf16, s.max_norm, s.seed) == (2, False, 1.0, 42)
    assert o.adam_betas == (0.9, 0.95) and o.lr_scheduler == "cosine_with_min_lr"


def test_cli_overrides_yaml_overrides_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "zero_stage: 3\nbf16: true\nlearning_rate: 1e-4\ntrain_batch_size: 64\n"
        "ds_config_overrides: {steps_per_print: 7}\n"
    )
    (s, o), _ = parse_configs(
        CLASSES,
        [
            "--config",
            str(path),
            "--zero_stage",
            "1",
            "--adam_betas",
            "0.8",
            "0.9",
            "--no-bf16",
            "--local_rank=0",
        ],
    )
    assert s.zero_stage == 1 and s.bf16 is False and s.train_batch_size == 64
    assert o.learning_rate == 1e-4 and o.adam_betas == (0.8, 0.9)  # "1e-4" is a str to PyYAML
    assert build_ds_config(s, 2)["steps_per_print"] == 7


def test_yaml_may_set_callers_own_flags(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain", default="x")
    path = tmp_path / "c.yaml"
    path.write_text("pretrain: tiny\nzero_stage: 0\n")
    (s, _), ns = parse_configs(CLASSES, ["--config", str(path)], parser)
    assert ns.pretrain == "tiny" and s.zero_stage == 0


def test_optional_flag_unset_with_none_over_the_yaml():
    from strategy.config.cli import shipped_file
    from strategy.trainers.config import GRPOConfig
    from strategy.trainers.run import CONFIG_CLASSES

    classes = [GRPOConfig, *CONFIG_CLASSES]
    agent = str(Path(__file__).parent / "data/agents/three_turns.py")
    config = ["--config", shipped_file("grpo_toy.yaml")]
    grpo, *_ = parse_configs(classes, config)[0]
    assert grpo.reward_fn == "strategy.demos.toy_task:exact_reward"
    for word in ("none", "None", "null"):  # the YAML's reward unset: GRPO then has none
        with pytest.raises(ConfigError, match="^reward_fn=None is invalid: name a reward"):
            parse_configs(classes, config + ["--reward_fn", word])
    with pytest.raises(ConfigError, match="the environment's step returns the rewards with "
                       r"--agent_func_path; unset it \(--reward_fn none\)"):
        parse_configs(classes, config + ["--agent_func_path", agent])
    (grpo, *_), ns = parse_configs(classes, config + ["--agent_func_path", agent,
                                                      "--reward_fn", "none"])
    assert grpo.agent_func_path == agent and grpo.reward_fn is None and ns.reward_fn is None
    with pytest.raises(ConfigError, match="^bad command line: argument --zero_stage: invalid "
                       "int value: 'none'$"):  # not optional: none is no value of it
        parse_configs(CLASSES, ["--zero_stage", "none"])


def test_every_shipped_config_loads():
    files = sorted(glob.glob("configs/*.yaml"))
    assert files, "configs/ must hold at least one YAML"
    from strategy.cli.trainers import TRAINERS
    from strategy.trainers import SFTTrainer
    from strategy.trainers.run import CONFIG_CLASSES, foreign_flags, hidden_flags

    for path in files:
        first = open(path).readline()
        command = re.search(r"strategy (\w+) --nproc 2 --config (\w+)", first)
        assert first.startswith("# ") and (command or "bash examples/" in first), (
            f"{path}: no launch command")
        assert command is None or command.group(2) == Path(path).stem, path
        trainer = TRAINERS[command.group(1)][0] if command else SFTTrainer  # the default run
        hidden = hidden_flags(trainer)
        configs, _ = parse_configs(list(CONFIG_CLASSES) + list(trainer.config_classes),
                                   ["--config", path], foreign=foreign_flags(trainer),
                                   hidden=hidden)  # its trainer's keys only
        configs[0].validate_world(2)  # every shipped config runs at 2 ranks


BAD = [
    ({"ring_attn_size": 2}, "ring_attn_size=2 is invalid: ring attention is not supported; "
                            "split sequences with DeepSpeed Ulysses: --sequence_parallel_size N"),
    ({"param_dtype": "fp8"}, "param_dtype='fp8' is invalid: use bf16, fp16 or fp32"),
    ({"param_dtype": "fp32", "bf16": True}, "--bf16 says otherwise"),
    ({"ds_tensor_parallel_size": 2, "tensor_parallel_size": 4}, "ds_tensor_parallel_size=2"),
    ({"zero_stage": 4}, "zero_stage=4 is invalid: use 0, 1, 2 or 3"),
    ({"zero_stage": -1}, "zero_stage=-1"),
    ({"bf16": True, "fp16": True}, "bf16 and fp16 are exclusive"),
    ({"micro_train_batch_size": 0}, "micro_train_batch_size=0 is invalid"),
    ({"train_batch_size": 0}, "train_batch_size=0 is invalid"),
    ({"train_batch_size": 10, "micro_train_batch_size": 4}, "multiple of micro_train_batch_size=4"),
    ({"micro_eval_batch_size": -2}, "micro_eval_batch_size=-2"),
    ({"zpg": 0}, "zpg=0"),
    ({"max_norm": -1.0}, "max_norm=-1.0"),
    ({"adam_offload": True, "zero_stage": 0}, "optimizer offload needs ZeRO"),
    ({"param_offload": True, "zero_stage": 2}, "parameter offload needs ZeRO-3"),
    ({"grad_accum_dtype": "fp64"}, "grad_accum_dtype='fp64'"),
    ({"ds_config_overrides": [1, 2]}, "ds_config_overrides=[1, 2] is invalid: expected dict"),
    ({"learning_rate": -1e-5}, "learning_rate=-1e-05 is invalid: use a positive"),
    ({"learning_rate": 0}, "learning_rate=0.0"),
    ({"learning_rate": "fast"}, "learning_rate='fast' is invalid: expected float"),
    ({"lr_warmup_ratio": 1.5}, "lr_warmup_ratio=1.5"),
    ({"min_lr_ratio": -0.1}, "min_lr_ratio=-0.1"),
    ({"l2": -0.01}, "l2=-0.01"),
    ({"adam_betas": [0.9, 1.0]}, "adam_betas=(0.9, 1.0)"),
    ({"adam_betas": [0.9]}, "adam_betas=[0.9] is invalid: expected tuple"),
    ({"adam_eps": 0}, "adam_eps=0.0"),
    ({"lr_scheduler": "cosine_forever"}, "lr_scheduler='cosine_forever'"),
    ({"zero_stage": "two"}, "zero_stage='two' is invalid: expected int"),
    ({"zero_stage": 2.5}, "zero_stage=2.5 is invalid: expected int"),
    ({"bf16": "yes"}, "bf16='yes' is invalid: expected bool"),
    ({"seed": True}, "seed=True is invalid: expected int"),
    ({"zero_stag": 2}, "unknown key 'zero_stag'; did you mean 'zero_stage'?"),
    ({"wandb_key": "x"}, "unknown key 'wandb_key'; remove it"),
]


@pytest.mark.parametrize("values,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_config_gives_one_clear_line(values, message):
    with pytest.raises(ConfigError) as err:
        build_configs(CLASSES, values)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_batch_must_divide_by_world_size():
    cfg = StrategyConfig(micro_train_batch_size=4, train_batch_size=12)
    with pytest.raises(ConfigError, match=r"train_batch_size=12 .* 4 x 2 = 8"):
        build_ds_config(cfg, world_size=2)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        parse_configs(CLASSES, ["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_stage: [1,\n")
    with pytest.raises(ConfigError, match="not YAML"):
        parse_configs(CLASSES, ["--config", str(bad)])
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_configs(CLASSES, ["--config", str(bad)])
    bad.write_text("zero_stage: 9\n")
    with pytest.raises(ConfigError, match="zero_stage=9"):
        parse_configs(CLASSES, ["--config", str(bad)])


# ---------------------------------------------------------------- DeepSpeed config


def test_ds_config_stage3_offload_bf16():
    cfg = StrategyConfig(
        zero_stage=3,
        bf16=True,
        adam_offload=True,
        param_offload=True,
        micro_train_batch_size=2,
        train_batch_size=16,
        max_norm=0.5,
        zpg=2,
        grad_accum_dtype="fp32",
        overlap_comm=True,
        ds_config_overrides={"zero_optimization": {"reduce_bucket_size": 123}},
    )
    ds = build_ds_config(cfg, world_size=4)
    z = ds["zero_optimization"]
    batch = (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        ds["train_batch_size"],
    )
    assert batch == (2, 2, 16)
    assert (
        z["stage"] == 3
        and z["offload_optimizer"]["device"] == "cpu"
        and z["offload_param"]["device"] == "cpu"
    )
    assert (
        z["stage3_gather_16bit_weights_on_model_save"] is True and z["zero_hpz_partition_size"] == 2
    )
    assert (
        z["overlap_comm"] is True and z["reduce_bucket_size"] == 123
    )  # override merged, siblings kept
    assert ds["bf16"]["enabled"] and "fp16" not in ds and ds["gradient_clipping"] == 0.5
    assert ds["data_types"]["grad_accum_dtype"] == "fp32"
    ev = build_eval_ds_config(cfg, world_size=4)
    assert ev["zero_optimization"]["stage"] == 3 and "optimizer" not in ev and ev["bf16"]["enabled"]


def test_ds_config_stage2_fp16_no_offload():
    cfg = StrategyConfig(zero_stage=2, fp16=True, micro_train_batch_size=4, train_batch_size=8)
    ds = build_ds_config(cfg, world_size=2)
    z = ds["zero_optimization"]
    assert (
        z["offload_optimizer"]["device"] == "none"
        and "stage3_gather_16bit_weights_on_model_save" not in z
    )
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0 and not ds["bf16"]["enabled"]
    assert ds["gradient_accumulation_steps"] == 1 and "data_types" not in ds
    assert build_eval_ds_config(cfg, 2)["zero_optimization"]["stage"] == 0


def test_overrides_do_not_mutate_config():
    cfg = StrategyConfig(ds_config_overrides={"zero_optimization": {"stage": 1}})
    build_ds_config(cfg, 1)["zero_optimization"]["stage"] = 99
    assert cfg.ds_config_overrides == {"zero_optimization": {"stage": 1}}
    assert build_ds_config(cfg, 1)["zero_optimization"]["stage"] == 1


# ---------------------------------------------------------------- parameter groups

EXPECTED_NO_DECAY = {
    "llama": lambda n: n.endswith("norm.weight"),
    "gpt2": lambda n: ".ln_" in n or n.startswith("transformer.ln_f") or n.endswith(".bias"),
    "qwen2": lambda n: n.endswith("norm.weight") or n.endswith("_proj.bias"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_param_groups_by_family(family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(FAMILIES[family]())
    decay, no_decay = split_decay_params(model)
    names = dict(model.named_parameters())
    assert {n for n, _ in decay} | {n for n, _ in no_decay} == set(
        names
    )  # all trainable, once each
    assert {n for n, _ in no_decay} == {n for n in names if EXPECTED_NO_DECAY[family](n)}
    assert no_decay and decay
    if family != "gpt2":  # untied: the head must be optimized (HF's `.model` would drop it)
        assert "lm_head.weight" in {n for n, _ in decay}
    groups = get_param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_lora_groups_drop_empty_and_frozen():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.support.models import tiny_llama

    model = get_peft_model(
        AutoModelForCausalLM.from_config(tiny_llama()),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    groups = get_param_groups(model, 0.1)
    assert len(groups) == 1 and all("lora_" in n for n in groups[0]["names"])
    assert len(groups[0]["params"]) == sum(p.requires_grad for p in model.parameters())


def test_no_trainable_params_is_a_clear_error():
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        get_param_groups(model, 0.0)


# ---------------------------------------------------------------- schedules


def test_cosine_with_min_lr_values():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = create_scheduler(
        opt, "cosine_with_min_lr", num_training_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1
    )
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 2) / 8)) for t in range(2, 10)]
    expected = [t / 2 for t in range(2)] + cosine
    assert lrs == pytest.approx(expected, abs=1e-9)


def test_scheduler_rejects_bad_warmup():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="num_warmup_steps=20"):
        create_scheduler(opt, num_training_steps=10, num_warmup_steps=20)
    with pytest.raises(ValueError, match="not both"):
        create_scheduler(opt, num_training_steps=10, num_warmup_steps=1, warmup_ratio=0.1)


def test_openrlhf_spellings_set_ours():
    from strategy import StrategyConfig

    config = StrategyConfig(param_dtype="bf16", ds_tensor_parallel_size=2, zero_stage=1)
    assert (config.bf16, config.fp16, config.tensor_parallel_size) == (True, False, 2)
    assert not StrategyConfig(param_dtype="fp32").bf16
