"""The training loop every trainer shares, and its public extension API.

One optimizer step is ``accumulation_steps`` micro-batches on every data-parallel rank. The loop
takes a step's micro-batches together, counts what its loss averages over (response tokens,
pairs...) across all of them and all ranks in one collective, and only then runs the forwards,
so every token (or sample) of a step weighs the same however the step is split. An epoch runs a
whole number of steps: micro-batches left over at its end (fewer than one step's worth) are
dropped, the same rule ``plan_steps`` uses for the schedule, the progress bar and resume.

The loop never branches on rank: the strategy reduces metrics and writes files on rank 0 only,
and ranks > 0 get a null logger and a disabled progress bar.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, ClassVar, Iterator

import torch
from tqdm import tqdm

from strategy.errors import NonFiniteLossError, fail
from strategy.internals import engine_counters, skipped_steps
from strategy.log import get_logger
from strategy.metrics import create_logger
from strategy.trainers.config import TrainConfig
from strategy.trainers.data.spec import SFT
from strategy.trainers.loop.metrics import MetricSums, lockstep_batches, one_sample_batch
from strategy.trainers.loop.steps import StepPlan, plan_steps, sample_count
from strategy.trainers.loop.throughput import StepMeter

MAIN = "model"  # the name of the engine every trainer has (``Trainer.model``)
TRAINER_STATE = "trainer"  # the client_state key of ``Trainer.checkpoint_state()``
log, eval_log = get_logger("checkpoint"), get_logger("eval")


@dataclass
class Step:
    """What one optimizer step trains on.

    Attributes:
        batches: the step's micro-batches on this rank (``accumulation_steps`` of them), as
            collated (the loop moves them to the device).
        metrics: ``(sum, count)`` figures that belong to the whole step rather than to one
            micro-batch (a rollout's rewards), logged with it.
    """

    batches: list[dict]
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)


class Trainer:
    """The loop: micro-steps, accumulation, evaluation, logging, checkpoints, exports, resume.

    Subclass it and override hooks; every built-in trainer uses only what is listed here.

    Hooks (override):
        ``compute_loss(batch) -> (loss, metrics)``: required. ``loss`` is a tensor, or a dict
            of one loss per engine of ``trained_engines()``. For a mean over items (tokens,
            pairs), return ``self.normalize(sum_over_items, key)`` and count the items in
            ``loss_counts``: every item of the step then weighs the same however it is split.
            Metric values are floats (averaged over micro-batches) or ``(sum, count)`` pairs
            (exact means over items).
        ``loss_counts(batch) -> {key: count}``: the items ``normalize`` divides by (default:
            samples).
        ``eval_metrics(batch) -> metrics``: held-out figures (default: ``compute_loss`` without
            gradients, its loss weighted exactly).
        ``train_steps(epoch, count) -> Iterator[Step]``: what each optimizer step trains on
            (default: the next micro-batches of ``train_dataloader``); online RL generates its
            batches here.
        ``trained_engines() -> {name: engine}``: the engines every step backpropagates into and
            steps (default ``{"model": self.model}``); checkpoints cover them all.
        ``exported_engines() -> {name: engine}``: what the final export writes (default
            ``trained_engines()``).
        ``resume_position(state) -> (epoch, steps done in it)``: where a resumed run continues
            (default: where DeepSpeed's sample count places ``train_dataloader``); trainers with
            ``resume_by_samples = False`` place their loader themselves here.
        ``checkpoint_state() -> dict`` / ``load_checkpoint_state(state)``: the trainer's own
            JSON-safe state (a prompt cursor...), saved with every checkpoint and given back on
            resume before ``resume_position`` (default: none).
        ``on_step_end(metrics)``: called after every optimizer step with its reduced metrics.
        ``check_settings(configs, world_size)`` (classmethod): refuse settings the trainer
            cannot run, before any process group starts (``Run.from_args(trainer=cls)``).
        ``plan(strategy, num_samples, cfg, **kwargs)`` (classmethod): optimizer steps per epoch
            and in all, for the schedule, before the trainer exists.

    Class attributes:
        ``data``: the data the trainer takes (a ``DataSpec``; ``Run`` builds loaders from it).
        ``resume_by_samples``: whether one optimizer step consumes ``train_batch_size`` samples
            of ``train_dataloader`` (resume places the loader by DeepSpeed's sample count).
        ``config_classes``: config dataclasses of its own, parsed from flags and YAML by
            ``Run.from_args(trainer=cls)``.

    A subclass whose steps hold other counts of micro-batches than DeepSpeed's accumulation
    steps (micro-batches by a token budget) sets ``varying_micro_batches``: the loop then marks
    each step's last micro-batch as the accumulation boundary of every trained engine
    (``accumulation_boundary``).

    State a subclass may read: ``strategy``, ``cfg`` (``TrainConfig``), ``tokenizer``,
    ``model`` (the training engine), ``train_dataloader``, ``eval_dataloader``, ``global_step``,
    ``history`` (logged rows), ``last_eval`` (step, metrics), ``step_counts`` and
    ``micro_counts`` (items of the step on all ranks, of the micro-batch), ``ema``, ``logger``.
    Helpers it may call: ``normalize``, ``to_device``, ``train_step``, ``evaluate``,
    ``save_model``, ``save_checkpoint``, ``fit``.

    Args:
        strategy: the ``DeepSpeedStrategy`` that prepares the engines and runs the steps.
        model: the model to train.
        optimizer: its optimizer (from the strategy's ``create_optimizer``).
        scheduler: its learning-rate schedule (from ``create_scheduler``).
        train_dataloader: the training loader (from ``setup_dataloader``).
        eval_dataloader: the held-out loader (from ``setup_eval_dataloader``), or None.
        config: the ``TrainConfig`` (default: ``TrainConfig()``).
        tokenizer: saved with exports and checkpoints.

    Raises:
        ConfigError: ``eval_dataloader`` was not built by ``setup_eval_dataloader``.
    """

    data: ClassVar[Any] = SFT
    resume_by_samples: ClassVar[bool] = True
    config_classes: ClassVar[tuple] = ()  # configs of its own that Run.from_args parses
    command: ClassVar[str | None] = None  # its installed command (strategy <command>), if any

    def __init__(self, strategy, model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config: TrainConfig | None = None,
                 tokenizer: Any = None) -> None:
        sampler = getattr(eval_dataloader, "sampler", None)
        if eval_dataloader is not None and not hasattr(sampler, "max_batches"):
            fail("eval_dataloader", type(sampler).__name__, "build it with "
                 "strategy.setup_eval_dataloader (it counts every held-out sample once)")
        self.strategy, self.cfg, self.tokenizer = strategy, config or TrainConfig(), tokenizer
        self.train_dataloader, self.eval_dataloader = train_dataloader, eval_dataloader
        self.model = strategy.prepare((model, optimizer, scheduler))
        self.logger = create_logger(self.cfg.log_dir, self.cfg.use_wandb)
        self.global_step = 0
        self.history: list[dict] = []
        self.last_eval: tuple[int, dict] = (-1, {})  # (step, metrics) of the latest evaluation
        self.step_counts: dict[str, float] = {}  # items of this step (or evaluation), all ranks
        self.meter = StepMeter(self.model, strategy, self.cfg.peak_tflops)
        self.ema = strategy.create_ema(self.model, self.cfg.ema_beta) if self.cfg.ema_beta else None
        self.varying_micro_batches = False  # steps of any count of micro-batches
        self._micro_counts: dict[str, float] = {}  # items of the current micro-batch
        self._loss_scale = 1.0  # undoes DeepSpeed's mean over micro-batches and ranks
        self._normalized = False  # whether the last compute_loss called normalize
        self._eval_share = 1.0  # one held-out batch's share of an exactly weighted eval loss
        self._bar: tqdm | None = None

    # ------------------------------------------------------------ hooks
    def compute_loss(self, batch: dict) -> tuple[torch.Tensor | dict, dict]:
        """The micro-batch's loss (one per trained engine, as a dict, when there are several;
        a detached one under another name is logged as ``<name>_loss`` only) and its metrics.

        Args:
            batch: one micro-batch on the device (this rank's sequence slice under sequence
                parallelism).

        Returns:
            ``(loss, metrics)``.

        Raises:
            NotImplementedError: a subclass must implement it.
        """
        raise NotImplementedError("a trainer must implement compute_loss(batch) -> (loss, metrics)")

    def loss_counts(self, batch: dict) -> dict[str, int]:
        """The items of ``batch`` that ``normalize(total, key)`` divides by, per key.

        Args:
            batch: one collated micro-batch (whole sequences).

        Returns:
            ``{key: count}``; default ``{"samples": rows}``.
        """
        return {"samples": int(batch["input_ids"].shape[0])}

    def eval_metrics(self, batch: dict) -> dict:
        """Held-out metrics of one batch; default ``compute_loss``'s, its loss weighted exactly.

        Args:
            batch: one held-out batch on the device.

        Returns:
            Metrics: floats, or ``(sum, count)`` pairs.
        """
        loss, metrics = self.compute_loss(batch)
        loss = loss[MAIN] if isinstance(loss, dict) else loss
        value = self.strategy.sequence_sum(loss.detach()).item()  # sequence slices add up
        if self._normalized:  # an exact share of the evaluation's loss: the shares add up
            return {"loss": (value, self._eval_share), **metrics}
        return {"loss": value, **metrics}

    def train_steps(self, epoch: int, count: int) -> Iterator[Step]:
        """The next ``count`` optimizer steps' micro-batches of ``epoch``.

        Args:
            epoch: the epoch (the sampler is already set to it).
            count: how many steps to yield.

        Returns:
            An iterator of ``Step``; default: ``train_dataloader``'s next micro-batches.
        """
        batches = iter(self.train_dataloader)
        for _ in range(count):
            yield Step(list(islice(batches, self.strategy.accumulation_steps)))

    def trained_engines(self) -> dict[str, Any]:
        """The engines each step trains, by name (``compute_loss`` returns a loss per name when
        there are several); the first is ``"model"``.

        Returns:
            ``{"model": self.model}`` by default.
        """
        return {MAIN: self.model}

    def accumulation_boundary(self, last: bool) -> None:
        """With ``varying_micro_batches``, before each micro-batch: whether it ends the step, on
        every trained engine (a subclass with a model trained elsewhere tells it too).

        Args:
            last: the next micro-batch is the step's last.
        """
        for engine in self.trained_engines().values():
            self.strategy.accumulation_boundary(engine, last)

    def exported_engines(self) -> dict[str, Any]:
        """The engines the final export writes: ``model`` to ``save_path``, another ``name`` to
        ``<save_path>_<name>``.

        Returns:
            ``trained_engines()`` by default (PPO leaves its critic out unless asked).
        """
        return self.trained_engines()

    def resume_position(self, state: Any) -> tuple[int, int]:
        """Where a resumed run continues, after its checkpoint loaded (``global_step`` is set).

        Args:
            state: the strategy's ``ResumeState`` (step, samples, the loader's epoch and place).

        Returns:
            ``(epoch, optimizer steps of that epoch already done)``; ``train_dataloader`` must
            stand there.
        """
        stream = self.train_dataloader.dataset
        if hasattr(stream, "resume_at"):  # a stream: skip what this rank already trained on
            per_step = self.strategy.accumulation_steps * self.train_dataloader.batch_size
            stream.resume_at(state.global_step * per_step)
            return 0, state.global_step
        return state.epoch, state.epoch_consumed // self.strategy.config.train_batch_size

    def checkpoint_state(self) -> dict:
        """The trainer's own state a resume needs, saved with every checkpoint (the same on
        every rank; rank 0's is written).

        Returns:
            A JSON-safe dict; default ``{}``.
        """
        return {}

    def load_checkpoint_state(self, state: dict) -> None:
        """Take back what ``checkpoint_state`` saved, on resume before ``resume_position``.

        Args:
            state: the dict saved (``{}`` from a checkpoint saved without one).
        """

    def on_step_end(self, metrics: dict) -> None:
        """Called after every optimizer step with its metrics (reduced over ranks).

        Args:
            metrics: the step's figures (loss and ``compute_loss``'s metrics).
        """

    @classmethod
    def check_settings(cls, configs: dict[type, Any], world_size: int) -> None:
        """Refuse, before any process group starts, settings this trainer cannot run
        (``Run.from_args(trainer=cls)`` calls it; default: nothing to refuse).

        Args:
            configs: the parsed configs by class (``StrategyConfig``, ``TrainConfig``...).
            world_size: ranks the launcher started.
        """

    @classmethod
    def loaders(cls, strategy, tokenizer: Any, data: Any, **_: Any) -> tuple[Any, Any]:
        """(train, held-out) loaders of the data this trainer declares (``cls.data``), before the
        trainer exists.

        Args:
            strategy: the started strategy (batch sizes, data-parallel shards).
            tokenizer: turns text into ids.
            data: the ``DataConfig``.
            **_: the trainer's own keyword arguments, for trainers whose data depends on them.

        Returns:
            The training loader and the held-out loader (None without ``--eval_dataset``).
        """
        return cls.data.loaders(strategy, tokenizer, data)

    @classmethod
    def plan(cls, strategy, num_samples: int | None, cfg: TrainConfig, **_: Any) -> StepPlan:
        """Optimizer steps per epoch and in all, before the trainer exists (for the schedule).

        Args:
            strategy: the strategy (batch sizes, world size).
            num_samples: training samples (or prompts) in the data; None for a stream.
            cfg: the ``TrainConfig`` (epochs, max steps).
            **_: the trainer's own keyword arguments, for trainers whose steps depend on them.

        Returns:
            The ``StepPlan``.
        """
        return plan_steps(num_samples, strategy.config.train_batch_size, cfg.max_epochs,
                          cfg.max_steps)

    # ------------------------------------------------------------ helpers for hooks
    def normalize(self, total: torch.Tensor, key: str) -> torch.Tensor:
        """This micro-batch's share of a step's mean over ``key`` items.

        Args:
            total: a sum over this micro-batch's ``key`` items (``loss_counts``).
            key: the item kind, a key of ``loss_counts``.

        Returns:
            ``total`` divided by the items of the whole step on all ranks (``loss_weighting:
            step``, scaled for DeepSpeed's averaging) or of this micro-batch (``micro_batch``).
        """
        self._normalized = True
        if self.cfg.loss_weighting == "micro_batch" and self.model.training:
            return total / max(self._micro_counts[key], 1)
        return total * self._loss_scale / max(self.step_counts[key], 1)

    @property
    def micro_counts(self) -> dict[str, float]:
        """The items (``loss_counts``) of the micro-batch ``compute_loss`` is seeing."""
        return dict(self._micro_counts)

    @property
    def step_plan(self) -> StepPlan:
        """This trainer's ``plan`` over its training data."""
        return self.plan(self.strategy, sample_count(self.train_dataloader), self.cfg)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch."""
        return self.step_plan.steps_per_epoch

    def total_steps(self) -> int:
        """Optimizer steps of the whole run.

        Returns:
            ``step_plan.total_steps``.
        """
        return self.step_plan.total_steps

    def to_device(self, batch: dict) -> dict:
        """``batch`` with its tensors on the model's device (other values as they are).

        Args:
            batch: a collated batch.

        Returns:
            A new dict: tensors moved to ``model.device``, other values unchanged.
        """
        device = self.model.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    # ------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train to the end (resuming first with ``load_checkpoint``), export the final model.

        Returns:
            The last evaluation's metrics ({} without held-out data).

        Raises:
            NonFiniteLossError: a training loss was not finite (not with fp16's loss scaler).
        """
        start_epoch, done_in_epoch = self._resume() if self.cfg.load_checkpoint else (0, 0)
        if self.cfg.eval_on_start and self.global_step == 0 and self.eval_dataloader is not None:
            self.evaluate()
        plan = self.step_plan
        self._bar = tqdm(total=plan.total_steps, initial=self.global_step, desc="train",
                         dynamic_ncols=True, disable=not self.strategy.is_rank_0, mininterval=2.0)
        for epoch in range(start_epoch, self.cfg.max_epochs):
            if epoch > start_epoch or not self.cfg.load_checkpoint:
                sampler = getattr(self.train_dataloader, "sampler", None)
                if hasattr(sampler, "set_epoch"):  # a stream reshuffles itself each pass
                    sampler.set_epoch(epoch)
                done_in_epoch = 0
            steps = min(plan.steps_per_epoch - done_in_epoch, plan.total_steps - self.global_step)
            for step in self.meter.timed(self.train_steps(epoch, steps)):
                self.train_step(step, epoch)
            if self.global_step >= plan.total_steps:
                break
        self._bar.close()
        final = self.evaluate() if self.eval_dataloader is not None else {}
        self._export_all(self.cfg.save_path)
        if self.cfg.save_ema:
            self.save_model(f"{self.cfg.save_path.rstrip('/')}_ema", ema=self.ema)
        self.logger.close()
        return final

    def train_step(self, step: Step, epoch: int = 0) -> dict:
        """One optimizer step of every trained engine over ``step``'s micro-batches, then its
        bookkeeping: EMA, metrics (logged every ``logging_steps``), evaluation and checkpoint
        at their cadence. Every rank calls it alike.

        Args:
            step: the micro-batches (and step-level metrics) to train on.
            epoch: the epoch, for the logs.

        Returns:
            The step's metrics, reduced over ranks.
        """
        for engine in self.trained_engines().values():
            engine.train()
        self._loss_scale = self.strategy.loss_scale
        self.meter.start()
        sums = MetricSums()
        micro = self._step_batches(step.batches)
        for index, (batch, counts) in enumerate(micro):
            self._set_micro_counts(counts)
            if self.varying_micro_batches:  # DeepSpeed steps after the step's last one
                self.accumulation_boundary(index == len(micro) - 1)
            loss, metrics = self.compute_loss(batch)
            sums.add({**self._backward_and_step(loss, len(micro)), **metrics})
        sums.add_totals(step.metrics)
        return self._after_step(epoch, sums)

    def _backward_and_step(self, loss: torch.Tensor | dict, count: int) -> dict[str, float]:
        """Backward and (at the accumulation boundary) step each engine; the logged losses (a
        mean over the step's ``count`` micro-batches: each weighted as DeepSpeed weighs it,
        1 / its accumulation steps), a loss of a model trained elsewhere too (PPO's critic
        group: logged alike, not backpropagated here)."""
        losses = loss if isinstance(loss, dict) else {MAIN: loss}
        share = count / self.strategy.accumulation_steps
        for name, engine in self.trained_engines().items():
            self.strategy.backward(losses[name], engine)
            self.strategy.optimizer_step(engine)
        return {"loss" if name == MAIN else f"{name}_loss":
                self.strategy.sequence_sum(value.detach()).item() * share
                for name, value in losses.items()}

    def _step_batches(self, batches: list[dict]) -> list[tuple[dict, dict]]:
        """The step's micro-batches on the device, and the items they hold on all ranks."""
        micro = [self.to_device(batch) for batch in batches]
        counts = [self.loss_counts(batch) for batch in micro]
        if self.cfg.loss_weighting == "step":  # the one collective that makes losses exact
            local = {key: float(sum(c[key] for c in counts)) for key in counts[0]}
            self.step_counts = self.strategy.all_reduce(local, op="sum", group="data")
        for batch in micro:
            self.meter.count(batch)
        return [(self.strategy.shard_sequence(batch), count) for batch, count in zip(micro, counts)]

    def _set_micro_counts(self, counts: dict[str, float]) -> None:
        self._micro_counts, self._normalized = counts, False

    def _after_step(self, epoch: int, sums: MetricSums) -> dict:
        self.global_step += 1
        self._check_in_step()
        if self.ema is not None:
            self.ema.update()
        metrics, totals = sums.reduce(self.strategy, self.meter.local())  # all ranks: same loss
        self.meter.finish(totals)
        for key, value in metrics.items():
            if key == "loss" or key.endswith("_loss"):
                self._check_finite(key, value, epoch)
        cfg = self.cfg
        if self.global_step % cfg.logging_steps == 0:
            self._log(epoch, metrics)
        if self._bar is not None:
            self._bar.update(1)
        self.on_step_end(metrics)
        if cfg.eval_steps > 0 and self.global_step % cfg.eval_steps == 0:
            self.evaluate()
        if cfg.save_steps > 0 and self.global_step % cfg.save_steps == 0:
            self.save_checkpoint()
        return metrics

    def _log(self, epoch: int, metrics: dict) -> None:
        metrics.update(lr=self.model.get_lr()[0], grad_norm=self.strategy.get_grad_norm(self.model),
                       epoch=epoch, skipped_steps=skipped_steps(self.model),
                       **self.meter.report())
        self.logger.log(self.global_step, metrics)
        self.history.append({"step": self.global_step, **metrics})
        if self._bar is not None:
            self._bar.set_postfix(self.meter.postfix(metrics))

    def _check_in_step(self) -> None:
        """The loop and DeepSpeed agree on where optimizer steps fall."""
        engine_steps = engine_counters(self.model)[0]
        if engine_steps != self.global_step:
            raise RuntimeError(f"the loop counts {self.global_step} optimizer steps but DeepSpeed "
                               f"counts {engine_steps}; a micro-batch went astray (report this)")

    def _check_finite(self, name: str, loss: float, epoch: int) -> None:
        """fp16: the loss scaler skips overflow steps (counted in ``skipped_steps``); otherwise a
        non-finite loss stops every rank at once, naming the step."""
        if math.isfinite(loss) or self.strategy.config.fp16:
            return
        raise NonFiniteLossError(
            f"non-finite training {name} ({loss}) at step {self.global_step}, epoch {epoch}; "
            "lower --learning_rate, keep --max_norm > 0, or check the data (last checkpoint in "
            f"{self.strategy.checkpoint.ckpt_path} if --save_steps was set)")

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Exact held-out metrics on all ranks (collective): every sample counted once, losses
        weighted by their items; logged and returned.

        Returns:
            The metrics, the same on every rank.
        """
        engines = self.trained_engines().values()
        for engine in engines:
            engine.eval()
        metrics = self._evaluate_lockstep(self.eval_dataloader)
        self.logger.log(self.global_step, metrics, prefix="eval")
        self.last_eval = (self.global_step, metrics)
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        eval_log.info("step %d: %s", self.global_step, shown)
        for engine in engines:
            engine.train()
        return metrics

    def _evaluate_lockstep(self, loader) -> dict:
        """The items every loss averages over are counted over the whole set first (one
        collective); each batch's loss is then its share of the whole. Ranks whose shard ran out
        run filler batches whose metrics are discarded (ZeRO-3 gathers in every forward)."""
        counts = dict.fromkeys(self.loss_counts(one_sample_batch(loader)), 0.0)  # same keys
        batches = 0
        for batch in loader:
            batches += 1
            for key, value in self.loss_counts(batch).items():
                counts[key] = counts.get(key, 0.0) + float(value)
        totals = self.strategy.all_reduce({"counts": counts, "batches": batches}, op="sum",
                                          group="data")
        self.step_counts, self._loss_scale = totals.get("counts", {}), 1.0
        self._eval_share = 1.0 / max(int(totals["batches"]), 1)
        sums = MetricSums()
        for batch, real in lockstep_batches(loader):
            batch = self.to_device(batch)
            self._set_micro_counts(self.loss_counts(batch))
            sums.add(self.eval_metrics(self.strategy.shard_sequence(batch)), weight=int(real))
        return sums.reduce(self.strategy)[0]

    # ------------------------------------------------------------ persistence
    def save_model(self, path: str, ema=None, engine=None) -> None:
        """Export an engine (default ``model``; with ``ema`` its moving average) as an HF
        directory at ``path`` (collective; rank 0 writes).

        Args:
            path: the output directory.
            ema: the moving average to export instead of the current weights.
            engine: the engine to export (default ``self.model``).
        """
        self.strategy.save_model(engine or self.model, self.tokenizer, path,
                                 max_shard_size=self.cfg.max_shard_size, ema=ema)

    def _export_all(self, path: str) -> None:
        """Every exported engine: ``model`` to ``path``, another ``name`` to ``<path>_<name>``."""
        for name, engine in self.exported_engines().items():
            self.save_model(path if name == MAIN else _beside(path, name), engine=engine)

    def save_checkpoint(self) -> None:
        """Save a resume checkpoint of every trained engine at this step (collective): ``model``
        in ``ckpt_path``, another engine ``name`` in ``<ckpt_path>_<name>``, same tag. With
        ``disable_ds_ckpt`` (OpenRLHF's flag): only an HF export at ``<ckpt_path>/<tag>_hf``."""
        tag = f"global_step{self.global_step}"
        hf_path = os.path.join(self.strategy.checkpoint.ckpt_path, f"{tag}_hf")
        if self.cfg.disable_ds_ckpt:  # an export, no DeepSpeed state: nothing to resume from
            self.save_model(hf_path)
            log.info("saved %s (no DeepSpeed state: --disable_ds_ckpt)", hf_path)
            return
        metric = self._checkpoint_metric()
        path = self.strategy.save_ckpt(self.model, tag=tag, metric=metric,
                                       client_state={TRAINER_STATE: self.checkpoint_state()},
                                       tokenizer=self.tokenizer, ema=self.ema)
        for name, engine in self._extra_engines():
            self.strategy.save_ckpt(engine, save_dir=_beside(self.strategy.checkpoint.ckpt_path,
                                                             name), tag=tag, metric=metric)
        if self.cfg.save_hf_ckpt:
            self.save_model(hf_path)
        log.info("saved %s", path)

    def _extra_engines(self) -> list[tuple[str, Any]]:
        return [(name, e) for name, e in self.trained_engines().items() if name != MAIN]

    def _checkpoint_metric(self) -> float | None:
        """The eval metric best-K retention ranks this checkpoint by (evaluated now if the last
        evaluation was at another step); None when best-K retention is off."""
        ckpt = self.strategy.checkpoint
        if not ckpt.keep_best_ckpt or self.eval_dataloader is None:
            return None
        if self.last_eval[0] != self.global_step:
            self.evaluate()
        metrics = self.last_eval[1]
        if ckpt.best_metric not in metrics:
            fail("best_metric", ckpt.best_metric,
                 f"evaluation reports {sorted(metrics)}; pick one")
        return metrics[ckpt.best_metric]

    def _resume(self) -> tuple[int, int]:
        """Load the newest complete checkpoint of every engine; return (epoch, steps already
        done in it) from ``resume_position``."""
        sampled = hasattr(getattr(self.train_dataloader, "sampler", None), "load_state_dict")
        loader = self.train_dataloader if self.resume_by_samples and sampled else None
        loaded = self.strategy.load_ckpt(self.model, dataloader=loader, ema=self.ema)
        if loaded.path is None:
            where = self.strategy.checkpoint.ckpt_path
            log.info("nothing to resume in %s; starting fresh", where)
            return 0, 0
        state = loaded.resume
        for name, engine in self._extra_engines():
            self.strategy.load_ckpt(engine, _beside(self.strategy.checkpoint.ckpt_path, name),
                                    tag=state.tag)
        self.global_step = state.global_step
        self.load_checkpoint_state(dict(loaded.client_state.get(TRAINER_STATE, {})))
        log.info("resumed %s at step %d", loaded.path, self.global_step)
        return self.resume_position(state)


def _beside(path: str, name: str) -> str:
    return f"{path.rstrip('/')}_{name}"


__all__ = ["MAIN", "Step", "StepPlan", "Trainer", "plan_steps"]
