"""``DeepSpeedStrategy``: the facade trainers use, the one object that knows ranks, ZeRO, offload
and precision. Each method hands its work to the subsystem that owns it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from strategy import dist
from strategy.checkpoint import CheckpointConfig, ResumeState, load_checkpoint, save_checkpoint
from strategy.config import StrategyConfig, build_ds_config, build_eval_ds_config
from strategy.dtypes import training_dtype
from strategy.errors import fail
from strategy.export import save_model, save_model_metadata
from strategy.internals import engine_measures_grad_norm, restart_adam_powers
from strategy.model import build_hf_model
from strategy.optim import OptimConfig, build_optimizer, create_scheduler, get_param_groups
from strategy.sampler import ResumableDistributedSampler, ShardSampler


class DeepSpeedStrategy:
    """DeepSpeed ZeRO 0-3 behind a small surface; trainers take it as a dependency.

    Use it as a context manager (``with DeepSpeedStrategy(...) as strategy:``) so ``close()`` runs
    even when training raises."""

    def __init__(self, config: StrategyConfig | None = None, optim: OptimConfig | None = None,
                 checkpoint: CheckpointConfig | None = None) -> None:
        self.config = config or StrategyConfig()
        self.optim = optim or OptimConfig()
        self.checkpoint = checkpoint or CheckpointConfig()
        self._hf_ds_config = None  # keeps transformers' ZeRO-3 hook alive while models are built
        self._grad_norms: dict[int, float] = {}  # id(engine) -> norm we measured (plain ZeRO-0)
        self.resume_state: ResumeState | None = None  # set by load_ckpt

    def __enter__(self) -> DeepSpeedStrategy:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # an escaping exception still needs the failure hook: it names the rank and exits at once
        self.close(keep_failure_hook=exc_type is not None)

    # ------------------------------------------------------------ ranks
    def setup_distributed(self, timeout: timedelta | float | None = None) -> None:
        """Validate against the launcher's world size, seed every RNG, start the process group,
        install the failure hook. ``timeout`` (seconds or timedelta; default
        ``config.timeout_minutes``) bounds every collective."""
        if timeout is None:
            timeout = timedelta(minutes=self.config.timeout_minutes)
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        self.config.validate_world(dist.get_world_size())
        self._check_accelerator()
        dist.seed_everything(self.config.seed)
        dist.init_distributed(timeout)
        dist.install_failure_hook()

    def _check_accelerator(self) -> None:
        accelerator = get_accelerator()
        name = accelerator.device_name()
        if self.config.fp16 and not accelerator.is_fp16_supported():
            fail("fp16", True, f"DeepSpeed has no fp16 training on this machine's accelerator "
                 f"({name}); use --bf16, or run on a GPU")
        if self.config.bf16 and not accelerator.is_bf16_supported():
            fail("bf16", True, f"this accelerator ({name}) has no bf16; use --fp16 or fp32")

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def is_rank_0(self) -> bool:
        return dist.is_rank_0()

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data (all of them, without sequence or tensor parallelism)."""
        return self.config.data_parallel_size(self.world_size)

    @property
    def data_parallel_rank(self) -> int:
        return self.rank

    @property
    def accumulation_steps(self) -> int:
        return self.config.accumulation_steps(self.world_size)

    def print(self, *args: Any, **kwargs: Any) -> None:
        dist.print0(*args, **kwargs)

    def barrier(self) -> None:
        dist.barrier()

    def on_rank_0(self, fn: Callable, *args: Any) -> Any:
        """Collective: ``fn(*args)`` runs on rank 0 only (file writes); every rank returns its
        result or raises its error."""
        return dist.on_rank_0(fn, *args)

    def all_reduce(self, data: Any, op: str = "mean", group: str = "world") -> Any:
        """Reduce over every rank (``group="world"``) or over the data-parallel ranks
        (``"data"``: one rank per distinct batch)."""
        return dist.all_reduce(data, op)

    def all_gather(self, data: Any) -> Any:
        return dist.all_gather(data)

    @property
    def ds_config(self) -> dict:
        return build_ds_config(self.config, self.world_size)

    @property
    def eval_ds_config(self) -> dict:
        return build_eval_ds_config(self.config, self.world_size)

    @property
    def dtype(self) -> torch.dtype:
        return training_dtype(self.config.bf16, self.config.fp16)

    # ------------------------------------------------------------ models and optimizers
    def from_pretrained(self, name_or_config: Any, auto_cls: Any = None,
                        dtype: torch.dtype | None = None, **kwargs: Any) -> nn.Module:
        """Build a Hugging Face model (path, hub name or config); partitioned at construction
        under ZeRO-3."""
        if self.config.zero_stage == 3 and self._hf_ds_config is None:
            self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        return build_hf_model(name_or_config, auto_cls, dtype or self.dtype, **kwargs)

    def create_optimizer(self, model: nn.Module, lr: float | None = None,
                         betas: tuple[float, float] | None = None,
                         weight_decay: float | None = None,
                         eps: float | None = None) -> torch.optim.Optimizer:
        """The ``optim.optimizer`` kernel (FusedAdam, DeepSpeedCPUAdam with adam_offload, or
        HybridAdam); no decay on biases and norm weights."""
        optim = self.optim
        if self.config.offload_ratio < 1 and optim.optimizer == "hybrid_adam":
            fail("offload_ratio", self.config.offload_ratio, "DeepSpeed's partial offload runs "
                 "only with DeepSpeedCPUAdam; use optimizer fused_adam or cpu_adam, or "
                 "offload_ratio 1.0")
        groups = get_param_groups(model, optim.l2 if weight_decay is None else weight_decay)
        return build_optimizer(groups, offload=self.config.adam_offload,
                               lr=optim.learning_rate if lr is None else lr,
                               betas=tuple(betas or optim.adam_betas),
                               eps=optim.adam_eps if eps is None else eps, name=optim.optimizer)

    def create_scheduler(self, optimizer: torch.optim.Optimizer, name: str | None = None, *,
                         num_training_steps: int, num_warmup_steps: int | None = None,
                         warmup_ratio: float | None = None, min_lr_ratio: float | None = None):
        if num_warmup_steps is None and warmup_ratio is None:
            warmup_ratio = self.optim.lr_warmup_ratio
        min_lr_ratio = self.optim.min_lr_ratio if min_lr_ratio is None else min_lr_ratio
        return create_scheduler(optimizer, name or self.optim.lr_scheduler,
                                num_training_steps=num_training_steps,
                                num_warmup_steps=num_warmup_steps, warmup_ratio=warmup_ratio,
                                min_lr_ratio=min_lr_ratio)

    def prepare(self, *items: Any) -> Any:
        """``(model, optimizer, scheduler)`` tuples become training engines, bare models eval
        engines; returned in the same order (a single item is returned bare)."""
        out = [self._prepare_train(*item) if isinstance(item, tuple) else self._prepare_eval(item)
               for item in items]
        return out[0] if len(out) == 1 else out

    def _prepare_train(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Any = None):
        if self.config.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                          config=self.ds_config, dist_init_required=False)
        return engine

    def _prepare_eval(self, model: nn.Module):
        engine, *_ = deepspeed.initialize(model=model, config=self.eval_ds_config,
                                          dist_init_required=False)
        engine.eval()
        return engine

    # ------------------------------------------------------------ stepping
    def backward(self, loss: torch.Tensor, engine) -> None:
        engine.backward(loss)

    def optimizer_step(self, engine) -> None:
        """DeepSpeed steps (clip, update, schedule, zero grads) only at accumulation boundaries."""
        if engine.is_gradient_accumulation_boundary():
            if not engine_measures_grad_norm(engine):  # measured before DeepSpeed drops it
                self._grad_norms[id(engine)] = _grad_norm(engine.module)
            restart_adam_powers(engine.optimizer)  # exact resume on DeepSpeed's CPU Adam
        engine.step()

    def get_grad_norm(self, engine) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step."""
        norm = engine.get_global_grad_norm()
        norm = self._grad_norms.get(id(engine)) if norm is None else norm
        return None if norm is None else float(norm)

    def setup_dataloader(self, dataset: Dataset, batch_size: int | None = None,
                         shuffle: bool = True, collate_fn: Callable | None = None,
                         drop_last: bool = True, num_workers: int = 0,
                         seed: int | None = None) -> DataLoader:
        """A loader over this rank's shard; its sampler's position is resumable mid-epoch."""
        seed = self.config.seed if seed is None else seed
        sampler = ResumableDistributedSampler(dataset, num_replicas=self.data_parallel_size,
                                              rank=self.data_parallel_rank, shuffle=shuffle,
                                              seed=seed, drop_last=drop_last)
        # its own generator: iter() would otherwise draw from the global torch RNG, so a resumed
        # mid-epoch run would shift every later dropout mask by one draw
        generator = torch.Generator().manual_seed(seed)
        return DataLoader(dataset, batch_size=batch_size or self.config.micro_train_batch_size,
                          sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
                          num_workers=num_workers, generator=generator)

    def setup_eval_dataloader(self, dataset: Dataset, batch_size: int | None = None,
                              collate_fn: Callable | None = None,
                              num_workers: int = 0) -> DataLoader:
        """A held-out loader: this rank's shard, in order, every sample exactly once (no padding);
        ``Trainer.evaluate`` keeps ranks in step over uneven shards."""
        sampler = ShardSampler(dataset, num_replicas=self.data_parallel_size,
                               rank=self.data_parallel_rank)
        return DataLoader(dataset, batch_size=batch_size or self.config.micro_eval_batch_size,
                          sampler=sampler, collate_fn=collate_fn, num_workers=num_workers)

    # ------------------------------------------------------------ Hugging Face export
    def save_model(self, engine, tokenizer: Any, output_dir: str | Path,
                   max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None,
                   merge_lora: bool = False) -> Path:
        """Every rank: stream an HF directory (sharded safetensors, config, tokenizer; a LoRA
        model's adapter, or merged with ``merge_lora``) to ``output_dir``, atomically, written
        by rank 0 only."""
        return save_model(engine, tokenizer, output_dir, max_shard_size=max_shard_size, dtype=dtype,
                          merge_lora=merge_lora)

    # ------------------------------------------------------------ resume checkpoints
    def save_ckpt(self, engine, save_dir: str | None = None, tag: str | None = None,
                  client_state: dict | None = None, max_num: int | None = None,
                  max_mem: float | None = None, metric: float | None = None,
                  keep_best: int | None = None, higher_is_better: bool | None = None,
                  tokenizer: Any = None) -> str:
        """Every rank: save a resume checkpoint (step, samples, RNG, scheduler, ``client_state``)
        at an accumulation boundary into ``save_dir`` (default ``checkpoint.ckpt_path``). Retention
        comes from the ``CheckpointConfig`` unless given here: at most ``max_num`` checkpoints and
        ``max_mem`` GB (HF exports at ``<tag>_hf`` included), plus the ``keep_best`` best by
        ``metric``. The model's ``config.json`` (and ``tokenizer``'s files, if given) go beside the
        weights, so ``python -m strategy.export`` needs nothing else. Returns the checkpoint's
        directory."""
        ckpt = self.checkpoint
        return save_checkpoint(
            engine, save_dir or ckpt.ckpt_path, tag, client_state,
            max_num=ckpt.max_ckpt_num if max_num is None else max_num,
            max_mem=ckpt.max_ckpt_mem if max_mem is None else max_mem, metric=metric,
            keep_best=ckpt.keep_best_ckpt if keep_best is None else keep_best,
            higher_is_better=(ckpt.best_metric_higher if higher_is_better is None
                              else higher_is_better),
            write_metadata=lambda directory: save_model_metadata(engine, directory, tokenizer))

    def load_ckpt(self, engine, load_dir: str | None = None, tag: str | None = None,
                  load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                  dataloader: DataLoader | None = None,
                  universal: bool | None = None) -> tuple[str | None, dict]:
        """Every rank: resume from ``tag`` or the newest complete checkpoint in ``load_dir``
        (default ``checkpoint.ckpt_path``); returns ``(path, client_state)``, ``(None, {})`` when
        there is none. ``dataloader`` (from ``setup_dataloader``) is moved to the saved position;
        ``self.resume_state`` holds step, consumed samples, epoch and position in it. A checkpoint
        from another world size is converted to DeepSpeed's universal format (``universal``
        forces or forbids that)."""
        path, state, self.resume_state = load_checkpoint(
            engine, load_dir or self.checkpoint.ckpt_path, tag, load_optimizer_states,
            load_lr_scheduler_states, dataloader, universal)
        return path, state

    def close(self, keep_failure_hook: bool = False) -> None:
        """Drop the ZeRO-3 construction hook (so later single-process loads behave normally) and
        the failure hook (unless an error is on its way out). Safe to call more than once."""
        if self._hf_ds_config is not None:
            unset_hf_deepspeed_config()
            self._hf_ds_config = None
        if not keep_failure_hook:
            dist.remove_failure_hook()


def _grad_norm(module: nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    return torch.linalg.vector_norm(norms).item()
