"""From command-line flags to a ready strategy, tokenizer, model, loaders, optimizer and schedule.

Every example shares this; it validates every setting before the process group starts. ``Run`` is
a context manager that closes its strategy, even when training raises.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from strategy import dist
from strategy.attention import attention_for, check_attention
from strategy.checkpoint import CheckpointConfig, RunLayout, check_resumable
from strategy.config import StrategyConfig, parse_configs
from strategy.deepspeed_strategy import DeepSpeedStrategy
from strategy.errors import ConfigError
from strategy.internals import set_attn_implementation
from strategy.lora import apply_lora, check_targets
from strategy.optim import OptimConfig
from strategy.parallel import check_sequence_parallel, check_tensor_parallel
from strategy.quant import check_four_bit, four_bit_config, prepare_four_bit
from strategy.trainers.algorithms.grpo import GRPOConfig, GRPOTrainer
from strategy.trainers.algorithms.ppo import critic_source, critic_strategy
from strategy.trainers.algorithms.preference import check_reference_source
from strategy.trainers.algorithms.rewards import CallableReward, ModelReward, Rewards
from strategy.trainers.algorithms.sft import TILE_VOCAB
from strategy.trainers.config import (
    DataConfig,
    DPOConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)
from strategy.trainers.data import packing
from strategy.trainers.data.files import source_exists
from strategy.trainers.loop import StepPlan, plan_steps
from strategy.trainers.loop.steps import sample_count

CONFIG_CLASSES = (StrategyConfig, OptimConfig, CheckpointConfig, ModelConfig, TrainConfig,
                  DataConfig, LoraConfig, DPOConfig)


@dataclass
class Run:
    """What a training script needs, built in the right order.

    Attributes:
        strategy: the started ``DeepSpeedStrategy``.
        model_cfg: the ``ModelConfig``.
        train: the ``TrainConfig``.
        data: the ``DataConfig``.
        lora: the ``LoraConfig``.
        dpo: the ``DPOConfig``.
        tokenizer: the tokenizer (pad token set to eos when it had none).
        args: the parsed command-line namespace.
        grpo: the ``GRPOConfig`` (None unless ``from_args(grpo=True)``).
        configs: every parsed config, by class (a trainer's own ``config_classes`` included).
    """

    strategy: DeepSpeedStrategy
    model_cfg: ModelConfig
    train: TrainConfig
    data: DataConfig
    lora: LoraConfig
    dpo: DPOConfig
    tokenizer: Any = None
    args: argparse.Namespace | None = None
    grpo: GRPOConfig | None = None
    configs: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None,
                  parser: argparse.ArgumentParser | None = None, grpo: bool = False,
                  trainer: type | None = None) -> Run:
        """Parse flags and YAML, check everything that can be checked without ranks (the
        trainer's own ``check_settings`` included), then start the strategy.

        Args:
            argv: the command line without the program name (None: ``sys.argv``).
            parser: a parser holding the script's own flags, extended with the configs'.
            grpo: also parse and check ``GRPOConfig`` (the same as ``trainer=GRPOTrainer``).
            trainer: the trainer class the script runs: its ``config_classes`` are parsed too
                and its ``check_settings`` runs before any process group starts.

        Returns:
            The ``Run``, its strategy's process group started and its tokenizer loaded.

        Raises:
            ConfigError: a setting is invalid (one line naming it and the fix).
        """
        dist.install_one_line_errors()  # a bad setting is one line on stderr, no traceback
        argv = openrlhf_argv(list(sys.argv[1:] if argv is None else argv))
        trainer = GRPOTrainer if grpo and trainer is None else trainer
        extra = tuple(getattr(trainer, "config_classes", ()))
        configs, namespace = parse_configs(list(CONFIG_CLASSES + extra), argv, parser)
        by_type = {type(config): config for config in configs}
        strategy_cfg, ckpt_cfg = by_type[StrategyConfig], by_type[CheckpointConfig]
        model_cfg, train_cfg, data_cfg = by_type[ModelConfig], by_type[TrainConfig], \
            by_type[DataConfig]
        lora_cfg = by_type[LoraConfig]
        grpo_cfg = next((c for c in configs if isinstance(c, GRPOConfig)), None)  # or PPO's
        check_paths(model_cfg, train_cfg, data_cfg, ckpt_cfg)
        dist.from_slurm()  # the ranks srun started
        strategy_cfg.validate_world(dist.get_world_size())  # from the launcher's environment
        check_model(model_cfg, lora_cfg, data_cfg, strategy_cfg, train_cfg)
        if data_cfg.streaming and train_cfg.max_steps <= 0:
            raise ConfigError("streaming=True is invalid without --max_steps: a stream has no "
                              "length to plan epochs by; pass --max_steps N")
        if trainer is not None:
            trainer.check_settings(by_type, dist.get_world_size())
        if train_cfg.load_checkpoint:
            check_resumable(ckpt_cfg.ckpt_path, RunLayout(
                sequence_parallel_size=strategy_cfg.sequence_parallel_size,
                tensor_parallel_size=strategy_cfg.tensor_parallel_size))
        strategy = DeepSpeedStrategy(strategy_cfg, by_type[OptimConfig], ckpt_cfg)
        strategy.setup_distributed()
        run = cls(strategy, model_cfg=model_cfg, train=train_cfg, data=data_cfg, lora=lora_cfg,
                  dpo=by_type[DPOConfig], args=namespace, grpo=grpo_cfg, configs=by_type)
        run.tokenizer = load_tokenizer(model_cfg)
        return run

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.strategy.__exit__(exc_type, *exc)

    # ------------------------------------------------------------ pieces
    def model(self, auto_cls: Any = None, lora_task: str = "CAUSAL_LM",
              modules_to_save: list[str] | None = None, **kwargs: Any):
        """The model to train (LoRA-wrapped when ``lora_rank`` > 0), partitioned under ZeRO-3.

        Args:
            auto_cls: the ``transformers`` auto class (default: ``AutoModelForCausalLM``).
            lora_task: the LoRA task type.
            modules_to_save: modules LoRA trains fully and saves.
            **kwargs: passed to ``from_pretrained`` (``--pretrain``) or to the HF config
                (``--model_config``).

        Returns:
            The model, from ``--pretrain`` or built from ``--model_config``.
        """
        pretrain = self.model_cfg.pretrain
        attention = self.attention()
        kwargs.update(self._quantization())
        if self.train.aux_loss_coef > 0:  # the router loss returned apart; SFTTrainer adds it
            kwargs.update(output_router_logits=True, router_aux_loss_coef=0.0)
        if pretrain:
            model = self.strategy.from_pretrained(pretrain, auto_cls, **attention, **kwargs)
        else:
            source = hf_config(self.model_cfg.model_config, self.tokenizer, **kwargs)
            model = self.strategy.from_pretrained(source, auto_cls, **attention)
        if getattr(model.config, "pad_token_id", None) is None:  # saved with the export; a
            model.config.pad_token_id = self.tokenizer.pad_token_id  # classifier pools by it
        if self.lora.load_in_4bit:
            model = prepare_four_bit(model, self.strategy.config.gradient_checkpointing)
        if self.lora.lora_rank:
            model = apply_lora(model, self.lora.lora_rank, self.lora.lora_alpha,
                               self.lora.lora_dropout, self.lora.target_modules, lora_task,
                               modules_to_save)
        return model

    def config(self, cls: type) -> Any:
        """The parsed config of class ``cls`` (e.g. a trainer's ``ORPOConfig``).

        Args:
            cls: a config class parsed by ``from_args`` (listed in the trainer's
                ``config_classes``).

        Returns:
            The config instance.

        Raises:
            ConfigError: ``cls`` was not parsed (pass ``trainer=`` to ``from_args``).
        """
        if cls not in self.configs:
            raise ConfigError(f"{cls.__name__} was not parsed: pass the trainer that lists it in "
                              "config_classes to Run.from_args(trainer=...)")
        return self.configs[cls]

    def reference(self, model):
        """The frozen reference of DPO, KTO and the on-policy KL: ``--ref_pretrain``, else
        ``--pretrain`` loaded again (in 4-bit too with ``--load_in_4bit``); from
        ``--model_config``, a copy of ``model``'s fresh weights (ZeRO 0-2, no LoRA).

        Args:
            model: the policy (from ``Run.model``), copied when there is no checkpoint to load.

        Returns:
            The reference model, frozen (the strategy's ``prepare`` makes it an eval engine).

        Raises:
            ConfigError: from ``--model_config`` under ZeRO-3 or LoRA.
        """
        source = self.model_cfg.ref_pretrain or self.model_cfg.pretrain
        if source:  # QLoRA: the same 4-bit base
            return self.strategy.from_pretrained(source, frozen=True, **self.attention(),
                                                 **self._quantization())
        check_reference_source({ModelConfig: self.model_cfg, StrategyConfig: self.strategy.config,
                                LoraConfig: self.lora})
        return copy.deepcopy(model).requires_grad_(False)

    def attention(self) -> dict:
        """``from_pretrained``'s attention for this run's data: ``--attn_implementation``, with
        sdpa's per-sample variant (``sdpa_varlen``) for packed rows.

        Returns:
            ``{"attn_implementation": name}``, to pass to ``from_pretrained``.
        """
        name = attention_for(self.model_cfg.attn_implementation, self.data.packing_samples)
        return {"attn_implementation": name}

    def _quantization(self) -> dict:
        """``from_pretrained``'s 4-bit settings under ``--load_in_4bit`` (else none)."""
        if not self.lora.load_in_4bit:
            return {}
        return {"quantization_config": four_bit_config(self.strategy.dtype)}

    def critic(self):
        """PPO's value model: ``AutoModelForTokenClassification`` with one label and no dropout
        or bias on its head (OpenRLHF's critic head), from ``critic_source`` (a reward model's
        ``score`` head loads as it is; a causal LM gets a new one), or fresh from
        ``--model_config``; partitioned at construction when its own stage
        (``--critic_zero_stage``) is 3.

        Returns:
            The critic (not yet an engine: ``PPOTrainer`` prepares it).
        """
        source = critic_source(self.grpo, self.model_cfg)
        if source is None:
            config = hf_config(self.model_cfg.model_config, self.tokenizer, num_labels=1)
        else:
            config = AutoConfig.from_pretrained(source, num_labels=1)
        config.classifier_dropout, config.token_classification_bias = 0.0, False
        kwargs = {} if source is None else {"config": config}
        model = critic_strategy(self.strategy, self.grpo).from_pretrained(
            source or config, AutoModelForTokenClassification, **self.attention(), **kwargs)
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        return model

    def reward(self):
        """The GRPO reward: the weighted sum (``reward_weights``) of the ``reward_fn`` callables
        and the reward model (an eval engine), each logged on its own.

        Returns:
            A ``Rewards``: ``reward(prompts, completions, rows) -> floats``.
        """
        grpo, parts = self.grpo, []
        for name, weight in zip(grpo.reward_names(), grpo.weights()):
            if name == "model" and grpo.reward_pretrain:
                model = self.strategy.from_pretrained(grpo.reward_pretrain,
                                                      AutoModelForSequenceClassification,
                                                      frozen=True)
                tokenizer = AutoTokenizer.from_pretrained(grpo.reward_pretrain)
                scorer = ModelReward(self.strategy.prepare(model), tokenizer, self.data.max_len)
            else:
                scorer = CallableReward(name, grpo.reward_timeout)
                name = scorer.name
            parts.append((name, scorer, weight))
        return Rewards(parts)

    def loaders(self, spec: Any) -> tuple[Any, Any]:
        """(train, held-out) loaders of the data ``spec`` describes (a trainer's ``data``).

        Args:
            spec: a ``DataSpec`` (or ``PromptSpec``), e.g. ``SFTTrainer.data``.

        Returns:
            The training loader and the held-out loader (None without ``--eval_dataset``).
        """
        return spec.loaders(self)

    def trainer(self, cls: type, model, **kwargs: Any):
        """``cls`` (a Trainer subclass) wired with the loaders of the data it declares
        (``cls.data``), an optimizer and the schedule over its plan.

        Args:
            cls: the trainer class.
            model: the model to train (from ``Run.model``).
            **kwargs: the trainer's own arguments (``ref_model``, ``dpo``, ``grpo``...).

        Returns:
            The trainer, ready to ``fit()``.
        """
        train, held = self.loaders(cls.data)
        plan = cls.plan(self.strategy, sample_count(train), self.train, **kwargs)
        optimizer, scheduler = self.optimizer_and_scheduler(model, plan=plan)
        return cls(self.strategy, model, optimizer=optimizer, scheduler=scheduler,
                   train_dataloader=train, eval_dataloader=held, config=self.train,
                   tokenizer=self.tokenizer, **kwargs)

    def optimizer_and_scheduler(self, model, train_loader: Any = None,
                                plan: StepPlan | None = None) -> tuple[Any, Any]:
        """The optimizer, and the schedule over ``plan`` (default: the SFT-style plan of
        ``train_loader``'s samples).

        Args:
            model: the model to optimize.
            train_loader: the training loader, for the default plan.
            plan: the trainer's ``StepPlan`` (e.g. from its ``plan``).

        Returns:
            ``(optimizer, scheduler)``.
        """
        if plan is None:
            plan = plan_steps(sample_count(train_loader), self.strategy.config.train_batch_size,
                              self.train.max_epochs, self.train.max_steps)
        optimizer = self.strategy.create_optimizer(model)
        scheduler = self.strategy.create_scheduler(optimizer,
                                                   num_training_steps=max(plan.total_steps, 1))
        return optimizer, scheduler


def openrlhf_argv(argv: list[str]) -> list[str]:
    """OpenRLHF's multi-value spellings as ours: ``--target_modules q_proj v_proj`` becomes
    ``--target_modules q_proj,v_proj``; ``--use_wandb TOKEN`` as in ``wandb_key_taken``."""
    out: list[str] = []
    for arg in wandb_key_taken(argv):
        if len(out) >= 2 and out[-2] == "--target_modules" and not arg.startswith("-"):
            out[-1] = f"{out[-1]},{arg}"
        else:
            out.append(arg)
    return out


def wandb_key_taken(argv: list[str]) -> list[str]:
    """OpenRLHF's ``--use_wandb TOKEN`` (or ``--use_wandb True``): the token becomes
    ``WANDB_API_KEY`` (what ``wandb.login`` reads) and the flag our plain ``--use_wandb``."""
    out = []
    for arg in argv:
        if out and out[-1] == "--use_wandb" and not arg.startswith("-"):
            if arg.lower() not in ("true", "1"):
                os.environ["WANDB_API_KEY"] = arg
            continue
        if arg.startswith("--use_wandb="):
            out.extend(wandb_key_taken(["--use_wandb", arg.partition("=")[2]]))
            continue
        out.append(arg)
    return out


def check_paths(model: ModelConfig, train: TrainConfig, data_cfg: DataConfig,
                ckpt: CheckpointConfig) -> None:
    """Fail before any process group starts on inputs that do not exist or outputs not writable."""
    if model.model_config is not None and not os.path.isfile(model.model_config):
        raise ConfigError(f"model_config={model.model_config!r} is invalid: no such file; pass an "
                          "existing path")
    if data_cfg.dataset is None:
        raise ConfigError("dataset=None is invalid: pass --dataset (a .json/.jsonl/.parquet file, "
                          "a dataset folder or a Hub id)")
    for name, value in (("dataset", data_cfg.dataset), ("eval_dataset", data_cfg.eval_dataset)):
        for source in (value or "").split(",") if value else []:
            if not source_exists(source.strip()):
                raise ConfigError(f"{name}={value!r} is invalid: no such file, folder or matching "
                                  f"pattern ({source.strip()!r}); pass an existing path or a Hub "
                                  "dataset id")
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
                strategy: StrategyConfig, train: TrainConfig | None = None) -> None:
    """What the model's config decides, before any rank starts: LoRA targets (on a weightless
    meta-device copy), packing, sequence parallelism, an attention kernel that is installed."""
    check_attention(model.attn_implementation)
    if model.attn_implementation == "flash_attention_2" and not importlib.util.find_spec(
            "flash_attn"):
        raise ConfigError("attn_implementation='flash_attention_2' is invalid: the flash-attn "
                          "package is not installed here (it needs a CUDA GPU); use "
                          "--attn_implementation sdpa")
    if model.pretrain:
        config = AutoConfig.from_pretrained(model.pretrain)
    else:
        config = hf_config(model.model_config)
    set_attn_implementation(config, attention_for(model.attn_implementation,
                                                  data_cfg.packing_samples))
    if lora.load_in_4bit:
        check_four_bit(model.pretrain, lora.lora_rank, strategy.param_offload,
                       strategy.tensor_parallel_size)
    if lora.lora_rank and lora.target_modules.strip() != "all-linear":
        with torch.device("meta"):
            check_targets(AutoModelForCausalLM.from_config(config), lora.target_modules)
    if data_cfg.packing_samples:
        packing.check_packing_family(config.model_type)
    if train is not None and train.aux_loss_coef > 0:
        check_router_loss(config, train)
    check_sequence_parallel(config, strategy.sequence_parallel_size)
    check_tensor_parallel(config, strategy.tensor_parallel_size)


def check_router_loss(config: Any, train: TrainConfig) -> None:
    """``--aux_loss_coef`` needs a model with a router (MoE) and the plain (untiled) loss."""
    if not hasattr(config, "output_router_logits"):
        raise ConfigError(f"aux_loss_coef={train.aux_loss_coef} is invalid: {config.model_type} "
                          "has no router loss; use it with an MoE model (Mixtral, Qwen2-MoE...) "
                          "or set 0")
    tiled = train.tiled_logits_loss
    if tiled or (tiled is None and config.get_text_config().vocab_size >= TILE_VOCAB):
        raise ConfigError(f"aux_loss_coef={train.aux_loss_coef} is invalid with the tiled logits "
                          "loss (the router loss comes from the full forward); pass "
                          "--no-tiled_logits_loss or set 0")


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
