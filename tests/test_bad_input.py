"""Bad settings through the real entry point (``Run.from_args``): each fails with its one-line
message before any process group starts (``deepspeed.init_distributed`` is made to fail loudly if
reached)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from strategy import ConfigError, StrategyError


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from strategy.demos.toy_task import make_tokenizer

    root = tmp_path_factory.mktemp("bad")
    make_tokenizer(str(root / "tok"))
    (root / "d.jsonl").write_text(json.dumps({"input": "ab=", "output": "ba"}) + "\n")
    tiny = {"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2}
    models = {"three_heads": {"model_type": "llama", "num_attention_heads": 3,
                              "num_key_value_heads": 3, **tiny},
              "three_kv_heads": {"model_type": "llama", "num_attention_heads": 6,
                                 "num_key_value_heads": 3, **tiny},
              "gpt2": {"model_type": "gpt2", "n_embd": 48, "n_head": 4, "n_layer": 2},
              "opt": {"model_type": "opt", "hidden_size": 48, "num_attention_heads": 4,
                      "ffn_dim": 64, "word_embed_proj_dim": 48, "num_hidden_layers": 2}}
    for name, values in models.items():
        (root / f"{name}.json").write_text(json.dumps(values))
    (root / "llama").mkdir()  # a checkpoint's config alone: the checks read nothing else
    llama = json.load(open("configs/tiny_llama.json"))
    (root / "llama" / "config.json").write_text(json.dumps({**llama, "vocab_size": 64}))
    return root


def _base(toy) -> dict:
    return {
        "model_config": "configs/tiny_llama.json",
        "tokenizer": f"{toy}/tok",
        "dataset": f"{toy}/d.jsonl",
        "micro_train_batch_size": 1,
        "train_batch_size": 2,
        "save_path": f"{toy}/out",
        "log_dir": None,
        "ckpt_path": f"{toy}/ckpt",
    }


CASES = [
    # OpenRLHF's flags that are not here yet: one line naming ours
    ({"aux_loss_coef": 0.01}, "aux_loss_coef=0.01 is invalid: llama has no router loss"),
    ({"disable_ds_ckpt": True, "load_checkpoint": True},
     "disable_ds_ckpt=True is invalid: it saves no DeepSpeed state"),
    ({"loss_type": "dpo"}, "loss_type='dpo' is invalid: use one of sigmoid, ipo, hinge, robust"),
    ({"streaming": True}, "streaming=True is invalid without --max_steps"),
    ({"zero_stage": 4}, "zero_stage=4 is invalid"),
    ({"bf16": True, "fp16": True}, "bf16 and fp16 are exclusive"),
    (
        {"train_batch_size": 3},
        "train_batch_size=3 is invalid: must be a multiple of micro_train_batch_size x "
        "data-parallel ranks = 1 x 2 = 2",
    ),
    ({"adam_offload": True, "zero_stage": 0}, "optimizer offload needs ZeRO"),
    ({"param_offload": True, "zero_stage": 1}, "parameter offload needs ZeRO-3"),
    ({"offload_ratio": 0.5, "zero_stage": 2, "adam_offload": True}, "offload_ratio=0.5 is invalid"),
    (
        {"ds_config_overrides": {"gradient_clippin": 1.0}},
        "unknown key 'gradient_clippin' that DeepSpeed would ignore",
    ),
    (
        {"ds_config_overrides": {"zero_optimization": {"stage3_param_persitence_threshold": 0}}},
        "zero_optimization.stage3_param_persitence_threshold is invalid",
    ),
    ({"timeout_minutes": 0}, "timeout_minutes=0.0 is invalid"),
    ({"learning_rate": -1}, "learning_rate=-1.0 is invalid"),
    ({"optimizer": "sgd"}, "optimizer='sgd' is invalid"),
    ({"lr_scheduler": "warmup_forever"}, "lr_scheduler='warmup_forever' is invalid"),
    ({"max_epochs": 0}, "max_epochs=0 is invalid"),
    ({"eval_steps": 0}, "eval_steps=0 is invalid"),
    ({"save_steps": -5}, "save_steps=-5 is invalid"),
    ({"beta": 0}, "beta=0.0 is invalid"),
    ({"label_smoothing": 0.5}, "label_smoothing=0.5 is invalid"),
    ({"max_ckpt_mem": 0}, "max_ckpt_mem=0.0 is invalid"),
    ({"checkpoint_storage": "nfs"}, "checkpoint_storage='nfs' is invalid: use one of auto, "
                                     "shared, node_local"),
    ({"model_config": None}, "pretrain=None is invalid: set --pretrain"),
    ({"model_config": None, "pretrain": "TOY/tok"}, "/tok' is invalid: not a model transformers "
                                                    "can load (Unrecognized model in "),
    (
        {"model_config": "configs/missing.json"},
        "model_config='configs/missing.json' is invalid: no such file",
    ),
    ({"dataset": "nope/train.jsonl"}, "dataset='nope/train.jsonl' is invalid: no such file"),
    ({"dataset": None}, "dataset=None is invalid"),
    (
        {"eval_dataset": "nope/test.jsonl"},
        "eval_dataset='nope/test.jsonl' is invalid: no such file",
    ),
    ({"tokenizer": None}, "tokenizer=None is invalid"),
    ({"save_path": "FILE/out"}, "/d.jsonl/out' is invalid: cannot create or write it"),
    ({"max_len": 1}, "max_len=1 is invalid"),
    ({"overlong": "cut"}, "overlong='cut' is invalid"),
    ({"max_samples": 0}, "max_samples=0 is invalid"),
    ({"lora_rank": -1}, "lora_rank=-1 is invalid"),
    ({"lora_rank": 4, "lora_dropout": 1.0}, "lora_dropout=1.0 is invalid"),
    (
        {"lora_rank": 4, "target_modules": "q_proj,qkv_proj"},
        "the model has no linear layer named ['qkv_proj']",
    ),
    # sequence and tensor parallelism, packing: before any process group starts
    ({"sequence_parallel_size": 3}, "sequence_parallel_size=3 is invalid: the world size 2 does "
                                    "not divide by it"),
    ({"sequence_parallel_size": 2, "model_config": "TOY/three_heads.json"},
     "sequence_parallel_size=2 is invalid: the model's 3 attention heads do not divide by it"),
    ({"sequence_parallel_size": 2, "attn_implementation": "eager"},
     "sequence_parallel_size=2 is invalid: attention 'eager' cannot run under Ulysses"),
    ({"sequence_parallel_size": 2, "model_config": "TOY/gpt2.json"},
     "sequence_parallel_size=2 is invalid: model_type 'gpt2' (sliding window None) is not "
     "supported"),
    ({"attn_implementation": "sdpa_varln"}, "attn_implementation='sdpa_varln' is invalid: no "
                                            "such attention kernel; use one of eager, "),
    ({"sequence_parallel_size": 2, "model_config": "TOY/three_kv_heads.json"},
     "sequence_parallel_size=2 is invalid: the model's 3 key/value heads neither divide by it"),
    ({"packing_samples": True, "model_config": "TOY/opt.json"},
     "packing_samples=True is invalid: model_type 'opt' does not find packed samples"),
    ({"pack_dataset": True, "model_config": "TOY/opt.json"},
     "pack_dataset=True is invalid: model_type 'opt' does not find packed samples"),
    ({"sequence_parallel_size": 2, "tensor_parallel_size": 2},
     "tensor_parallel_size=2 is invalid: tensor and sequence parallelism together"),
    ({"tensor_parallel_size": 2, "zero_stage": 3}, "tensor_parallel_size=2 is invalid: AutoTP "
                                                   "trains with ZeRO 0-2"),
    ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 is invalid: the world size 2 does not "
                                  "divide by it"),
    ({"tensor_parallel_size": 2, "model_config": "TOY/three_heads.json"},
     "tensor_parallel_size=2 is invalid: the model's 3 attention heads do not divide by it; use a "
     "divisor of 3"),
    ({"tensor_parallel_size": 2, "model_config": "TOY/three_kv_heads.json"},
     "tensor_parallel_size=2 is invalid: the model's 3 key/value heads do not divide by it; use a "
     "divisor of 3"),
    ({"tensor_parallel_size": 2, "model_config": "TOY/gpt2.json"},
     "tensor_parallel_size=2 is invalid: model_type 'gpt2' has no tensor-parallel plan in "
     "transformers; use a LLaMA/Qwen2-style model, or size 1"),
    # moving average of the weights
    ({"ema_beta": 1.0}, "ema_beta=1.0 is invalid: use a decay in [0, 1), e.g. 0.999 (0: off)"),
    ({"save_ema": True}, "save_ema=True is invalid: there is no moving average to export; set "
                         "--ema_beta too"),
    # QLoRA
    ({"load_in_4bit": True}, "load_in_4bit=True is invalid: 4-bit weights do not train; add "
                             "--lora_rank R (QLoRA)"),
    ({"load_in_4bit": True, "lora_rank": 4}, "load_in_4bit=True is invalid: quantisation loads a "
                                             "checkpoint's weights; pass --pretrain"),
    ({"load_in_4bit": True, "lora_rank": 4, "pretrain": "TOY/llama", "zero_stage": 3,
      "param_offload": True}, "param_offload=True is invalid: 4-bit weights cannot be offloaded"),
    ({"load_in_4bit": True, "lora_rank": 4, "pretrain": "TOY/llama", "tensor_parallel_size": 2},
     "tensor_parallel_size=2 is invalid: AutoTP cannot split 4-bit weights"),
]


def _argv(values: dict) -> list[str]:
    out = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(f"--{key}" if value else f"--no-{key}")
            continue
        out.append(f"--{key}={json.dumps(value) if isinstance(value, dict) else value}")
    return out


@pytest.mark.parametrize("change,message", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_setting_fails_before_process_group(toy, monkeypatch, change, message):
    from strategy.trainers import DPOConfig, DPOTrainer
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    dpo = {f.name for f in dataclasses.fields(DPOConfig)}
    trainer = DPOTrainer if set(change) & dpo else None  # DPO's flags are DPO's command's

    forbid_process_group(monkeypatch)
    with pytest.raises(ConfigError) as err:
        change = {
            k: v.replace("FILE", f"{toy}/d.jsonl").replace("TOY", str(toy))
            if isinstance(v, str) else v
            for k, v in change.items()
        }
        Run.from_args(_argv({**_base(toy), **change}), trainer=trainer)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_yaml_with_bad_key_fails_the_same_way(toy, tmp_path, monkeypatch):
    from strategy.trainers.run import Run

    path = tmp_path / "c.yaml"
    path.write_text("zero_stage: 2\nlearning_rat: 1.0e-5\n")
    with pytest.raises(
        ConfigError, match=r"c.yaml: unknown key 'learning_rat'; did you mean 'learning_rate'\?"
    ):
        Run.from_args(["--config", str(path)])
    path.write_text("zero_stage: three\n")
    with pytest.raises(ConfigError, match=r"zero_stage='three' is invalid: expected int"):
        Run.from_args(["--config", str(path)])


@pytest.mark.parametrize("fp16_supported", [False, True], ids=["no_fp16", "fp16"])
def test_fp16_refused_where_deepspeed_cannot_train_it(toy, monkeypatch, fp16_supported):
    """The accelerator's own answer decides: DeepSpeed's CPU accelerator says yes where the CPU has
    mkldnn fp16 (AMX-FP16/AVX512-FP16, as on CI's machine) and no elsewhere (as here), so both
    answers are set here, and a yes must get past the check to the process group."""
    from deepspeed.accelerator import get_accelerator

    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: fp16_supported)
    forbid_process_group(monkeypatch, world_size=None)
    if fp16_supported:
        want = pytest.raises(AssertionError, match="init_distributed was reached")
    else:
        want = pytest.raises(
            ConfigError,
            match=r"fp16=True is invalid: DeepSpeed has no fp16 training on this machine's "
            r"accelerator \(cpu\); use --bf16",
        )
    with want:
        Run.from_args(_argv({**_base(toy), "fp16": True}))


def test_a_bad_flag_is_one_line_without_a_traceback(tmp_path):
    """What a person sees from a launched script: one line naming the field, exit status != 0.
    (argparse's own refusals, an unknown flag: test_an_unknown_flag_is_argparse_s_one_line.)"""
    flags, message = ["--zero_stage", "7"], "zero_stage=7 is invalid"
    import os
    import sys

    from strategy.dist import free_port
    from tests.support.helpers import run_job

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    (tmp_path / "train.jsonl").write_text('{"input": "ab=", "output": "ba"}\n')
    proc = run_job(
        [sys.executable, "-m", "strategy.cli.train_sft", "--model_config",
         "configs/tiny_llama.json",
         "--tokenizer", "strategy/demos", "--dataset", str(tmp_path / "train.jsonl"), *flags],
        120, env=env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if message in line]
    assert len(errors) == 1, proc.stderr


def test_an_unknown_flag_is_one_line(tmp_path, monkeypatch):
    """An unknown flag (never taken for a prefix: --loss is not --loss_weighting) stops the
    command's argument parsing with one line: the trainers that take it, or a close match."""
    from tests.support.helpers import forbid_process_group, load_example

    (tmp_path / "train.jsonl").write_text('{"input": "ab=", "output": "ba"}\n')
    forbid_process_group(monkeypatch)
    argv = ["--model_config", "configs/tiny_llama.json", "--tokenizer", "strategy/demos",
            "--dataset", str(tmp_path / "train.jsonl")]
    with pytest.raises(ConfigError, match="^--loss is not a flag of sft; rm takes it$"):
        load_example("train_sft")(argv + ["--loss", "sigmoid"])
    with pytest.raises(ConfigError, match="^--loss_weightin is not a flag here; did you mean "
                                          "--loss_weighting"):
        load_example("train_sft")(argv + ["--loss_weightin", "step"])


def test_reward_model_under_sequence_parallelism_is_refused_before_process_group(toy,
                                                                                   monkeypatch):
    """The trainer's own check_settings runs in Run.from_args (the README's claim)."""
    from tests.support.helpers import forbid_process_group, load_example

    forbid_process_group(monkeypatch)
    with pytest.raises(ConfigError, match="sequence_parallel_size=2 is invalid: a reward model"):
        load_example("train_rm")(_argv({**_base(toy), "sequence_parallel_size": 2}))


def test_openrlhf_logging_flags_keep_their_meaning(monkeypatch):
    from strategy.cli.dotted import openrlhf_argv, wandb_key_taken
    from strategy.trainers.config import TrainConfig

    assert TrainConfig(use_tensorboard="tb/run1").log_dir == "tb/run1"
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    argv = wandb_key_taken(["--use_wandb", "abc123", "--bf16", "--use_wandb=True"])
    assert argv == ["--use_wandb", "--bf16", "--use_wandb"]
    assert __import__("os").environ["WANDB_API_KEY"] == "abc123"
    assert openrlhf_argv(["--target_modules", "q_proj", "v_proj", "--lora_rank", "8"]) == [
        "--target_modules", "q_proj,v_proj", "--lora_rank", "8"]


def test_openrlhf_rm_loss_flag(toy, monkeypatch):
    """OpenRLHF's RM ``--loss sigmoid|logexpsigmoid`` (one function) is taken; another is one
    line naming the choices."""
    from strategy.trainers import RewardModelTrainer
    from strategy.trainers.config import RewardConfig
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    assert RewardConfig(loss="logexpsigmoid").loss == "logexpsigmoid"
    forbid_process_group(monkeypatch)
    with pytest.raises(ConfigError, match="loss='hinge' is invalid: use sigmoid"):
        Run.from_args(_argv({**_base(toy), "loss": "hinge"}), trainer=RewardModelTrainer)


@pytest.mark.parametrize("script, change, message", [
    ("train_orpo", {"ref_pretrain": "TOY/tok"}, "--ref_pretrain is not a flag of orpo; dpo, grpo, "
     "kto and ppo take it"),
    ("train_simpo", {"beta": 0.5}, "--beta is not a flag of simpo; distill and dpo take it"),
    ("train_simpo", {"ipo": True}, "--ipo is not a flag of simpo; dpo takes it"),
    ("train_kto", {"packing_samples": True}, "packing_samples=True is invalid: KTO's mismatched"),
    ("train_kto", {"sequence_parallel_size": 2}, "sequence_parallel_size=2 is invalid: KTO runs "
     "without"),
    ("train_kto", {"zero_stage": 3}, "model_config='configs/tiny_llama.json' is invalid: a "
     "reference copied from fresh weights needs ZeRO 0-2"),
    ("train_dpo", {"lora_rank": 4, "target_modules": "q_proj"}, "a reference copied from fresh "
     "weights needs ZeRO 0-2 without LoRA"),
    ("train_kto", {"kto_beta": 0}, "kto_beta=0.0 is invalid: use a positive number"),
    ("train_orpo", {"aux_loss_coef": 0.1}, "--aux_loss_coef is not a flag of orpo; sft takes it"),
    ("train_kto", {}, "label_key='label' is invalid: TOY/d.jsonl row 0 has no 'label' (nor "
     "'chosen'), only ['input', 'output']"),
])
def test_preference_trainers_refuse_settings_before_process_group(toy, monkeypatch, script,
                                                                   change, message):
    """ORPO/SimPO refuse a reference and DPO's flags, KTO packing, SP and a reference it cannot
    copy; each one line, from the trainer's check_settings in Run.from_args."""
    from tests.support.helpers import forbid_process_group, load_example

    forbid_process_group(monkeypatch)
    change = {k: v.replace("TOY", str(toy)) if isinstance(v, str) else v
              for k, v in change.items()}
    message = message.replace("TOY", str(toy))
    with pytest.raises(StrategyError) as err:
        load_example(script)(_argv({**_base(toy), **change}))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("change,message", [
    ({"temperature": 0}, "temperature=0.0 is invalid: use a positive temperature, e.g. 1.0"),
    ({"top_p": 0}, "top_p=0.0 is invalid: use a probability in (0, 1]"),
    ({"top_p": 1.5}, "top_p=1.5 is invalid: use a probability in (0, 1]"),
    ({"top_k": -1}, "top_k=-1 is invalid: use 0 (all tokens) or a positive count"),
    ({"clip_eps": 1.0}, "clip_eps=1.0 is invalid: use a value in (0, 1), e.g. 0.2"),
    ({"clip_eps": 0}, "clip_eps=0.0 is invalid: use a value in (0, 1), e.g. 0.2"),
], ids=["temperature=0", "top_p=0", "top_p=1.5", "top_k=-1", "clip_eps=1", "clip_eps=0"])
def test_grpo_sampling_and_clip_out_of_range(toy, monkeypatch, change, message):
    from strategy.trainers import GRPOTrainer
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch)
    reward = {"reward_fn": "strategy.demos.toy_task:reversal_reward"}
    with pytest.raises(ConfigError) as err:
        Run.from_args(_argv({**_base(toy), **reward, **change}), trainer=GRPOTrainer)
    assert str(err.value) == message


def test_slurm_without_master_addr(toy, monkeypatch):
    """Under srun (Slurm's task variables, no RANK) the rendezvous address must be exported."""
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch, world_size=None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so whatever from_slurm sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    with pytest.raises(ConfigError) as err:
        Run.from_args(_argv(_base(toy)))
    assert str(err.value) == ("MASTER_ADDR=None is invalid: under srun export MASTER_ADDR (the "
                              "first node's address) and MASTER_PORT before launching")


def test_best_metric_that_evaluation_does_not_report():
    """Checked at the first save: the metric best-K retention ranks by must be one evaluation
    reports (here only ``loss``)."""
    from types import SimpleNamespace

    from strategy.checkpoint import CheckpointConfig
    from strategy.trainers.loop.trainer import Trainer

    ckpt = CheckpointConfig(ckpt_path="unused", keep_best_ckpt=2, best_metric="accuracy")
    trainer = SimpleNamespace(strategy=SimpleNamespace(checkpoint=ckpt), eval_dataloader=[],
                              global_step=4, last_eval=(4, {"loss": 1.5}))
    with pytest.raises(ConfigError) as err:
        Trainer._checkpoint_metric(trainer)
    assert str(err.value) == ("best_metric='accuracy' is invalid: evaluation reports ['loss']; "
                              "pick one")
    trainer.strategy.checkpoint = CheckpointConfig(ckpt_path="unused", keep_best_ckpt=2)
    assert Trainer._checkpoint_metric(trainer) == 1.5  # the metric it does report ranks


def test_cpu_adam_without_offload_on_an_accelerator(monkeypatch):
    from types import SimpleNamespace

    import torch

    from strategy.optim import factory

    monkeypatch.setattr(factory, "get_accelerator",
                        lambda: SimpleNamespace(device_name=lambda: "cuda"))
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}]
    with pytest.raises(ConfigError) as err:
        factory.build_optimizer(groups, offload=False, lr=1e-3, betas=(0.9, 0.99), eps=1e-8,
                                name="cpu_adam")
    assert str(err.value) == ("optimizer='cpu_adam' is invalid: DeepSpeedCPUAdam steps CPU "
                              "tensors only; set --adam_offload, or use fused_adam or hybrid_adam")


def test_train_batch_size_larger_than_the_dataset(toy):
    """Known once the data is read (after the process group starts): checked before any loader."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from strategy.trainers.config import DataConfig
    from strategy.trainers.data.spec import SFT

    run = SimpleNamespace(
        data=DataConfig(dataset=f"{toy}/d.jsonl"),
        tokenizer=AutoTokenizer.from_pretrained(f"{toy}/tok"),
        strategy=SimpleNamespace(config=SimpleNamespace(train_batch_size=2,
                                                        micro_train_batch_size=1)))
    with pytest.raises(ConfigError) as err:
        SFT.loaders(run.strategy, run.tokenizer, run.data)
    assert str(err.value) == (f"train_batch_size=2 is invalid: larger than the 1 training samples "
                              f"in {toy}/d.jsonl; lower it or add data")
