"""From command-line flags to a ready strategy, tokenizer, model, loaders, optimizer and schedule.

Every trainer's command (``strategy.cli``) shares this. It names no algorithm: a trainer's own
configs, checks, loaders and plan come from its class, the extra models it needs from its own
module. Every setting is validated before the process group starts; ``Run``
is a context manager that closes its strategy, even when training raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
)

from strategy import dist
from strategy.attention import attention_for, check_attention
from strategy.checkpoint import CheckpointConfig, RunLayout, check_resumable
from strategy.config import (
    PRINT_FLAG,
    StrategyConfig,
    parse_configs,
    print_settings_and_exit,
)
from strategy.config.cli import shipped_file
from strategy.deepspeed_strategy import DeepSpeedStrategy
from strategy.errors import ConfigError
from strategy.internals import set_attn_implementation
from strategy.lora import apply_lora, check_targets
from strategy.model import hf_config
from strategy.optim import OptimConfig
from strategy.parallel import check_sequence_parallel, check_tensor_parallel
from strategy.quant import check_four_bit, four_bit_config, prepare_four_bit
from strategy.trainers.config import DataConfig, LoraConfig, ModelConfig, TrainConfig
from strategy.trainers.data import packing
from strategy.trainers.data.files import source_exists
from strategy.trainers.loop import StepPlan, Trainer, plan_steps
from strategy.trainers.loop.steps import sample_count
from strategy.trainers.losses.lm import TILE_VOCAB

# what every trainer parses; a trainer's own configs come from its ``config_classes``
CONFIG_CLASSES = (StrategyConfig, OptimConfig, CheckpointConfig, ModelConfig, TrainConfig,
                  DataConfig, LoraConfig)


@dataclass
class Run:
    """What a training script needs, built in the right order.

    Attributes:
        strategy: the started ``DeepSpeedStrategy``.
        model_cfg: the ``ModelConfig``.
        train: the ``TrainConfig``.
        data: the ``DataConfig``.
        lora: the ``LoraConfig``.
        tokenizer: the tokenizer (pad token set to eos when it had none).
        args: the parsed command-line namespace.
        configs: every parsed config, by class (a trainer's own ``config_classes`` included:
            ``run.config(cls)``).
    """

    strategy: DeepSpeedStrategy
    model_cfg: ModelConfig
    train: TrainConfig
    data: DataConfig
    lora: LoraConfig
    tokenizer: Any = None
    args: argparse.Namespace | None = None
    configs: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None,
                  parser: argparse.ArgumentParser | None = None,
                  trainer: type | None = None, foreign: dict | None = None) -> Run:
        """Parse flags and YAML, check everything that can be checked without ranks (the
        trainer's own ``check_settings`` included), then start the strategy.

        Args:
            argv: the command line without the program name (None: ``sys.argv``).
            parser: a parser holding the script's own flags, extended with the configs'.
            trainer: the trainer class the script runs: its ``config_classes`` are parsed too
                and its ``check_settings`` runs before any process group starts.
            foreign: ``{flag name: refusal line}`` for flags this trainer does not parse
                (default ``foreign_flags(trainer)``: "--beta is not a flag of sft; dpo takes
                it").

        Returns:
            The ``Run``, its strategy's process group started and its tokenizer loaded.

        Raises:
            ConfigError: a setting is invalid (one line naming it and the fix).
        """
        dist.install_one_line_errors()  # a bad setting is one line on stderr, no traceback
        by_type, namespace = cls.check_args(argv, parser, trainer, foreign)
        strategy = DeepSpeedStrategy(by_type[StrategyConfig], by_type[OptimConfig],
                                     by_type[CheckpointConfig])
        strategy.setup_distributed()
        run = cls(strategy, model_cfg=by_type[ModelConfig], train=by_type[TrainConfig],
                  data=by_type[DataConfig], lora=by_type[LoraConfig], args=namespace,
                  configs=by_type)
        run.tokenizer = load_tokenizer(run.model_cfg)
        return run

    @staticmethod
    def check_args(argv: Sequence[str] | None = None,
                   parser: argparse.ArgumentParser | None = None, trainer: type | None = None,
                   foreign: dict | None = None) -> tuple[dict, argparse.Namespace]:
        """Parse flags and YAML and check every setting that needs no process group (``from_args``
        without starting anything; ``strategy <trainer>`` runs it once before it starts ranks).

        Args:
            argv: the command line without the program name (None: ``sys.argv``).
            parser: a parser holding the script's own flags, extended with the configs'.
            trainer: the trainer class: its ``config_classes`` and ``check_settings``.
            foreign: ``{flag name: refusal line}``, for refusing another trainer's flag.

        Returns:
            ``({config class: config}, namespace)``.

        Raises:
            ConfigError: a setting is invalid (one line naming it and the fix).
        """
        argv = list(sys.argv[1:] if argv is None else argv)
        foreign = foreign_flags(trainer) if foreign is None else foreign
        extra = tuple(getattr(trainer, "config_classes", ()))
        configs, namespace = parse_configs(list(CONFIG_CLASSES + extra), argv, parser, foreign,
                                           hidden_flags(trainer))
        by_type = {type(config): config for config in configs}
        model = by_type[ModelConfig]
        if model.model_config:  # a shipped config's model file, from any directory
            by_type[ModelConfig] = dataclasses.replace(
                model, model_config=shipped_file(model.model_config))
        strategy_cfg, ckpt_cfg = by_type[StrategyConfig], by_type[CheckpointConfig]
        model_cfg, train_cfg, data_cfg = by_type[ModelConfig], by_type[TrainConfig], \
            by_type[DataConfig]
        lora_cfg = by_type[LoraConfig]
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
        if getattr(namespace, PRINT_FLAG, False):
            print_settings_and_exit(list(by_type.values()), namespace, hidden_flags(trainer))
        return by_type, namespace

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
        kwargs.update(self.quantization())
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

    def attention(self) -> dict:
        """``from_pretrained``'s attention for this run's data: ``--attn_implementation``, with
        sdpa's per-sample variant (``sdpa_varlen``) for packed rows.

        Returns:
            ``{"attn_implementation": name}``, to pass to ``from_pretrained``.
        """
        name = attention_for(self.model_cfg.attn_implementation, self.data.packed)
        return {"attn_implementation": name}

    def quantization(self) -> dict:
        """``from_pretrained``'s 4-bit settings under ``--load_in_4bit`` (else none).

        Returns:
            ``{"quantization_config": ...}``, or ``{}``.
        """
        if not self.lora.load_in_4bit:
            return {}
        return {"quantization_config": four_bit_config(self.strategy.dtype)}

    def loaders(self, spec: Any) -> tuple[Any, Any]:
        """(train, held-out) loaders of the data ``spec`` describes (a ``DataSpec``).

        Args:
            spec: a ``DataSpec``, e.g. ``SFTTrainer.data``.

        Returns:
            The training loader and the held-out loader (None without ``--eval_dataset``).
        """
        return spec.loaders(self.strategy, self.tokenizer, self.data)

    def trainer(self, cls: type, model, **kwargs: Any):
        """``cls`` (a Trainer subclass) wired with the loaders of the data it declares
        (``cls.data``), an optimizer and the schedule over its plan.

        Args:
            cls: the trainer class.
            model: the model to train (from ``Run.model``).
            **kwargs: the trainer's own arguments (``ref_model``, ``dpo``, ``grpo``...), also
                handed to its ``loaders`` and ``plan``.

        Returns:
            The trainer, ready to ``fit()``.
        """
        train, held = cls.loaders(self.strategy, self.tokenizer, self.data, **kwargs)
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


def commands() -> dict[str, type]:
    """The trainers with an installed command (``Trainer.command``), by command: the built-in
    ones and any imported subclass that names one.

    Returns:
        ``{command: trainer class}``, the first class of each command.
    """
    found: dict[str, type] = {}
    pending = list(Trainer.__subclasses__())
    while pending:
        cls = pending.pop(0)
        if cls.command and cls.command not in found:
            found[cls.command] = cls
        pending.extend(cls.__subclasses__())
    return found


def shared_flags(trainer: type | None) -> set[str]:
    """The shared configs' fields ``trainer`` takes: all but those another trainer's alone
    (``doc(trainers=...)`` not naming its command); a trainer with no command takes all.

    Args:
        trainer: a ``Trainer`` subclass (None: every shared field).

    Returns:
        The flag names, without ``--``.
    """
    command = getattr(trainer, "command", None)
    return {f.name for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)
            if command is None or f.metadata.get("trainers") is None
            or command in f.metadata["trainers"]}


def hidden_flags(trainer: type | None) -> frozenset[str]:
    """The shared fields ``trainer``'s command neither shows nor takes (other trainers' alone).

    Args:
        trainer: a ``Trainer`` subclass (None: none hidden).

    Returns:
        The field names.
    """
    return frozenset(shared_flags(None) - shared_flags(trainer))


def flag_names(trainer: type | None) -> set[str]:
    """The flags ``trainer``'s command parses: its shared ones and its own configs' fields.

    Args:
        trainer: a ``Trainer`` subclass (None: the shared configs only).

    Returns:
        The flag names, without ``--``.
    """
    own = tuple(getattr(trainer, "config_classes", ()))
    return shared_flags(trainer) | {f.name for cls in own for f in dataclasses.fields(cls)}


def foreign_flags(trainer: type | None) -> dict[str, str]:
    """``{flag: refusal line}`` for each flag another command's trainer takes and ``trainer``
    does not (``--beta is not a flag of sft; dpo takes it``).

    Args:
        trainer: the trainer being parsed for (None: a script of the shared configs only).

    Returns:
        The refusals by flag name.
    """
    mine = flag_names(trainer)
    name = getattr(trainer, "command", None) or getattr(trainer, "__name__", "this script")
    takers: dict[str, list[str]] = {}
    for command, cls in sorted(commands().items()):
        for flag in sorted(flag_names(cls) - mine):
            takers.setdefault(flag, []).append(command)
    return {flag: f"--{flag} is not a flag of {name}; {_join(who)} "
                  f"{'takes' if len(who) == 1 else 'take'} it" for flag, who in takers.items()}


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


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
        try:
            config = AutoConfig.from_pretrained(model.pretrain)
        except (OSError, ValueError) as exc:  # no config.json, or none transformers knows
            raise ConfigError(f"pretrain={model.pretrain!r} is invalid: not a model transformers "
                              f"can load ({str(exc).splitlines()[0]}); pass a model directory "
                              "(its config.json) or a hub name") from None
    else:
        config = hf_config(model.model_config)
    set_attn_implementation(config, attention_for(model.attn_implementation,
                                                  data_cfg.packed))
    if lora.load_in_4bit:
        check_four_bit(model.pretrain, lora.lora_rank, strategy.param_offload,
                       strategy.tensor_parallel_size)
    if lora.lora_rank and lora.target_modules.strip() != "all-linear":
        with torch.device("meta"):
            check_targets(AutoModelForCausalLM.from_config(config), lora.target_modules)
    if data_cfg.packed:
        packing.check_packing_family(config.model_type, "pack_dataset" if data_cfg.pack_dataset
                                     else "packing_samples")
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
