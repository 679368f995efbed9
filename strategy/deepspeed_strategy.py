"""``DeepSpeedStrategy``: the facade trainers use, the one object that knows ranks, ZeRO, offload
and precision. Each method hands its work to the subsystem that owns it."""

from __future__ import annotations

import os
import socket
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from strategy import dist
from strategy.checkpoint import (
    CheckpointConfig,
    CheckpointStorage,
    ResumeState,
    Retention,
    RunLayout,
    load_checkpoint,
    save_checkpoint,
)
from strategy.config import StrategyConfig, build_ds_config, build_eval_ds_config
from strategy.dtypes import training_dtype
from strategy.ema import EMA
from strategy.errors import CheckpointFileError, fail
from strategy.export import save_model, save_model_metadata
from strategy.internals import release_tensor_parallel_groups, restart_adam_powers
from strategy.log import get_logger
from strategy.model import ModelFactory
from strategy.optim import OptimConfig, build_optimizer, create_scheduler, get_param_groups
from strategy.parallel import GradNorms, SequenceParallel
from strategy.sampler import ResumableDistributedSampler, ShardSampler

export_log = get_logger("export")


class DeepSpeedStrategy:
    """DeepSpeed ZeRO 0-3 behind a small surface; trainers take it as a dependency.

    Use it as a context manager (``with DeepSpeedStrategy(...) as strategy:``) so ``close()`` runs
    even when training raises."""

    def __init__(self, config: StrategyConfig | None = None, optim: OptimConfig | None = None,
                 checkpoint: CheckpointConfig | None = None) -> None:
        self.config = config or StrategyConfig()
        self.optim = optim or OptimConfig()
        self.checkpoint = checkpoint or CheckpointConfig()
        self.models = ModelFactory(self.config.zero_stage, lambda: self.ds_config,
                                   lambda: self.eval_ds_config)  # holds the ZeRO-3 hook
        self.grad_norms = GradNorms(self.config.tensor_parallel_size > 1)  # ZeRO-0's, measured
        self.storage = CheckpointStorage(self.checkpoint)  # each checkpoint directory's kind
        self.sequence: SequenceParallel | None = None  # Ulysses groups (sequence_parallel_size > 1)
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
        dist.from_slurm()  # the ranks srun started
        self.config.validate_world(dist.get_world_size())
        self._check_accelerator()
        dist.seed_everything(self.config.seed)
        dist.init_distributed(timeout)
        dist.install_failure_hook()
        if self.config.sequence_parallel_size > 1:
            self.sequence = SequenceParallel(self.config.sequence_parallel_size)
        self.checkpoint_storage()  # found (and logged) before any training

    def checkpoint_storage(self, directory: str | None = None) -> str:
        """Collective: ``"shared"`` or ``"node_local"`` for ``directory`` (default
        ``checkpoint.ckpt_path``, whose kind DeepSpeed is configured for; other directories must
        be of the same kind). Found once per directory (``checkpoint.checkpoint_storage`` may
        insist on one)."""
        return self.storage.kind(directory)

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
        return self.config.data_parallel_rank(self.rank)

    @property
    def accumulation_steps(self) -> int:
        return self.config.accumulation_steps(self.world_size)

    def print(self, *args: Any, **kwargs: Any) -> None:
        dist.print0(*args, **kwargs)

    def barrier(self) -> None:
        dist.barrier()

    def checked(self, fn: Callable, *args: Any) -> Any:
        """Collective: ``fn(*args)`` on every rank; an error on any rank is raised on all of them
        (one line naming the rank), so a trainer never branches on which rank failed."""
        return dist.checked(fn, *args)

    def on_rank_0(self, fn: Callable, *args: Any) -> Any:
        """Collective: ``fn(*args)`` runs on rank 0 only (file writes); every rank returns its
        result or raises its error."""
        return dist.on_rank_0(fn, *args)

    def all_reduce(self, data: Any, op: str = "mean", group: str = "world") -> Any:
        """Reduce over every rank (``group="world"``), or over the data-parallel ranks (``"data"``,
        for values every rank of a sequence/tensor-parallel group holds alike: each is counted
        once)."""
        out = dist.all_reduce(data, op)
        if group == "data" and op == "sum":
            out = _scaled(out, 1.0 / self.config.model_parallel_size)
        return out

    # ------------------------------------------------------------ sequence parallelism
    @property
    def sequence_parallel_size(self) -> int:
        return self.config.sequence_parallel_size

    def shard_sequence(self, batch: dict) -> dict:
        """This rank's slice of a batch's sequence (unchanged without sequence parallelism)."""
        return batch if self.sequence is None else self.sequence.shard(batch)

    def sequence_sum(self, tensor: torch.Tensor, keep_gradient: bool = False) -> torch.Tensor:
        """Sum over the sequence-parallel group (unchanged without it)."""
        return tensor if self.sequence is None else self.sequence.sum(tensor, keep_gradient)

    @property
    def loss_scale(self) -> int:
        """What a loss normalized over a step's items is multiplied by so DeepSpeed's gradient
        reduction (a mean over micro-batches and data-parallel ranks) leaves the step's mean."""
        return self.accumulation_steps * self.data_parallel_size

    def all_gather(self, data: Any) -> Any:
        return dist.all_gather(data)

    @property
    def ds_config(self) -> dict:
        out = build_ds_config(self.config, self.world_size)
        out.update(self.storage.deepspeed_section())  # node-local: each node writes its copy
        return out

    @property
    def eval_ds_config(self) -> dict:
        return build_eval_ds_config(self.config, self.world_size)

    @property
    def dtype(self) -> torch.dtype:
        return training_dtype(self.config.bf16, self.config.fp16)

    # ------------------------------------------------------------ models and optimizers
    def from_pretrained(self, name_or_config: Any, auto_cls: Any = None,
                        dtype: torch.dtype | None = None, frozen: bool = False,
                        **kwargs: Any) -> nn.Module:
        """Build a Hugging Face model (path, hub name or config); partitioned at construction
        under ZeRO-3. ``frozen``: a model that only runs forwards (a reference or reward model),
        built as its eval engine keeps it (with ``ref_offload``: partitioned onto the CPU)."""
        return self.models.build(name_or_config, auto_cls, dtype or self.dtype, frozen, **kwargs)

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
        mpu = self._mpu(model, self.config.micro_train_batch_size)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                          config=self.ds_config, dist_init_required=False, mpu=mpu)
        return engine

    def _prepare_eval(self, model: nn.Module):
        mpu = self._mpu(model, self.config.micro_eval_batch_size)
        engine, *_ = deepspeed.initialize(model=model, config=self.eval_ds_config,
                                          dist_init_required=False, mpu=mpu)
        engine.eval()
        return engine

    def _mpu(self, model: nn.Module, micro_batch_size: int) -> Any:
        """Ulysses' groups for ``deepspeed.initialize`` (installing its attention on first use)."""
        if self.sequence is None:
            return None
        self.sequence.install(model, micro_batch_size)
        return self.sequence.mpu

    # ------------------------------------------------------------ stepping
    def backward(self, loss: torch.Tensor, engine) -> None:
        """Under sequence parallelism ZeRO 1/2 sum a gradient over the sequence ranks, ZeRO-3
        averages over them too: its loss is scaled up by their number to match."""
        zero3_average = self.config.zero_stage == 3 and self.sequence is not None
        engine.backward(loss * self.sequence_parallel_size if zero3_average else loss)

    def optimizer_step(self, engine) -> None:
        """DeepSpeed steps (clip, update, schedule, zero grads) only at accumulation boundaries."""
        if engine.is_gradient_accumulation_boundary():
            self.grad_norms.before_step(engine)  # measured before DeepSpeed drops the gradients
            restart_adam_powers(engine.optimizer)  # exact resume on DeepSpeed's CPU Adam
        engine.step()

    def get_grad_norm(self, engine) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step."""
        return self.grad_norms.get(engine)

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
                   merge_lora: bool = False, ema: EMA | None = None) -> Path:
        """Every rank: stream an HF directory (sharded safetensors, config, tokenizer; a LoRA
        model's adapter, or merged with ``merge_lora``) to ``output_dir``, atomically, written
        by rank 0 only; with ``ema`` the moving-average weights instead of the current ones."""
        with ema.swapped_in() if ema is not None else nullcontext():
            out = save_model(engine, tokenizer, output_dir, max_shard_size=max_shard_size,
                             dtype=dtype, merge_lora=merge_lora)
        export_log.info("save_model wrote %s from global rank 0 on %s", os.path.abspath(out),
                        socket.gethostname())
        return out

    # ------------------------------------------------------------ resume checkpoints
    def save_ckpt(self, engine, save_dir: str | None = None, tag: str | None = None,
                  client_state: dict | None = None, *, retention: Retention | None = None,
                  metric: float | None = None, tokenizer: Any = None,
                  ema: EMA | None = None) -> str:
        """Every rank: save a resume checkpoint at an accumulation boundary.

        It holds step, consumed samples, every RNG, the scheduler and ``client_state``; the
        model's ``config.json`` (and ``tokenizer``'s files) go beside the weights, so
        ``python -m strategy.export`` needs nothing else. Once it is published, ``retention``
        deletes the checkpoints it does not keep.

        Args:
            engine: the training engine (from ``prepare``).
            save_dir: the checkpoint directory (default ``checkpoint.ckpt_path``), of the same
                storage kind as ``ckpt_path``.
            tag: the checkpoint's name (default ``global_step<N>``).
            client_state: a JSON-safe dict ``load_ckpt`` returns.
            retention: which checkpoints to keep (default ``Retention.from_config`` of the
                ``CheckpointConfig``); HF exports at ``<tag>_hf`` count toward ``max_mem``.
            metric: this checkpoint's value of the metric ``keep_best`` ranks by.
            tokenizer: saved beside the weights when given.
            ema: its moving-average weights are saved too.

        Returns:
            The checkpoint's directory.

        Raises:
            ConfigError: not at an accumulation boundary, a bad tag, or ``save_dir`` of another
                storage kind.
            SaveError: a rank failed to write (every rank raises it; earlier checkpoints stay).
        """
        return save_checkpoint(
            engine, save_dir or self.checkpoint.ckpt_path, tag, client_state,
            retention=retention or Retention.from_config(self.checkpoint), metric=metric,
            write_metadata=lambda directory: save_model_metadata(engine, directory, tokenizer),
            layout=self.layout, node_local=self.storage.is_node_local(save_dir),
            rank_files=None if ema is None else ema.save)

    def load_ckpt(self, engine, load_dir: str | None = None, tag: str | None = None,
                  load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                  dataloader: DataLoader | None = None, universal: bool | None = None,
                  ema: EMA | None = None) -> tuple[str | None, dict]:
        """Every rank: resume from ``tag`` or the newest complete checkpoint in ``load_dir``
        (default ``checkpoint.ckpt_path``); returns ``(path, client_state)``, ``(None, {})`` when
        there is none. ``dataloader`` (from ``setup_dataloader``) is moved to the saved position;
        ``self.resume_state`` holds step, consumed samples, epoch and position in it. A checkpoint
        from another world size is converted to DeepSpeed's universal format (``universal``
        forces or forbids that). ``ema`` gets its saved weights back."""
        path, state, self.resume_state = load_checkpoint(
            engine, load_dir or self.checkpoint.ckpt_path, tag, load_optimizer_states,
            load_lr_scheduler_states, dataloader, universal, layout=self.layout,
            node_local=self.storage.is_node_local(load_dir))
        if ema is not None and path is not None:
            dist.checked(ema.load, path, self.rank, make=lambda rank, message: CheckpointFileError(
                f"loading EMA weights failed on rank {rank}: {message}"))
        return path, state

    def create_ema(self, engine, beta: float) -> EMA:
        """A moving average of ``engine``'s trainable weights, partitioned as they are; call
        ``ema.update()`` after each optimizer step (``Trainer`` does with ``--ema_beta``)."""
        return EMA(engine.module, beta)

    @property
    def layout(self) -> RunLayout:
        """What a checkpoint records of the run's shape, for its resume to check and count."""
        cfg = self.config
        return RunLayout(cfg.sequence_parallel_size, cfg.tensor_parallel_size,
                         cfg.train_batch_size)

    def close(self, keep_failure_hook: bool = False) -> None:
        """Drop the ZeRO-3 construction hook (so later single-process loads behave normally) and
        the failure hook (unless an error is on its way out). Safe to call more than once."""
        self.models.close()
        if self.sequence is not None:
            self.sequence.close()
            self.sequence = None
        if self.config.tensor_parallel_size > 1:
            release_tensor_parallel_groups()
        if not keep_failure_hook:
            dist.remove_failure_hook()


def _scaled(data: Any, factor: float) -> Any:
    """Numbers, tensors and nested dicts of them, times ``factor``."""
    if isinstance(data, dict):
        return {key: _scaled(value, factor) for key, value in data.items()}
    return data * factor

