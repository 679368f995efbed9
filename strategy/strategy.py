"""The facade trainers use: one object that knows ranks, ZeRO, offload and precision."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from strategy import dist
from strategy.config import OptimConfig, StrategyConfig
from strategy.data import ResumableDistributedSampler
from strategy.ds_config import build_ds_config, build_eval_ds_config
from strategy.model import build_hf_model, dtype_of
from strategy.optim import build_optimizer, get_param_groups
from strategy.scheduler import create_scheduler


class DeepSpeedStrategy:
    """DeepSpeed ZeRO 0-3 behind a small surface; trainers take it as a dependency."""

    def __init__(self, config: StrategyConfig | None = None, optim: OptimConfig | None = None) -> None:
        self.config = config or StrategyConfig()
        self.config.validate()
        self.optim = optim or OptimConfig()
        self.optim.validate()
        self._hf_ds_config = None  # keeps transformers' ZeRO-3 hook alive while models are built
        self.resume_state = None  # set by load_ckpt: a checkpoint.ResumeState, or None when nothing was resumed

    # ------------------------------------------------------------ ranks
    def setup_distributed(self, timeout: timedelta | float | None = None) -> None:
        """Validate against the launcher's world size, seed every RNG, start the process group.
        ``timeout`` (seconds or timedelta; default ``config.timeout_minutes``) bounds every collective."""
        if timeout is None:
            timeout = timedelta(minutes=self.config.timeout_minutes)
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        self.config.validate_world(dist.get_world_size())
        self._check_accelerator()
        dist.seed_everything(self.config.seed)
        dist.init_distributed(timeout)

    def _check_accelerator(self) -> None:
        from deepspeed.accelerator import get_accelerator

        from strategy.config import fail

        acc = get_accelerator()
        if self.config.fp16 and not acc.is_fp16_supported():
            fail("fp16", True, f"DeepSpeed has no fp16 training on this machine's accelerator ({acc.device_name()}); "
                 "use --bf16, or run on a GPU")
        if self.config.bf16 and not acc.is_bf16_supported():
            fail("bf16", True, f"this accelerator ({acc.device_name()}) has no bf16; use --fp16 or fp32")

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
    def accumulation_steps(self) -> int:
        return self.config.accumulation_steps(self.world_size)

    def print(self, *args: Any, **kwargs: Any) -> None:
        dist.print0(*args, **kwargs)

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce(self, data: Any, op: str = "mean") -> Any:
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
        return dtype_of(self.config.bf16, self.config.fp16)

    # ------------------------------------------------------------ models and optimizers
    def from_pretrained(self, name_or_config: Any, auto_cls: Any = None, dtype: torch.dtype | None = None,
                        **kwargs: Any) -> nn.Module:
        """Build a Hugging Face model (path, hub name or config); partitioned at construction under ZeRO-3."""
        if self.config.zero_stage == 3 and self._hf_ds_config is None:
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        return build_hf_model(name_or_config, auto_cls, dtype or self.dtype, **kwargs)

    def create_optimizer(self, model: nn.Module, lr: float | None = None, betas: tuple[float, float] | None = None,
                         weight_decay: float | None = None, eps: float | None = None) -> torch.optim.Optimizer:
        """The ``optim.optimizer`` kernel (FusedAdam, DeepSpeedCPUAdam with adam_offload, or HybridAdam);
        no decay on biases and norm weights."""
        from strategy.config import fail

        o = self.optim
        if self.config.offload_ratio < 1 and o.optimizer == "hybrid_adam":
            fail("offload_ratio", self.config.offload_ratio, "DeepSpeed's partial offload runs only with "
                 "DeepSpeedCPUAdam; use optimizer fused_adam or cpu_adam, or offload_ratio 1.0")
        groups = get_param_groups(model, o.l2 if weight_decay is None else weight_decay)
        return build_optimizer(groups, offload=self.config.adam_offload, lr=o.learning_rate if lr is None else lr,
                               betas=tuple(betas or o.adam_betas), eps=o.adam_eps if eps is None else eps,
                               name=o.optimizer)

    def create_scheduler(self, optimizer: torch.optim.Optimizer, name: str | None = None, *,
                         num_training_steps: int, num_warmup_steps: int | None = None,
                         warmup_ratio: float | None = None, min_lr_ratio: float | None = None):
        if num_warmup_steps is None and warmup_ratio is None:
            warmup_ratio = self.optim.lr_warmup_ratio
        return create_scheduler(optimizer, name or self.optim.lr_scheduler, num_training_steps=num_training_steps,
                                num_warmup_steps=num_warmup_steps, warmup_ratio=warmup_ratio,
                                min_lr_ratio=self.optim.min_lr_ratio if min_lr_ratio is None else min_lr_ratio)

    def prepare(self, *items: Any) -> Any:
        """``(model, optimizer, scheduler)`` tuples become training engines, bare models eval engines;
        returned in the same order (a single item is returned bare)."""
        out = [self._prepare_train(*item) if isinstance(item, tuple) else self._prepare_eval(item)
               for item in items]
        return out[0] if len(out) == 1 else out

    def _prepare_train(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None):
        import deepspeed

        if self.config.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                          config=self.ds_config, dist_init_required=False)
        return engine

    def _prepare_eval(self, model: nn.Module):
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=self.eval_ds_config, dist_init_required=False)
        engine.eval()
        return engine

    # ------------------------------------------------------------ stepping
    def backward(self, loss: torch.Tensor, model) -> None:
        model.backward(loss)

    def optimizer_step(self, model) -> None:
        """DeepSpeed steps (clip, update, schedule, zero grads) only at accumulation boundaries."""
        if model.is_gradient_accumulation_boundary() and not hasattr(model.optimizer, "_global_grad_norm"):
            # plain ZeRO-0 fp32: DeepSpeed clips but discards the norm, so measure it first
            grads = [p.grad for p in model.module.parameters() if p.grad is not None]
            model._strategy_grad_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item() if grads else 0.0
        model.step()

    def get_grad_norm(self, model) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step."""
        norm = model.get_global_grad_norm()
        norm = getattr(model, "_strategy_grad_norm", None) if norm is None else norm
        return None if norm is None else float(norm)

    def setup_dataloader(self, dataset: Dataset, batch_size: int | None = None, shuffle: bool = True,
                         collate_fn: Callable | None = None, drop_last: bool = True, num_workers: int = 0,
                         seed: int | None = None) -> DataLoader:
        """A loader over this rank's shard; its sampler's position is resumable mid-epoch."""
        sampler = ResumableDistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank,
                                              shuffle=shuffle, seed=self.config.seed if seed is None else seed,
                                              drop_last=drop_last)
        # its own generator: iter() would otherwise draw from the global torch RNG, so a resumed
        # mid-epoch run would shift every later dropout mask by one draw
        generator = torch.Generator().manual_seed(self.config.seed if seed is None else seed)
        return DataLoader(dataset, batch_size=batch_size or self.config.micro_train_batch_size, sampler=sampler,
                          collate_fn=collate_fn, drop_last=drop_last, num_workers=num_workers, generator=generator)

    # ------------------------------------------------------------ Hugging Face export (strategy/export.py)
    def save_model(self, model, tokenizer: Any, output_dir: str, max_shard_size: int | str = "5GB",
                   dtype: torch.dtype | str | None = None, merge_lora: bool = False):
        """Every rank: stream an HF directory (sharded safetensors, config, tokenizer; a LoRA model's
        adapter, or merged with ``merge_lora``) to ``output_dir``, atomically, written by rank 0 only."""
        from strategy.export import save_model

        return save_model(model, tokenizer, output_dir, max_shard_size=max_shard_size, dtype=dtype,
                          merge_lora=merge_lora)

    # ------------------------------------------------------------ resume checkpoints (strategy/checkpoint.py)
    def save_ckpt(self, model, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                  max_num: int = 3, max_mem: float = 1000, metric: float | None = None, keep_best: int = 0,
                  higher_is_better: bool = False) -> str:
        """Every rank: save a resume checkpoint (step, samples, RNG, scheduler, ``client_state``) at an
        accumulation boundary; keep at most ``max_num`` of them and ``max_mem`` GB (HF exports at
        ``<tag>_hf`` included), plus the ``keep_best`` best by ``metric``. Returns its directory."""
        from strategy.checkpoint import save_checkpoint

        return save_checkpoint(model, save_dir, tag, client_state, max_num=max_num, max_mem=max_mem,
                               metric=metric, keep_best=keep_best, higher_is_better=higher_is_better)

    def load_ckpt(self, model, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                  load_lr_scheduler_states: bool = True, dataloader: DataLoader | None = None,
                  universal: bool | None = None) -> tuple[str | None, dict]:
        """Every rank: resume from ``tag`` or the newest complete checkpoint; returns ``(path, client_state)``,
        ``(None, {})`` when there is none. ``dataloader`` (from ``setup_dataloader``) is moved to the saved
        position; ``self.resume_state`` holds step, consumed samples, epoch and position in it. A
        checkpoint from another world size is converted to DeepSpeed's universal format (``universal``
        forces or forbids that)."""
        from strategy.checkpoint import load_checkpoint

        path, state, self.resume_state = load_checkpoint(
            model, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, dataloader, universal)
        return path, state

    def close(self) -> None:
        """Drop the ZeRO-3 construction hook so later single-process loads behave normally."""
        if self._hf_ds_config is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            self._hf_ds_config = None
