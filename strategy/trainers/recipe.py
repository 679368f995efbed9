"""From command-line flags to a ready strategy, tokenizer, model, loaders, optimizer and schedule.

Every example shares this; it validates every setting before the process group starts.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from strategy import ConfigError, DeepSpeedStrategy, OptimConfig, StrategyConfig, parse_configs
from strategy.trainers import datasets as ds
from strategy.trainers.config import DataConfig, LoraConfig, TrainConfig

CONFIG_CLASSES = [StrategyConfig, OptimConfig, TrainConfig, DataConfig, LoraConfig]


@dataclass
class Run:
    """What a training script needs, built in the right order."""

    strategy: DeepSpeedStrategy
    train: TrainConfig
    data: DataConfig
    lora: LoraConfig
    tokenizer: Any = None
    args: argparse.Namespace | None = None

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> "Run":
        (s_cfg, o_cfg, t_cfg, d_cfg, l_cfg), ns = parse_configs(CONFIG_CLASSES, argv, parser)
        check_paths(t_cfg, d_cfg)
        check_lora_targets(t_cfg, l_cfg)
        strategy = DeepSpeedStrategy(s_cfg, o_cfg)
        strategy.setup_distributed()
        run = cls(strategy, t_cfg, d_cfg, l_cfg, args=ns)
        run.tokenizer = load_tokenizer(t_cfg)
        return run

    # ------------------------------------------------------------ pieces
    def model(self, auto_cls: Any = None, lora_task: str = "CAUSAL_LM", modules_to_save: list[str] | None = None,
              **kwargs: Any):
        """The model to train (LoRA-wrapped when ``lora_rank`` > 0), partitioned under ZeRO-3."""
        source = self.train.pretrain or hf_config(self.train.model_config, self.tokenizer, **kwargs)
        model = self.strategy.from_pretrained(source, auto_cls, **(kwargs if self.train.pretrain else {}))
        if self.lora.lora_rank:
            from strategy.lora import apply_lora

            model = apply_lora(model, self.lora.lora_rank, self.lora.lora_alpha, self.lora.lora_dropout,
                               self.lora.target_modules, lora_task, modules_to_save)
        return model

    def loaders(self, kind: str = "sft") -> tuple[Any, Any]:
        """(train, eval) loaders of ``sft`` samples or preference ``pairs``."""
        load = ds.load_sft if kind == "sft" else ds.load_pairs
        collate = (ds.collate_sft if kind == "sft" else ds.collate_pairs)(self.tokenizer.pad_token_id)
        train = load(self.data.dataset, self.tokenizer, self.data, self.data.max_samples)
        if kind == "sft" and self.data.packing_samples:
            train = ds.pack(train, self.data.max_len)
        if len(train) < self.strategy.config.train_batch_size:
            raise ConfigError(f"train_batch_size={self.strategy.config.train_batch_size} is invalid: larger than "
                              f"the {len(train)} training samples in {self.data.dataset}; lower it or add data")
        s = self.strategy
        train_loader = s.setup_dataloader(train, s.config.micro_train_batch_size, shuffle=True, collate_fn=collate)
        eval_loader = None
        if self.data.eval_dataset:
            held = load(self.data.eval_dataset, self.tokenizer, self.data)
            eval_loader = s.setup_dataloader(held, s.config.micro_eval_batch_size, shuffle=False,
                                             collate_fn=collate, drop_last=False)
        return train_loader, eval_loader

    def trainer(self, cls: type, model, kind: str = "sft", **kwargs: Any):
        """``cls`` (a Trainer subclass) wired with loaders, optimizer and schedule for ``model``."""
        train, held = self.loaders(kind)
        optimizer, scheduler = self.optimizer_and_scheduler(model, train)
        return cls(self.strategy, model, optimizer=optimizer, scheduler=scheduler, train_dataloader=train,
                   eval_dataloader=held, config=self.train, tokenizer=self.tokenizer, **kwargs)

    def optimizer_and_scheduler(self, model, train_loader) -> tuple[Any, Any]:
        steps = len(train_loader.dataset) // self.strategy.config.train_batch_size * self.train.max_epochs
        steps = min(steps, self.train.max_steps) if self.train.max_steps > 0 else steps
        optimizer = self.strategy.create_optimizer(model)
        return optimizer, self.strategy.create_scheduler(optimizer, num_training_steps=max(steps, 1))


def check_paths(train: TrainConfig, data: DataConfig) -> None:
    """Fail before any process group starts on inputs that do not exist or outputs not writable."""
    for name, path in (("dataset", data.dataset), ("eval_dataset", data.eval_dataset),
                       ("model_config", train.model_config)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name}={path!r} is invalid: no such file; pass an existing path")
    if data.dataset is None:
        raise ConfigError("dataset=None is invalid: pass --dataset FILE (.json, .jsonl or .parquet)")
    tok = train.tokenizer or train.pretrain
    if tok is None:
        raise ConfigError("tokenizer=None is invalid: pass --tokenizer DIR (or --pretrain, which has one)")
    for name in ("save_path", "ckpt_path", "log_dir"):
        path = getattr(train, name)
        if path is not None and not _writable(path):
            raise ConfigError(f"{name}={path!r} is invalid: cannot create or write it; choose a writable directory")


def check_lora_targets(train: TrainConfig, lora: LoraConfig) -> None:
    """Check LoRA target modules on a weightless (meta-device) copy of the model, before any rank starts."""
    if not lora.lora_rank or lora.target_modules.strip() == "all-linear":
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from strategy.lora import check_targets

    config = AutoConfig.from_pretrained(train.pretrain) if train.pretrain else hf_config(train.model_config)
    with torch.device("meta"):
        check_targets(AutoModelForCausalLM.from_config(config), lora.target_modules)


def _writable(path: str) -> bool:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK)


def load_tokenizer(train: TrainConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(train.tokenizer or train.pretrain)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def hf_config(path: str, tokenizer: Any = None, **kwargs: Any):
    """An HF config from a JSON file (``model_type`` picks the class), special ids from the tokenizer."""
    from transformers import CONFIG_MAPPING

    with open(path) as fh:
        values = json.load(fh)
    kind = values.pop("model_type", None)
    if kind not in CONFIG_MAPPING:
        raise ConfigError(f"model_config={path!r} is invalid: model_type {kind!r} unknown; use e.g. llama, gpt2, qwen2")
    if tokenizer is not None:
        values.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    values.update(kwargs)
    return CONFIG_MAPPING[kind](**values)
