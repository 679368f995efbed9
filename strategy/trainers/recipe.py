"""From command-line flags to a ready strategy, tokenizer, model, loaders, optimizer and schedule.

Every example shares this; it validates every setting before the process group starts. ``Run`` is
a context manager that closes its strategy, even when training raises.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from strategy import dist
from strategy.checkpoint import CheckpointConfig, check_resumable
from strategy.config import StrategyConfig, parse_configs
from strategy.deepspeed_strategy import DeepSpeedStrategy
from strategy.errors import ConfigError
from strategy.lora import apply_lora, check_targets
from strategy.optim import OptimConfig
from strategy.parallel import check_sequence_parallel, check_tensor_parallel
from strategy.trainers import data, packing
from strategy.trainers.config import (
    DataConfig,
    DPOConfig,
    GRPOConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)
from strategy.trainers.grpo import check_grpo, prompts_per_rank
from strategy.trainers.rewards import CallableReward, ModelReward, load_reward_fn
from strategy.trainers.steps import StepPlan, plan_steps

CONFIG_CLASSES = [StrategyConfig, OptimConfig, CheckpointConfig, ModelConfig, TrainConfig,
                  DataConfig, LoraConfig, DPOConfig]


@dataclass
class Run:
    """What a training script needs, built in the right order."""

    strategy: DeepSpeedStrategy
    model_cfg: ModelConfig
    train: TrainConfig
    data: DataConfig
    lora: LoraConfig
    dpo: DPOConfig
    tokenizer: Any = None
    args: argparse.Namespace | None = None
    grpo: GRPOConfig | None = None

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None,
                  parser: argparse.ArgumentParser | None = None, grpo: bool = False) -> Run:
        """Parse flags and YAML, check everything that can be checked without ranks, then start
        the strategy. ``grpo``: also parse and check ``GRPOConfig`` (online RL scripts)."""
        classes = CONFIG_CLASSES + ([GRPOConfig] if grpo else [])
        configs, namespace = parse_configs(classes, argv, parser)
        strategy_cfg, optim_cfg, ckpt_cfg, model_cfg, train_cfg, data_cfg, lora_cfg, dpo = \
            configs[:8]
        grpo_cfg = configs[8] if grpo else None
        check_paths(model_cfg, train_cfg, data_cfg, ckpt_cfg)
        dist.from_slurm()  # the ranks srun started
        strategy_cfg.validate_world(dist.get_world_size())  # from the launcher's environment
        check_model(model_cfg, lora_cfg, data_cfg, strategy_cfg)
        if grpo_cfg is not None:
            check_grpo(strategy_cfg, train_cfg, grpo_cfg, data_cfg.max_len, dist.get_world_size())
            if grpo_cfg.reward_fn:
                load_reward_fn(grpo_cfg.reward_fn)  # importable and callable, or one line now
            if grpo_cfg.kl_coef > 0 and model_cfg.pretrain is None:
                raise ConfigError(f"kl_coef={grpo_cfg.kl_coef} is invalid: the reference is the "
                                  "--pretrain model; pass --pretrain or set --kl_coef 0")
        if train_cfg.load_checkpoint:
            check_resumable(ckpt_cfg.ckpt_path, {
                "sequence_parallel_size": strategy_cfg.sequence_parallel_size,
                "tensor_parallel_size": strategy_cfg.tensor_parallel_size})
        strategy = DeepSpeedStrategy(strategy_cfg, optim_cfg, ckpt_cfg)
        strategy.setup_distributed()
        run = cls(strategy, model_cfg, train_cfg, data_cfg, lora_cfg, dpo, args=namespace,
                  grpo=grpo_cfg)
        run.tokenizer = load_tokenizer(model_cfg)
        return run

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.strategy.__exit__(exc_type, *exc)

    # ------------------------------------------------------------ pieces
    def model(self, auto_cls: Any = None, lora_task: str = "CAUSAL_LM",
              modules_to_save: list[str] | None = None, **kwargs: Any):
        """The model to train (LoRA-wrapped when ``lora_rank`` > 0), partitioned under ZeRO-3."""
        pretrain = self.model_cfg.pretrain
        attention = {"attn_implementation": self.model_cfg.attn_implementation}
        if pretrain:
            model = self.strategy.from_pretrained(pretrain, auto_cls, **attention, **kwargs)
        else:
            source = hf_config(self.model_cfg.model_config, self.tokenizer, **kwargs)
            model = self.strategy.from_pretrained(source, auto_cls, **attention)
        if self.lora.lora_rank:
            model = apply_lora(model, self.lora.lora_rank, self.lora.lora_alpha,
                               self.lora.lora_dropout, self.lora.target_modules, lora_task,
                               modules_to_save)
        return model

    def prompt_loaders(self) -> tuple[Any, Any]:
        """(train, eval) loaders of prompts for GRPO: each rank's share of a rollout's prompts
        per batch; held-out prompts in order."""
        per_rank = prompts_per_rank(self.strategy.config, self.strategy.world_size,
                                    self.grpo.group_size)
        longest = self.data.max_len - self.grpo.max_new_tokens
        collate = data.collate_prompts(self.tokenizer.pad_token_id)
        train = data.load_prompts(self.data.dataset, self.tokenizer, self.data, longest,
                                  self.data.max_samples)
        needed = per_rank * self.strategy.data_parallel_size
        if len(train) < needed:
            raise ConfigError(f"train_batch_size={self.strategy.config.train_batch_size} is "
                              f"invalid: a rollout needs {needed} prompts but {self.data.dataset} "
                              f"has {len(train)}; lower it or add data")
        train_loader = self.strategy.setup_dataloader(train, per_rank, shuffle=True,
                                                      collate_fn=collate)
        eval_loader = None
        if self.data.eval_dataset:
            held = data.load_prompts(self.data.eval_dataset, self.tokenizer, self.data, longest)
            eval_loader = self.strategy.setup_eval_dataloader(
                held, self.strategy.config.micro_eval_batch_size, collate_fn=collate)
        return train_loader, eval_loader

    def reward(self):
        """The GRPO reward: the ``reward_fn`` callable, or the reward model as an eval engine."""
        if self.grpo.reward_fn:
            return CallableReward(self.grpo.reward_fn)
        model = self.strategy.from_pretrained(self.grpo.reward_pretrain,
                                              AutoModelForSequenceClassification, frozen=True)
        tokenizer = AutoTokenizer.from_pretrained(self.grpo.reward_pretrain)
        return ModelReward(self.strategy.prepare(model), tokenizer, self.data.max_len)

    def loaders(self, kind: str = "sft") -> tuple[Any, Any]:
        """(train, eval) loaders of ``sft`` samples, preference ``pairs`` or GRPO ``prompts``."""
        if kind == "prompts":
            return self.prompt_loaders()
        load = data.load_sft if kind == "sft" else data.load_pairs
        collate_fn = data.collate_sft if kind == "sft" else data.collate_pairs
        train = load(self.data.dataset, self.tokenizer, self.data, self.data.max_samples)
        if self.data.packing_samples:
            pack = packing.pack if kind == "sft" else packing.pack_pairs
            collate_fn = packing.collate_packed if kind == "sft" else packing.collate_packed_pairs
            train = pack(train, self.data.max_len)
        collate = collate_fn(self.tokenizer.pad_token_id)
        config = self.strategy.config
        if len(train) < config.train_batch_size:
            raise ConfigError(f"train_batch_size={config.train_batch_size} is invalid: larger than "
                              f"the {len(train)} training samples in {self.data.dataset}; lower it "
                              "or add data")
        train_loader = self.strategy.setup_dataloader(train, config.micro_train_batch_size,
                                                      shuffle=True, collate_fn=collate)
        eval_loader = None
        if self.data.eval_dataset:
            held = load(self.data.eval_dataset, self.tokenizer, self.data)
            if self.data.packing_samples:  # the loss sees rows as the training run does
                held = (packing.pack if kind == "sft" else packing.pack_pairs)(held,
                                                                               self.data.max_len)
            eval_loader = self.strategy.setup_eval_dataloader(held, config.micro_eval_batch_size,
                                                              collate_fn=collate)
        return train_loader, eval_loader

    def trainer(self, cls: type, model, kind: str = "sft", **kwargs: Any):
        """``cls`` (a Trainer subclass) wired with loaders, optimizer and schedule for ``model``."""
        train, held = self.loaders(kind)
        plan = cls.plan(self.strategy, len(train.dataset), self.train, **kwargs)
        optimizer, scheduler = self.optimizer_and_scheduler(model, plan=plan)
        return cls(self.strategy, model, optimizer=optimizer, scheduler=scheduler,
                   train_dataloader=train, eval_dataloader=held, config=self.train,
                   tokenizer=self.tokenizer, **kwargs)

    def optimizer_and_scheduler(self, model, train_loader: Any = None,
                                plan: StepPlan | None = None) -> tuple[Any, Any]:
        """The optimizer, and the schedule over ``plan`` (default: the SFT-style plan of
        ``train_loader``'s samples)."""
        if plan is None:
            plan = plan_steps(len(train_loader.dataset), self.strategy.config.train_batch_size,
                              self.train.max_epochs, self.train.max_steps)
        optimizer = self.strategy.create_optimizer(model)
        scheduler = self.strategy.create_scheduler(optimizer,
                                                   num_training_steps=max(plan.total_steps, 1))
        return optimizer, scheduler


def check_paths(model: ModelConfig, train: TrainConfig, data_cfg: DataConfig,
                ckpt: CheckpointConfig) -> None:
    """Fail before any process group starts on inputs that do not exist or outputs not writable."""
    for name, path in (("dataset", data_cfg.dataset), ("eval_dataset", data_cfg.eval_dataset),
                       ("model_config", model.model_config)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name}={path!r} is invalid: no such file; pass an existing path")
    if data_cfg.dataset is None:
        raise ConfigError("dataset=None is invalid: pass --dataset FILE (.json, .jsonl or "
                          ".parquet)")
    if (model.tokenizer or model.pretrain) is None:
        raise ConfigError("tokenizer=None is invalid: pass --tokenizer DIR (or --pretrain, which "
                          "has one)")
    if ckpt.keep_best_ckpt and data_cfg.eval_dataset is None:
        raise ConfigError(f"keep_best_ckpt={ckpt.keep_best_ckpt} is invalid: ranking checkpoints "
                          "needs --eval_dataset; pass one or set keep_best_ckpt 0")
    for name, path in (("save_path", train.save_path), ("ckpt_path", ckpt.ckpt_path),
                       ("log_dir", train.log_dir)):
        if path is not None and not _writable(path):
            raise ConfigError(f"{name}={path!r} is invalid: cannot create or write it; choose a "
                              "writable directory")


def check_model(model: ModelConfig, lora: LoraConfig, data_cfg: DataConfig,
                strategy: StrategyConfig) -> None:
    """What the model's config decides, before any rank starts: LoRA targets (on a weightless
    meta-device copy), packing, sequence parallelism."""
    if model.pretrain:
        config = AutoConfig.from_pretrained(model.pretrain)
    else:
        config = hf_config(model.model_config)
    config._attn_implementation = model.attn_implementation
    if lora.lora_rank and lora.target_modules.strip() != "all-linear":
        with torch.device("meta"):
            check_targets(AutoModelForCausalLM.from_config(config), lora.target_modules)
    if data_cfg.packing_samples:
        packing.check_packing_family(config.model_type)
    sequence = strategy.sequence_parallel_size
    check_sequence_parallel(config, sequence)
    check_tensor_parallel(config, strategy.tensor_parallel_size)
    if sequence > 1 and data_cfg.packing_samples and model.attn_implementation == "sdpa":
        raise ConfigError(f"packing_samples=True is invalid with sequence_parallel_size={sequence} "
                          "and sdpa: Ulysses drops masks, so sdpa would attend across packed "
                          "samples; use --attn_implementation flash_attention_2 (GPU) or no "
                          "packing")


def _writable(path: str) -> bool:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK)


def load_tokenizer(model: ModelConfig):
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer or model.pretrain)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def hf_config(path: str, tokenizer: Any = None, **kwargs: Any):
    """An HF config from a JSON file (``model_type`` picks the class), special ids from the
    tokenizer."""
    with open(path) as fh:
        values = json.load(fh)
    kind = values.pop("model_type", None)
    if kind not in CONFIG_MAPPING:
        raise ConfigError(f"model_config={path!r} is invalid: model_type {kind!r} unknown; use "
                          "e.g. llama, gpt2, qwen2")
    if tokenizer is not None:
        values.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    values.update(kwargs)
    return CONFIG_MAPPING[kind](**values)
