"""The training loop every trainer shares; subclasses override small hooks.

The loop never branches on rank: the strategy reduces metrics and writes files on rank 0 only,
and ranks > 0 get a null logger and a disabled progress bar.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from tqdm import tqdm

from strategy.errors import NonFiniteLossError, fail
from strategy.internals import skipped_steps
from strategy.metrics import create_logger
from strategy.trainers.config import TrainConfig
from strategy.trainers.steps import StepPlan, plan_steps


class Trainer:
    """Owns micro-steps, accumulation, evaluation, logging, checkpoints, exports and resume.

    Hooks: ``compute_loss(batch) -> (loss, metrics)`` (required) and ``eval_metrics(batch) ->
    metrics`` (defaults to ``compute_loss`` without gradients). Metrics are floats averaged over
    micro-steps and ranks.
    """

    def __init__(self, strategy, model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config: TrainConfig | None = None,
                 tokenizer: Any = None) -> None:
        self.strategy, self.cfg, self.tokenizer = strategy, config or TrainConfig(), tokenizer
        self.train_dataloader, self.eval_dataloader = train_dataloader, eval_dataloader
        self.model = strategy.prepare((model, optimizer, scheduler))
        self.logger = create_logger(self.cfg.log_dir, self.cfg.use_wandb)
        self.global_step = 0
        self.history: list[dict] = []
        self.last_eval: tuple[int, dict] = (-1, {})  # (step, metrics) of the latest evaluation

    # ------------------------------------------------------------ hooks
    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError("a trainer must implement compute_loss(batch) -> (loss, metrics)")

    def eval_metrics(self, batch: dict) -> dict:
        loss, metrics = self.compute_loss(batch)
        return {"loss": loss.item(), **metrics}

    def to_device(self, batch: dict) -> dict:
        device = self.model.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    # ------------------------------------------------------------ loop
    @property
    def step_plan(self) -> StepPlan:
        return plan_steps(len(self.train_dataloader.dataset), self.strategy.config.train_batch_size,
                          self.cfg.max_epochs, self.cfg.max_steps)

    @property
    def steps_per_epoch(self) -> int:
        return self.step_plan.steps_per_epoch

    def total_steps(self) -> int:
        return self.step_plan.total_steps

    def fit(self) -> dict:
        """Train to the end (resuming first if asked); export the final model; return the last
        eval metrics."""
        start_epoch = self._resume() if self.cfg.load_checkpoint else 0
        total = self.total_steps()
        bar = tqdm(total=total, initial=self.global_step, desc="train", dynamic_ncols=True,
                   disable=not self.strategy.is_rank_0, mininterval=2.0)
        for epoch in range(start_epoch, self.cfg.max_epochs):
            if epoch > start_epoch or not self.cfg.load_checkpoint:
                self.train_dataloader.sampler.set_epoch(epoch)
            if self._train_epoch(epoch, bar, total):
                break
        bar.close()
        final = self.evaluate() if self.eval_dataloader is not None else {}
        self.save_model(self.cfg.save_path)
        self.logger.close()
        return final

    def _train_epoch(self, epoch: int, bar: tqdm, total: int) -> bool:
        """One pass; True when ``max_steps`` was reached."""
        self.model.train()
        sums: dict[str, float] = {}
        micro = 0
        for batch in self.train_dataloader:
            loss, metrics = self.compute_loss(self.to_device(batch))
            self.strategy.backward(loss, self.model)
            self.strategy.optimizer_step(self.model)
            micro += 1
            for k, v in {"loss": loss.item(), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            if micro % self.strategy.accumulation_steps:
                continue
            self.global_step += 1
            self._after_step(epoch, {k: v / micro for k, v in sums.items()}, bar)
            sums, micro = {}, 0
            if self.global_step >= total:
                return True
        return False

    def _after_step(self, epoch: int, metrics: dict, bar: tqdm) -> None:
        step, cfg = self.global_step, self.cfg
        metrics = self.strategy.all_reduce(metrics)  # every step: all ranks see the same loss
        self._check_finite(metrics["loss"], epoch)
        if step % cfg.logging_steps == 0:
            metrics.update(lr=self.model.get_lr()[0],
                           grad_norm=self.strategy.get_grad_norm(self.model), epoch=epoch,
                           skipped_steps=skipped_steps(self.model))
            self.logger.log(step, metrics)
            self.history.append({"step": step, **metrics})
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}")
        bar.update(1)
        if cfg.eval_steps > 0 and step % cfg.eval_steps == 0 and self.eval_dataloader is not None:
            self.evaluate()
        if cfg.save_steps > 0 and step % cfg.save_steps == 0:
            self.save_checkpoint()

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
        """Average ``eval_metrics`` over the held-out loader on all ranks; log and return it."""
        self.model.eval()
        sums, count = {}, 0
        for batch in self.eval_dataloader:
            for k, v in self.eval_metrics(self.to_device(batch)).items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += 1
        totals = self.strategy.all_reduce({**sums, "_n": count}, op="sum")
        n = max(totals.pop("_n"), 1)
        metrics = {k: v / n for k, v in totals.items()}
        self.logger.log(self.global_step, metrics, prefix="eval")
        self.last_eval = (self.global_step, metrics)
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        self.strategy.print(f"[eval] step {self.global_step}: {shown}")
        self.model.train()
        return metrics

    # ------------------------------------------------------------ persistence
    def save_model(self, path: str) -> None:
        self.strategy.save_model(self.model, self.tokenizer, path,
                                 max_shard_size=self.cfg.max_shard_size)

    def save_checkpoint(self) -> None:
        tag = f"global_step{self.global_step}"
        path = self.strategy.save_ckpt(self.model, tag=tag, metric=self._checkpoint_metric(),
                                       tokenizer=self.tokenizer)
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

    def _resume(self) -> int:
        """Load the newest complete checkpoint; return the epoch to continue in."""
        path, _ = self.strategy.load_ckpt(self.model, dataloader=self.train_dataloader)
        if path is None:
            where = self.strategy.checkpoint.ckpt_path
            self.strategy.print(f"[ckpt] nothing to resume in {where}; starting fresh")
            return 0
        state = self.strategy.resume_state
        self.global_step = state.global_step
        self.strategy.print(f"[ckpt] resumed {path} at step {self.global_step}")
        return state.epoch
