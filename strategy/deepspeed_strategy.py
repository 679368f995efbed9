"""``DeepSpeedStrategy``: the facade trainers use, the one object that knows ranks, ZeRO, offload
and precision. Each method hands its work to the subsystem that owns it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import socket
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from strategy import dist
from strategy.checkpoint import (
    CheckpointConfig,
    CheckpointStorage,
    LoadedCheckpoint,
    Retention,
    RunLayout,
    load_checkpoint,
    save_checkpoint,
)
from strategy.config import StrategyConfig, build_ds_config, build_eval_ds_config
from strategy.dtypes import training_dtype
from strategy.ema import EMA, moving_average
from strategy.engines import (
    check_training_engine,
    is_asleep,
    sleep_engine,
    unpackable,
    wake_engine,
)
from strategy.errors import CheckpointFileError, fail
from strategy.export import save_model, save_model_metadata
from strategy.internals import (
    cache_cpu_info,
    release_tensor_parallel_groups,
    restart_adam_powers,
)
from strategy.log import get_logger
from strategy.model import ModelFactory
from strategy.optim import OptimConfig, build_optimizer, create_scheduler, get_param_groups
from strategy.parallel import GradNorms, SequenceParallel
from strategy.rollout import (
    EngineRollout,
    GatheredRollout,
    RolloutEngine,
    check_fits,
    free_memory_bytes,
    is_partitioned,
    vllm_rollout,
)
from strategy.rollout.config import RolloutConfig
from strategy.rollout.vllm_checks import check_vllm_settings
from strategy.sampler import ResumableDistributedSampler, ShardSampler

export_log = get_logger("export")
cache_cpu_info()  # DeepSpeed's op loads ask py-cpuinfo 5 times a rank (~6 s of CPU): once a machine


class DeepSpeedStrategy:
    """DeepSpeed ZeRO 0-3 behind a small surface; trainers take it as a dependency.

    Use it as a context manager (``with DeepSpeedStrategy(...) as strategy:``) so ``close()`` runs
    even when training raises.

    Args:
        config: ranks, ZeRO stage, precision, batch sizes (default ``StrategyConfig()``).
        optim: optimizer and schedule settings (default ``OptimConfig()``).
        checkpoint: where checkpoints go and how many are kept (default
            ``CheckpointConfig()``).

    Attributes:
        config: the run's ``StrategyConfig``; ``optim`` its ``OptimConfig``, ``checkpoint`` its
            ``CheckpointConfig``.
        models: builds models under the ZeRO-3 construction hook (``model.ModelFactory``).
        grad_norms: the norms DeepSpeed does not measure (``parallel.GradNorms``).
        storage: each checkpoint directory's storage kind (``checkpoint.CheckpointStorage``).
        sequence: the Ulysses groups, or None without sequence parallelism.

    OpenRLHF's call forms work beside these (``prepare((model, optim, scheduler))`` unpacking
    into three, ``backward(loss, model, optim)``, ``optimizer_step(optim, model, scheduler)``,
    ``save_ckpt(model, dir, tag, max_num, max_mem, client_state)``, ``is_rank_0()``, ...).
    """

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
        self._apart: Any = None  # ``apart``'s process group, made once
        self._timeout = timedelta(minutes=self.config.timeout_minutes)  # setup_distributed's

    def __enter__(self) -> DeepSpeedStrategy:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # an escaping exception still needs the failure hook: it names the rank and exits at once
        self.close(keep_failure_hook=exc_type is not None)

    def derive(self, **changes: Any) -> DeepSpeedStrategy:
        """A strategy for another trained engine of this run with ZeRO settings of its own (a PPO
        critic at another stage or offload): ``changes`` to the ``StrategyConfig``. It shares this
        one's process group, optimizer settings, checkpoint storage and parallel groups; the
        models it builds are partitioned as its own stage says, whatever this one's. Close only
        the strategy it came from.

        Args:
            **changes: ``StrategyConfig`` fields, e.g. ``zero_stage=3, adam_offload=True``.

        Returns:
            The derived strategy.

        Raises:
            ConfigError: the changed config is invalid (one line naming the field).
        """
        child = copy.copy(self)
        child.config = dataclasses.replace(self.config, **changes)
        child.models = ModelFactory(child.config.zero_stage, lambda: child.ds_config,
                                    lambda: child.eval_ds_config, transient=True)
        return child

    # ------------------------------------------------------------ ranks
    def setup_distributed(self, timeout: timedelta | float | None = None) -> None:
        """Start the run: validate the configs against the launcher's world size, seed every
        RNG, start the process group, install the failure hook, make the sequence-parallel
        groups and find the checkpoint storage.

        Args:
            timeout: bound on every collective, in seconds or a ``timedelta`` (default
                ``config.timeout_minutes``).

        Raises:
            ConfigError: the world size does not fit the batch and parallel sizes, the accelerator
                lacks the requested precision, or the checkpoint storage contradicts its setting.
        """
        if timeout is None:
            timeout = timedelta(minutes=self.config.timeout_minutes)
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        self._timeout = timeout  # every collective's bound, the groups made later too
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
        """Collective (the first time per directory): the storage kind of a checkpoint directory.

        Args:
            directory: default ``checkpoint.ckpt_path``, the kind DeepSpeed is configured for.

        Returns:
            ``"shared"`` (one filesystem for every node) or ``"node_local"``.

        Raises:
            ConfigError: the directory's kind differs from ``ckpt_path``'s, or from the
                ``checkpoint_storage`` setting.
        """
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
        """This process's global rank."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return dist.get_world_size()

    @property
    def is_rank_0(self) -> dist.RankFlag:
        """Whether this is global rank 0 (the one that writes shared files): a flag that is
        also callable, so ``if strategy.is_rank_0:`` and OpenRLHF's ``strategy.is_rank_0()``
        both tell."""
        return dist.RankFlag(dist.is_rank_0())

    def get_rank(self) -> int:
        """This process's global rank (OpenRLHF's form of ``rank``).

        Returns:
            The rank.
        """
        return dist.get_rank()

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data (all of them, without sequence or tensor parallelism)."""
        return self.config.data_parallel_size(self.world_size)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel ranks (its data shard)."""
        return self.config.data_parallel_rank(self.rank)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.config.accumulation_steps(self.world_size)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (through ``strategy.log``, no prefix).

        Args:
            *args: what ``print`` takes.
            **kwargs: ``sep``, ``end``, ``flush`` as ``print`` takes them.
        """
        dist.print0(*args, **kwargs)

    def barrier(self) -> None:
        """Collective: wait until every rank gets here."""
        dist.barrier()

    def checked(self, fn: Callable, *args: Any) -> Any:
        """Collective: ``fn(*args)`` on every rank; an error on any rank is raised on all of them
        (one line naming the rank), so a trainer never branches on which rank failed.

        Args:
            fn: what to call.
            *args: its arguments.

        Returns:
            This rank's result.

        Raises:
            RankFailedError: ``fn`` failed on some rank (one line naming it), on every rank.
        """
        return dist.checked(fn, *args)

    def apart(self) -> Callable[[], ContextManager[None]]:
        """For a thread working beside the main one (episodes played ahead): a context under
        which that thread's collectives (``checked``, ``all_reduce``, ``all_gather_object``)
        go over a process group of their own, so they never mix with the main thread's, which
        may run at the same time. Collective the first time (it makes the group), so every rank
        asks for it at the same point, on its main thread.

        Returns:
            What the thread enters: ``with context():``.
        """
        if self._apart is None and dist.is_initialized():
            self._apart = torch.distributed.new_group(list(range(self.world_size)),
                                                      timeout=self._timeout)
        return functools.partial(dist.collectives_on, self._apart)

    def on_rank_0(self, fn: Callable, *args: Any) -> Any:
        """Collective: ``fn(*args)`` runs on rank 0 only (file writes).

        Args:
            fn: what rank 0 calls.
            *args: its arguments.

        Returns:
            Rank 0's result, on every rank.

        Raises:
            Exception: rank 0's error, on every rank.
        """
        return dist.on_rank_0(fn, *args)

    def all_reduce(self, data: Any, op: str = "mean", group: str = "world") -> Any:
        """Collective: reduce numbers, tensors or nested dicts of them over the ranks.

        Args:
            data: what to reduce (a tensor is not changed in place).
            op: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.
            group: ``"world"`` (every rank), or ``"data"`` for values every rank of a
                sequence/tensor-parallel group holds alike (each is counted once).

        Returns:
            The reduced value, the same on every rank.
        """
        out = dist.all_reduce(data, op)
        if group == "data" and op == "sum":
            out = _scaled(out, 1.0 / self.config.model_parallel_size)
        return out

    # ------------------------------------------------------------ sequence parallelism
    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that share one sequence (Ulysses); 1 without sequence parallelism."""
        return self.config.sequence_parallel_size

    def shard_sequence(self, batch: dict) -> dict:
        """This rank's slice of a batch's sequence.

        Args:
            batch: ``input_ids``, ``labels`` and optionally ``position_ids``.

        Returns:
            The slice (``input_ids``, ``position_ids``, ``shift_labels``); the batch unchanged
            without sequence parallelism.
        """
        return batch if self.sequence is None else self.sequence.shard(batch)

    def sequence_sum(self, tensor: torch.Tensor, keep_gradient: bool = False) -> torch.Tensor:
        """Collective over the sequence-parallel group: the sum of ``tensor``.

        Args:
            tensor: this rank's part (a loss sum, a token count).
            keep_gradient: let the backward sum the gradients too.

        Returns:
            The sum; ``tensor`` unchanged without sequence parallelism.
        """
        return tensor if self.sequence is None else self.sequence.sum(tensor, keep_gradient)

    @property
    def loss_scale(self) -> int:
        """What a loss normalized over a step's items is multiplied by so DeepSpeed's gradient
        reduction (a mean over micro-batches and data-parallel ranks) leaves the step's mean."""
        return self.accumulation_steps * self.data_parallel_size

    def all_gather(self, data: Any) -> Any:
        """Collective: every rank's ``data``.

        Args:
            data: a tensor, a number, or a dict of them.

        Returns:
            Tensors concatenated along dim 0, numbers as a list in rank order (a dict of those).
        """
        return dist.all_gather(data)

    def all_gather_object(self, obj: Any) -> list:
        """Collective: every rank's picklable ``obj`` (token lists, rows...), in rank order.

        Args:
            obj: any picklable object.

        Returns:
            One per rank.
        """
        return dist.all_gather_object(obj)

    @property
    def ds_config(self) -> dict:
        """The DeepSpeed config of training engines (``build_ds_config``, checkpoint storage)."""
        out = build_ds_config(self.config, self.world_size)
        out.update(self.storage.deepspeed_section())  # node-local: each node writes its copy
        return out

    @property
    def eval_ds_config(self) -> dict:
        """The DeepSpeed config of eval engines (frozen models: reference, reward)."""
        return build_eval_ds_config(self.config, self.world_size)

    @property
    def dtype(self) -> torch.dtype:
        """The training dtype: bf16, fp16 or fp32."""
        return training_dtype(self.config.bf16, self.config.fp16)

    # ------------------------------------------------------------ models and optimizers
    def from_pretrained(self, name_or_config: Any, auto_cls: Any = None,
                        dtype: torch.dtype | None = None, frozen: bool = False,
                        **kwargs: Any) -> nn.Module:
        """Build a Hugging Face model, partitioned at construction when its engine runs ZeRO-3.

        Args:
            name_or_config: a local path, a hub name, or a ``PretrainedConfig`` (random weights).
            auto_cls: the ``AutoModel...`` class (default ``AutoModelForCausalLM``).
            dtype: default the training dtype.
            frozen: a model that only runs forwards (a reference or reward model), built as its
                eval engine keeps it (with ``ref_offload``: partitioned onto the CPU).
            **kwargs: passed to ``from_pretrained``/``from_config``.

        Returns:
            The model (not yet an engine: pass it to ``prepare``).

        Raises:
            CorruptWeightsError: a local directory's safetensors are truncated or missing.
        """
        return self.models.build(name_or_config, auto_cls, dtype or self.dtype, frozen, **kwargs)

    def create_optimizer(self, model: nn.Module, lr: float | None = None,
                         betas: tuple[float, float] | None = None,
                         weight_decay: float | None = None,
                         eps: float | None = None) -> torch.optim.Optimizer:
        """The ``optim.optimizer`` kernel (FusedAdam, DeepSpeedCPUAdam with ``adam_offload``, or
        HybridAdam) over ``model``'s trainable parameters; no decay on biases and norm weights.

        Args:
            model: the model (before ``prepare``).
            lr: default ``optim.learning_rate``.
            betas: default ``optim.adam_betas``.
            weight_decay: default ``optim.l2``.
            eps: default ``optim.adam_eps``.

        Returns:
            The optimizer, for ``prepare``.

        Raises:
            ConfigError: ``offload_ratio`` below 1 with HybridAdam.
        """
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
        """A learning-rate schedule with warmup.

        Args:
            optimizer: from ``create_optimizer``.
            name: default ``optim.lr_scheduler``.
            num_training_steps: optimizer steps of the whole run.
            num_warmup_steps: warmup steps; default from ``warmup_ratio``.
            warmup_ratio: warmup as a share of the run (default ``optim.lr_warmup_ratio``).
            min_lr_ratio: the floor as a share of the peak (default ``optim.min_lr_ratio``).

        Returns:
            The scheduler, for ``prepare``.

        Raises:
            ConfigError: an unknown name or a bad warmup.
        """
        if num_warmup_steps is None and warmup_ratio is None:
            warmup_ratio = self.optim.lr_warmup_ratio
        min_lr_ratio = self.optim.min_lr_ratio if min_lr_ratio is None else min_lr_ratio
        return create_scheduler(optimizer, name or self.optim.lr_scheduler,
                                num_training_steps=num_training_steps,
                                num_warmup_steps=num_warmup_steps, warmup_ratio=warmup_ratio,
                                min_lr_ratio=min_lr_ratio)

    def prepare(self, *items: Any, is_rlhf: bool = False) -> Any:
        """Turn models into DeepSpeed engines.

        A training engine also unpacks as ``(engine, engine.optimizer, engine.lr_scheduler)``, so
        both ``engine = prepare((m, o, s))`` and OpenRLHF's ``m, o, s = prepare((m, o, s))`` work.

        Args:
            *items: ``(model, optimizer, scheduler)`` tuples become training engines (a tuple
                whose model is None: ``(None, None, None)``), bare models eval engines.
            is_rlhf: OpenRLHF's flag, accepted for its callers; it changes nothing here.

        Returns:
            The engines in the same order; a single item's engine bare.
        """
        out = [self._prepare_item(item) for item in items]
        return out[0] if len(out) == 1 else out

    def _prepare_item(self, item: Any) -> Any:
        if not isinstance(item, tuple):
            return self._prepare_eval(item)
        if item[0] is None:
            return None, None, None
        return unpackable(self._prepare_train(*item))

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
        """Ulysses' groups for ``deepspeed.initialize`` (installing its attention for the model's
        implementation on first use)."""
        if self.sequence is None:
            return None
        self.sequence.install(model, micro_batch_size)
        return self.sequence.mpu

    def rollout_engine(self, engine: Any, gather: str = "full",
                       rollout: RolloutConfig | None = None,
                       max_model_len: int = 0) -> RolloutEngine:
        """What an on-policy trainer generates with (``strategy.rollout``): with
        ``rollout.rollout_engine == "vllm"`` a vLLM engine on this rank, fed the policy's weights
        by ``sync``; under ZeRO-3 with ``gather="full"`` a plain copy of the policy refreshed by
        one grouped gather per rollout (refused in one line, on every rank, when it would not fit
        in a rank's free memory); otherwise the engine's own module (ZeRO-3: one gather per layer
        per token). Collective.

        Args:
            engine: the policy's engine.
            gather: ``"full"`` or ``"layer"`` (the ``hf`` engine under ZeRO-3).
            rollout: the ``RolloutConfig`` (None: ``hf``).
            max_model_len: vLLM's longest prompt + completion.

        Returns:
            A ``RolloutEngine``: call ``sync()`` after the policy changed, then ``generate``.

        Raises:
            ConfigError: ``full`` needs more memory than a rank has free.
        """
        if rollout is not None and rollout.vllm:
            check_vllm_settings(rollout, self.world_size)
            apart = rollout.vllm_num_engines  # engines apart from training (Ray actors)
            ranks = self.world_size // apart if apart else rollout.vllm_tensor_parallel_size
            return vllm_rollout(engine, rollout, max_model_len,  # an engine's ranks seed it
                                self.config.seed * 1_009 + self.rank // ranks)  # alike
        if gather == "full" and is_partitioned(engine.module):
            check_fits(engine.module, int(self.all_reduce(float(free_memory_bytes()), op="min")))
            return GatheredRollout(engine, self.models.build_plain)
        return EngineRollout(engine, self.config.zero_stage == 3 and self.world_size > 1)

    # ------------------------------------------------------------ stepping
    def backward(self, loss: torch.Tensor, model, optimizer: Any = None) -> None:
        """Backward through the engine ``model``. Under sequence parallelism ZeRO 1/2 sum a
        gradient over the sequence ranks, ZeRO-3 averages over them too: its loss is scaled up by
        their number to match.

        Args:
            loss: this micro-batch's loss.
            model: the training engine.
            optimizer: OpenRLHF's third argument: the engine's optimizer (DeepSpeed owns it; only
                checked to be this engine's).

        Raises:
            ConfigError: ``model`` is no training engine, or ``optimizer`` is not its optimizer.
        """
        check_training_engine(model, optimizer)
        self._wake(model)
        zero3_average = self.config.zero_stage == 3 and self.sequence is not None
        model.backward(loss * self.sequence_parallel_size if zero3_average else loss)

    def sleep(self, *engines: Any) -> None:
        """With ``--ds_enable_sleep``: each training engine's Adam states, fp32 master weights
        and gradients to CPU memory until its next ``backward`` (or checkpoint), which brings
        them back; the 16-bit weights stay, for the rollout's forwards (OpenRLHF's
        ``offload_deepspeed_states``). Nothing without the flag, or with ``--adam_offload``
        (they live on CPU already). This rank alone: no collective.

        Args:
            *engines: training engines (from ``prepare``).
        """
        if not self.config.ds_enable_sleep or self.config.adam_offload:
            return
        for engine in engines:
            check_training_engine(engine, None)
            sleep_engine(engine)

    def _wake(self, model) -> None:
        """``model``'s training states back on its device where ``sleep`` moved them."""
        if self.config.ds_enable_sleep:
            wake_engine(model)

    def asleep(self, model) -> bool:
        """Whether a training engine's states are off the device (``sleep``).

        Args:
            model: the training engine.

        Returns:
            True from ``sleep`` until its next ``backward`` (or checkpoint).
        """
        return is_asleep(model)

    def accumulation_boundary(self, model, last: bool) -> None:
        """Mark whether the next micro-batch ends the optimizer step (``last``), for steps of
        any count of micro-batches (a token budget's): DeepSpeed then reduces and steps there,
        not every ``gradient_accumulation_steps``. The loss scale (``loss_scale``) is unchanged:
        a loss normalized over the step's items stays exact for any count.

        Args:
            model: the training engine.
            last: whether the next backward is the step's last.
        """
        check_training_engine(model, None)
        model.set_gradient_accumulation_boundary(last)

    def optimizer_step(self, optimizer: Any, model: Any = None, scheduler: Any = None,
                       name: str = "model") -> None:
        """Step the engine: DeepSpeed clips, updates, schedules and zeroes the gradients only at
        accumulation boundaries; the gradient norm is measured first where DeepSpeed does not.

        Two forms, told apart by type: ``optimizer_step(engine)``, and OpenRLHF's
        ``optimizer_step(optimizer, engine, scheduler, name="model")``.

        Args:
            optimizer: the training engine itself, or (OpenRLHF's form, with ``model``) the
                optimizer ``prepare`` returned with it.
            model: OpenRLHF's form: the training engine.
            scheduler: OpenRLHF's form: the scheduler given to ``prepare`` (the engine steps it).
            name: OpenRLHF's label of the model; unused.

        Raises:
            ConfigError: no training engine was given, or the optimizer or scheduler is not the
                engine's own.
        """
        engine = optimizer if model is None else model
        check_training_engine(engine, None if model is None else optimizer, scheduler)
        if engine.is_gradient_accumulation_boundary():
            self.grad_norms.before_step(engine)  # measured before DeepSpeed drops the gradients
            restart_adam_powers(engine.optimizer)  # exact resume on DeepSpeed's CPU Adam
        engine.step()

    def get_grad_norm(self, engine) -> float | None:
        """The global gradient norm (before clipping) of ``engine``'s last optimizer step.

        Args:
            engine: the training engine.

        Returns:
            The norm, or None before the first step.
        """
        return self.grad_norms.get(engine)

    def setup_dataloader(self, dataset: Dataset, batch_size: int | None = None,
                         pin_memory: bool = False, shuffle: bool = True,
                         collate_fn: Callable | None = None, drop_last: bool = True,
                         num_workers: int = 0, seed: int | None = None) -> DataLoader:
        """A training loader over this rank's data-parallel shard; its sampler's position is
        resumable mid-epoch (``load_ckpt(dataloader=...)``). The positional order is OpenRLHF's.

        Args:
            dataset: a map-style dataset.
            batch_size: default ``micro_train_batch_size``.
            pin_memory: batches in page-locked memory (faster copies to a GPU).
            shuffle: shuffle each epoch (seeded).
            collate_fn: builds a batch from samples.
            drop_last: drop the last incomplete batch.
            num_workers: loader worker processes.
            seed: default ``config.seed``.

        Returns:
            The loader.
        """
        seed = self.config.seed if seed is None else seed
        sampler = ResumableDistributedSampler(dataset, num_replicas=self.data_parallel_size,
                                              rank=self.data_parallel_rank, shuffle=shuffle,
                                              seed=seed, drop_last=drop_last)
        # its own generator: iter() would otherwise draw from the global torch RNG, so a resumed
        # mid-epoch run would shift every later dropout mask by one draw
        generator = torch.Generator().manual_seed(seed)
        return DataLoader(dataset, batch_size=batch_size or self.config.micro_train_batch_size,
                          sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
                          num_workers=num_workers, generator=generator, pin_memory=pin_memory)

    def setup_eval_dataloader(self, dataset: Dataset, batch_size: int | None = None,
                              collate_fn: Callable | None = None,
                              num_workers: int = 0) -> DataLoader:
        """A held-out loader: this rank's shard, in order, every sample exactly once (no padding);
        ``Trainer.evaluate`` keeps ranks in step over uneven shards.

        Args:
            dataset: a map-style dataset.
            batch_size: default ``micro_eval_batch_size``.
            collate_fn: builds a batch from samples.
            num_workers: loader worker processes.

        Returns:
            The loader.
        """
        sampler = ShardSampler(dataset, num_replicas=self.data_parallel_size,
                               rank=self.data_parallel_rank)
        return DataLoader(dataset, batch_size=batch_size or self.config.micro_eval_batch_size,
                          sampler=sampler, collate_fn=collate_fn, num_workers=num_workers)

    # ------------------------------------------------------------ Hugging Face export
    def save_model(self, model, tokenizer: Any, output_dir: str | Path,
                   max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None,
                   merge_lora: bool = False, ema: EMA | None = None) -> Path:
        """Every rank: stream a Hugging Face directory to ``output_dir``, atomically, written by
        rank 0 only.

        Args:
            model: an engine or a module.
            tokenizer: saved beside the weights (None: none).
            output_dir: the directory to create or replace.
            max_shard_size: bytes per safetensors shard, or a size such as ``"5GB"``.
            dtype: the written weights' dtype (default as trained).
            merge_lora: a PEFT model's adapter folded into its base weights instead of the adapter.
            ema: write its moving-average weights instead of the current ones.

        Returns:
            ``output_dir`` as a ``Path``.

        Raises:
            SaveError: a rank failed to write (every rank raises it).
        """
        with ema.swapped_in() if ema is not None else nullcontext():
            out = save_model(model, tokenizer, output_dir, max_shard_size=max_shard_size,
                             dtype=dtype, merge_lora=merge_lora)
        export_log.info("save_model wrote %s from global rank 0 on %s", os.path.abspath(out),
                        socket.gethostname())
        return out

    # ------------------------------------------------------------ resume checkpoints
    def save_ckpt(self, model, save_dir: str | None = None, tag: str | None = None,
                  max_num: int | Mapping | None = None, max_mem: float | None = None,
                  client_state: dict | None = None, save_latest: bool = True, *,
                  retention: Retention | None = None, metric: float | None = None,
                  tokenizer: Any = None, ema: EMA | None = None) -> str:
        """Every rank: save a resume checkpoint at an accumulation boundary.

        It holds step, consumed samples, every RNG, the scheduler and ``client_state``; the
        model's ``config.json`` (and ``tokenizer``'s files) go beside the weights, so
        ``python -m strategy.export`` needs nothing else. Once it is published, ``retention``
        deletes the checkpoints it does not keep. The positional order is OpenRLHF's
        (``model, save_dir, tag, max_num, max_mem, client_state, save_latest``); a dict in
        ``max_num``'s place is the ``client_state`` (``save_ckpt(engine, dir, tag, state)``).

        Args:
            model: the training engine (from ``prepare``).
            save_dir: the checkpoint directory (default ``checkpoint.ckpt_path``), of the same
                storage kind as ``ckpt_path``.
            tag: the checkpoint's name (default ``global_step<N>``).
            max_num: keep at most this many checkpoints (default ``max_ckpt_num``).
            max_mem: keep at most this many GB, as OpenRLHF counts them (default
                ``max_ckpt_mem``).
            client_state: a JSON-safe dict ``load_ckpt`` returns.
            save_latest: point ``latest`` at this checkpoint, so a resume without a tag loads
                it (DeepSpeed's meaning); False leaves ``latest`` naming the one it named.
            retention: which checkpoints to keep (default ``Retention.from_config`` of the
                ``CheckpointConfig`` with ``max_num``/``max_mem``); HF exports at ``<tag>_hf``
                count toward ``max_mem``.
            metric: this checkpoint's value of the metric ``keep_best`` ranks by.
            tokenizer: saved beside the weights when given.
            ema: its moving-average weights are saved too.

        Returns:
            The checkpoint's directory.

        Raises:
            ConfigError: not at an accumulation boundary, a bad tag or limit, ``client_state``
                given twice, ``retention`` with ``max_num``/``max_mem``, or ``save_dir`` of
                another storage kind.
            SaveError: a rank failed to write (every rank raises it; earlier checkpoints stay).
        """
        if isinstance(max_num, Mapping):  # today's positional client_state
            if client_state is not None:
                fail("client_state", client_state, "give it once (a dict 4th is client_state)")
            max_num, client_state = None, dict(max_num)
        if retention is not None and (max_num, max_mem) != (None, None):
            fail("retention", retention, "give retention or max_num/max_mem, not both")
        self._wake(model)
        return save_checkpoint(
            model, save_dir or self.checkpoint.ckpt_path, tag, client_state,
            retention=retention or Retention.from_config(self.checkpoint, max_num, max_mem),
            metric=metric, save_latest=save_latest,
            write_metadata=lambda directory: save_model_metadata(model, directory, tokenizer),
            layout=self.layout, node_local=self.storage.is_node_local(save_dir),
            rank_files=None if ema is None else ema.save)

    def load_ckpt(self, model, load_dir: str | None = None, tag: str | None = None,
                  load_module_strict: bool = True, load_optimizer_states: bool = True,
                  load_lr_scheduler_states: bool = True, *, dataloader: DataLoader | None = None,
                  universal: bool | None = None, ema: EMA | None = None) -> LoadedCheckpoint:
        """Every rank: resume from a checkpoint. The positional order is OpenRLHF's.

        Args:
            model: the training engine (from ``prepare``).
            load_dir: default ``checkpoint.ckpt_path``.
            tag: default the one ``latest`` names, else the newest complete checkpoint.
            load_module_strict: the saved weights must name exactly the model's.
            load_optimizer_states: restore the optimizer.
            load_lr_scheduler_states: restore the scheduler.
            dataloader: a loader from ``setup_dataloader``, moved to the saved position.
            universal: force (True) or forbid (False) DeepSpeed's universal conversion; by default
                used when the world size changed.
            ema: gets its saved weights back.

        Returns:
            A ``LoadedCheckpoint``: unpacks as ``(path, client_state)``, ``(None, {})`` when there
            is nothing to resume; its ``resume`` holds step, consumed samples, epoch and position
            in it (None when nothing was loaded).

        Raises:
            ConfigError: the checkpoint was saved at other sequence/tensor-parallel sizes, or the
                tag does not exist.
            CheckpointFileError: a file is damaged, holds objects beyond tensors, or the EMA part is
                missing (every rank raises it).
        """
        self._wake(model)
        loaded = load_checkpoint(
            model, load_dir or self.checkpoint.ckpt_path, tag, load_optimizer_states,
            load_lr_scheduler_states, dataloader, universal, layout=self.layout,
            node_local=self.storage.is_node_local(load_dir), load_module_strict=load_module_strict)
        if ema is not None and loaded.path is not None:
            dist.checked(ema.load, loaded.path, self.rank,
                         make=lambda rank, message: CheckpointFileError(
                             f"loading EMA weights failed on rank {rank}: {message}"))
        return loaded

    def create_ema(self, engine, beta: float) -> EMA:
        """A moving average of ``engine``'s trainable weights, partitioned as they are; call
        ``ema.update()`` after each optimizer step (``Trainer`` does with ``--ema_beta``).

        Args:
            engine: the training engine.
            beta: the decay, in (0, 1).

        Returns:
            The ``EMA``.

        Raises:
            ConfigError: ``beta`` outside (0, 1).
        """
        return EMA(engine.module, beta)

    def moving_average(self, model, model_ema, beta: float = 0.992,
                       device: str | torch.device = "cpu") -> None:
        """OpenRLHF's EMA: ``model_ema``'s weights (an eval engine's, from ``prepare``) move
        toward ``model``'s, ``ema = beta * ema + (1 - beta) * weights``. Call it after every
        ``optimizer_step``: it averages only right after a step that updated the weights (at an
        accumulation boundary). Collective under ZeRO-3 (each pair of weights is gathered);
        ``create_ema`` keeps a partitioned average without gathering.

        Args:
            model: the training engine.
            model_ema: the engine or module holding the average, built like ``model``.
            beta: the decay, in (0, 1).
            device: where the arithmetic runs.

        Raises:
            ConfigError: ``beta`` outside (0, 1), or ``model_ema`` built otherwise.
        """
        moving_average(model, model_ema, beta, device)

    @property
    def layout(self) -> RunLayout:
        """What a checkpoint records of the run's shape, for its resume to check and count."""
        cfg = self.config
        return RunLayout(cfg.sequence_parallel_size, cfg.tensor_parallel_size,
                         cfg.train_batch_size)

    def close(self, keep_failure_hook: bool = False) -> None:
        """Drop the ZeRO-3 construction hook (so later single-process loads behave normally), the
        sequence- and tensor-parallel groups, and the failure hook. Safe to call more than once.

        Args:
            keep_failure_hook: keep the hook (an error is on its way out).
        """
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
