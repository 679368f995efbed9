"""The training loop every trainer shares; subclasses override small hooks.

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
from itertools import islice
from typing import Any, Iterator

import torch
from tqdm import tqdm

from strategy.errors import NonFiniteLossError, fail
from strategy.internals import engine_counters, skipped_steps
from strategy.metrics import create_logger
from strategy.trainers.aggregate import MetricSums, evaluate_lockstep
from strategy.trainers.config import TrainConfig
from strategy.trainers.steps import StepPlan, plan_steps
from strategy.trainers.throughput import StepMeter


class Trainer:
    """Owns micro-steps, accumulation, evaluation, logging, checkpoints, exports and resume.

    Hooks:
      - ``compute_loss(batch) -> (loss, metrics)`` (required). For a loss that is a mean over
        items (tokens, pairs), return ``self.normalize(sum_over_items, key)``: the loop makes each
        item of the whole step (or evaluation) weigh the same. A plain micro-batch mean also works
        (each micro-batch then weighs the same). Metric values are floats (averaged over
        micro-batches) or ``(sum, count)`` pairs (exact means over items).
      - ``loss_counts(batch) -> {key: count}``: the items ``normalize`` divides by; default the
        number of samples.
      - ``eval_metrics(batch) -> metrics``: defaults to ``compute_loss`` without gradients.
    """

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
        self._micro_counts: dict[str, float] = {}  # items of the current micro-batch
        self._loss_scale = 1.0  # undoes DeepSpeed's mean over micro-batches and ranks
        self._normalized = False  # whether the last compute_loss called normalize
        self.meter = StepMeter(self.model, strategy, self.cfg.peak_tflops)
        self.ema = strategy.create_ema(self.model, self.cfg.ema_beta) if self.cfg.ema_beta else None

    # ------------------------------------------------------------ hooks
    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError("a trainer must implement compute_loss(batch) -> (loss, metrics)")

    def loss_counts(self, batch: dict) -> dict[str, int]:
        return {"samples": int(batch["input_ids"].shape[0])}

    def eval_metrics(self, batch: dict) -> dict:
        loss, metrics = self.compute_loss(batch)
        value = self.strategy.sequence_sum(loss.detach()).item()  # sequence slices add up
        if self._normalized:  # an exact share of the evaluation's loss: the shares add up
            return {"loss": (value, self._eval_share), **metrics}
        return {"loss": value, **metrics}

    def normalize(self, total: torch.Tensor, key: str) -> torch.Tensor:
        """``total`` (a sum over this micro-batch's ``key`` items) as this micro-batch's share of
        the loss: divided by the items of the whole step on all ranks (``loss_weighting: step``)
        or by this micro-batch's own (``micro_batch``)."""
        self._normalized = True
        if self.cfg.loss_weighting == "micro_batch" and self.model.training:
            return total / max(self._micro_counts[key], 1)
        return total * self._loss_scale / max(self.step_counts[key], 1)

    def set_micro_counts(self, counts: dict[str, float]) -> None:
        """The items of the micro-batch ``compute_loss`` is about to see (the loop calls this)."""
        self._micro_counts, self._normalized = counts, False

    def to_device(self, batch: dict) -> dict:
        device = self.model.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    # ------------------------------------------------------------ loop
    @classmethod
    def plan(cls, strategy, num_samples: int, cfg: TrainConfig, **_: Any) -> StepPlan:
        """Optimizer steps per epoch and in all, before the trainer exists (for the schedule);
        the trainer's keyword arguments come along for trainers whose steps depend on them."""
        return plan_steps(num_samples, strategy.config.train_batch_size, cfg.max_epochs,
                          cfg.max_steps)

    @property
    def step_plan(self) -> StepPlan:
        return self.plan(self.strategy, len(self.train_dataloader.dataset), self.cfg)

    @property
    def steps_per_epoch(self) -> int:
        return self.step_plan.steps_per_epoch

    def total_steps(self) -> int:
        return self.step_plan.total_steps

    def fit(self) -> dict:
        """Train to the end (resuming first if asked); export the final model; return the last
        eval metrics."""
        start_epoch, done_in_epoch = self._resume() if self.cfg.load_checkpoint else (0, 0)
        if self.cfg.eval_on_start and self.global_step == 0 and self.eval_dataloader is not None:
            self.evaluate()
        plan = self.step_plan
        bar = tqdm(total=plan.total_steps, initial=self.global_step, desc="train",
                   dynamic_ncols=True, disable=not self.strategy.is_rank_0, mininterval=2.0)
        for epoch in range(start_epoch, self.cfg.max_epochs):
            if epoch > start_epoch or not self.cfg.load_checkpoint:
                self.train_dataloader.sampler.set_epoch(epoch)
                done_in_epoch = 0
            steps = min(plan.steps_per_epoch - done_in_epoch, plan.total_steps - self.global_step)
            self._train_epoch(epoch, steps, bar)
            if self.global_step >= plan.total_steps:
                break
        bar.close()
        final = self.evaluate() if self.eval_dataloader is not None else {}
        self.save_model(self.cfg.save_path)
        if self.cfg.save_ema:
            self.save_model(f"{self.cfg.save_path.rstrip('/')}_ema", ema=self.ema)
        self.logger.close()
        return final

    def _step_batches(self, batches: Iterator) -> list[tuple[dict, dict]]:
        """The next optimizer step's micro-batches, and the items they hold on all ranks."""
        step = islice(batches, self.strategy.accumulation_steps)
        micro = [self.to_device(batch) for batch in step]
        counts = [self.loss_counts(batch) for batch in micro]
        if self.cfg.loss_weighting == "step":  # the one collective that makes losses exact
            local = {key: float(sum(c[key] for c in counts)) for key in counts[0]}
            self.step_counts = self.strategy.all_reduce(local, op="sum", group="data")
        for batch in micro:
            self.meter.count(batch)
        return [(self.strategy.shard_sequence(batch), count) for batch, count in zip(micro, counts)]

    def _train_epoch(self, epoch: int, steps: int, bar: tqdm) -> None:
        """``steps`` optimizer steps from where the loader stands."""
        self.model.train()
        self._loss_scale = self.strategy.loss_scale
        batches = iter(self.train_dataloader)
        for _ in range(steps):
            self.meter.start()
            sums = MetricSums()
            for batch, counts in self._step_batches(batches):
                self.set_micro_counts(counts)
                loss, metrics = self.compute_loss(batch)
                self.strategy.backward(loss, self.model)
                self.strategy.optimizer_step(self.model)
                logged = self.strategy.sequence_sum(loss.detach())  # sequence slices add up
                sums.add({"loss": logged.item(), **metrics})
            self._after_step(epoch, sums, bar)

    def _after_step(self, epoch: int, sums: MetricSums, bar: tqdm) -> None:
        self.global_step += 1
        self._check_in_step()
        if self.ema is not None:
            self.ema.update()
        metrics, totals = sums.reduce(self.strategy, self.meter.local())  # all ranks: same loss
        self.meter.finish(totals)
        self._check_finite(metrics["loss"], epoch)
        cfg = self.cfg
        if self.global_step % cfg.logging_steps == 0:
            self._log(epoch, metrics, bar)
        bar.update(1)
        if cfg.eval_steps > 0 and self.global_step % cfg.eval_steps == 0:
            self.evaluate()
        if cfg.save_steps > 0 and self.global_step % cfg.save_steps == 0:
            self.save_checkpoint()

    def _log(self, epoch: int, metrics: dict, bar: tqdm) -> None:
        metrics.update(lr=self.model.get_lr()[0], grad_norm=self.strategy.get_grad_norm(self.model),
                       epoch=epoch, skipped_steps=skipped_steps(self.model),
                       **self.meter.report())
        self.logger.log(self.global_step, metrics)
        self.history.append({"step": self.global_step, **metrics})
        bar.set_postfix(self.meter.postfix(metrics))

    def _check_in_step(self) -> None:
        """The loop and DeepSpeed agree on where optimizer steps fall."""
        engine_steps = engine_counters(self.model)[0]
        if engine_steps != self.global_step:
            raise RuntimeError(f"the loop counts {self.global_step} optimizer steps but DeepSpeed "
                               f"counts {engine_steps}; a micro-batch went astray (report this)")

    def _check_finite(self, loss: float, epoch: int) -> None:
        """fp16: the loss scaler skips overflow steps (counted in ``skipped_steps``); otherwise a
        non-finite loss stops every rank at once, naming the step."""
        if math.isfinite(loss) or self.strategy.config.fp16:
            return
        raise NonFiniteLossError(
            f"non-finite training loss ({loss}) at step {self.global_step}, epoch {epoch}; lower "
            "--learning_rate, keep --max_norm > 0, or check the data (last checkpoint in "
            f"{self.strategy.checkpoint.ckpt_path} if --save_steps was set)")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Exact held-out metrics on all ranks: every sample counted once, losses weighted by
        their items; logged and returned."""
        self.model.eval()
        metrics = evaluate_lockstep(self, self.eval_dataloader)
        self.logger.log(self.global_step, metrics, prefix="eval")
        self.last_eval = (self.global_step, metrics)
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        self.strategy.print(f"[eval] step {self.global_step}: {shown}")
        self.model.train()
        return metrics

    def prepare_eval_counts(self, counts: dict[str, float], batches: int) -> None:
        """Called by the evaluation before its forwards: the items of the whole held-out set."""
        self.step_counts, self._loss_scale = counts, 1.0
        self._eval_share = 1.0 / max(batches, 1)

    # ------------------------------------------------------------ persistence
    def save_model(self, path: str, ema=None) -> None:
        self.strategy.save_model(self.model, self.tokenizer, path,
                                 max_shard_size=self.cfg.max_shard_size, ema=ema)

    def save_checkpoint(self) -> None:
        tag = f"global_step{self.global_step}"
        path = self.strategy.save_ckpt(self.model, tag=tag, metric=self._checkpoint_metric(),
                                       tokenizer=self.tokenizer, ema=self.ema)
        if self.cfg.save_hf_ckpt:
            self.save_model(os.path.join(self.strategy.checkpoint.ckpt_path, f"{tag}_hf"))
        self.strategy.print(f"[ckpt] saved {path}")

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
        """Load the newest complete checkpoint; return (epoch, steps already done in it)."""
        if not self._load_latest(self.train_dataloader):
            return 0, 0
        state = self.strategy.resume_state
        return state.epoch, state.epoch_consumed // self.strategy.config.train_batch_size

    def _load_latest(self, dataloader) -> bool:
        """Load the newest complete checkpoint (``dataloader`` placed by DeepSpeed's sample count,
        if given) and take its step; False when there is none."""
        path, _ = self.strategy.load_ckpt(self.model, dataloader=dataloader, ema=self.ema)
        if path is None:
            where = self.strategy.checkpoint.ckpt_path
            self.strategy.print(f"[ckpt] nothing to resume in {where}; starting fresh")
            return False
        self.global_step = self.strategy.resume_state.global_step
        self.strategy.print(f"[ckpt] resumed {path} at step {self.global_step}")
        return True
