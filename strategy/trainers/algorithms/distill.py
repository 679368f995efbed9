"""On-policy distillation (GKD): a student learns a frozen teacher's next-token distributions.

Each optimizer step is on-policy with probability ``--lmbda`` (drawn from (seed, step), the same
on every rank, so a resume draws alike): the student samples a completion of each prompt of the
step's rows (through the strategy's rollout engine, like GRPO's rollouts), and the step trains on
prompt + sample; otherwise it trains on the dataset's own completions (plain KD). The loss is the
generalized JSD (``--beta``: 0 forward KL, 1 reverse KL) between student and teacher at every
completion token, token-weighted over the step like every loss here, over the whole vocabulary a
chunk of positions at a time (``--logits_chunk_size``; ``losses.distill``). TRL's ``GKDTrainer``
draws on-policy per process and step; its ``seq_kd`` (teacher-generated completions) is not here.

The teacher is an eval engine: ZeRO-3 partitioned with the student's stage 3, or kept on the CPU
between uses with ``--teacher_offload``. It must share the student's tokenizer (refused in one
line before any process group otherwise); logits of different widths (a family's sizes padded
differently) are compared over the tokenizer's tokens.
"""

from __future__ import annotations

import random
from itertools import islice
from typing import Any, Iterator

import torch
from transformers import AutoConfig, AutoTokenizer

from strategy.config import StrategyConfig
from strategy.errors import fail
from strategy.rollout.config import RolloutConfig
from strategy.rollout.vllm_checks import check_vllm_settings
from strategy.trainers.algorithms.completions import (
    completion_batch,
    generate_completions,
    left_padded,
    longest_prompt,
    prompts_of,
    sampling_rng,
    until_eos,
)
from strategy.trainers.config import DataConfig, DistillConfig, ModelConfig
from strategy.trainers.data import SFT
from strategy.trainers.loop import Step, Trainer
from strategy.trainers.losses import IGNORE, scored_mask
from strategy.trainers.losses.distill import chunked_jsd_sum


def vocab_width(config: Any) -> int:
    """A model config's output width (its text config's ``vocab_size``)."""
    return int(config.get_text_config().vocab_size)


def check_teacher(distill: DistillConfig, model: ModelConfig) -> None:
    """The teacher shares the student's tokenizer, and its logits cover every token (one line
    each, before any process group).

    Args:
        distill: the ``DistillConfig``.
        model: the student's ``ModelConfig``.

    Raises:
        ConfigError: no teacher, another tokenizer, or too narrow an output layer.
    """
    teacher = distill.teacher_pretrain
    if teacher is None:
        fail("teacher_pretrain", None, "name the teacher: --teacher_pretrain MODEL_DIR")
    mine = _vocab("tokenizer", model.tokenizer or model.pretrain)
    theirs = _vocab("teacher_pretrain", teacher)
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:1]
        fail("teacher_pretrain", teacher, f"its tokenizer is not the student's ({len(theirs)} "
             f"vs {len(mine)} tokens, e.g. {differ[0][0]!r} differs); distill between models "
             "of one tokenizer")
    width = vocab_width(AutoConfig.from_pretrained(teacher))
    if width < len(mine):
        fail("teacher_pretrain", teacher, f"its output layer has {width} columns for "
             f"{len(mine)} tokens; use a checkpoint whose vocab_size covers its tokenizer")


def _vocab(name: str, source: str) -> dict:
    try:
        return AutoTokenizer.from_pretrained(source).get_vocab()
    except (OSError, ValueError):
        fail(name, source, "no tokenizer loads from it; save the model's tokenizer there "
             "(tokenizer.save_pretrained)")


def teacher_strategy(strategy, distill: DistillConfig):
    """The strategy the teacher is built and prepared with: ``strategy``, or with
    ``--teacher_offload`` a ``derive`` of it that keeps frozen engines on the CPU."""
    return strategy.derive(ref_offload=True) if distill.teacher_offload else strategy


def build_teacher(run: Any, distill: DistillConfig):
    """The frozen teacher, loaded for ``teacher_strategy``.

    Args:
        run: the ``Run`` (its strategy and attention settings).
        distill: the ``DistillConfig``.

    Returns:
        The teacher model (``DistillationTrainer`` prepares it).
    """
    return teacher_strategy(run.strategy, distill).from_pretrained(
        distill.teacher_pretrain, frozen=True, **run.attention())


class DistillationTrainer(Trainer):
    """The student trains on the generalized JSD to ``teacher`` at each completion token, on its
    own samples for a ``lmbda`` share of the steps.

    Args:
        strategy: the ``DeepSpeedStrategy``.
        model: the student.
        optimizer: its optimizer.
        scheduler: its learning-rate schedule.
        train_dataloader: SFT rows (prompt + completion; on-policy steps keep the prompts).
        eval_dataloader: held-out rows, or None.
        config: the ``TrainConfig``.
        tokenizer: the student's (and the teacher's) tokenizer.
        distill: the ``DistillConfig`` (required).
        teacher: the frozen teacher (required; ``build_teacher``).
        rollout: the ``RolloutConfig``: which engine samples the on-policy steps (None: ``hf``).

    Raises:
        ConfigError: ``distill`` or ``teacher`` is missing.
    """

    data = SFT
    command = "distill"
    config_classes = (DistillConfig, RolloutConfig)

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:
        """The teacher (``check_teacher``), and the layouts on-policy sampling cannot run.

        Args:
            configs: the parsed configs by class.
            world_size: ranks the launcher started.

        Raises:
            ConfigError: a setting distillation cannot run with.
        """
        distill, data = configs[DistillConfig], configs[DataConfig]
        for name in ("sequence_parallel_size", "tensor_parallel_size"):
            if getattr(configs[StrategyConfig], name) > 1:
                fail(name, getattr(configs[StrategyConfig], name), "distillation samples whole "
                     "sequences on every rank; run it data-parallel (size 1)")
        for name in ("pack_dataset", "packing_samples"):
            if getattr(data, name):
                fail(name, True, "on-policy steps sample each row's own prompt; drop it")
        if distill.max_new_tokens >= data.max_len:
            fail("max_new_tokens", distill.max_new_tokens, f"prompt and completion share "
                 f"max_len={data.max_len}; raise --max_len or lower --max_new_tokens")
        check_teacher(distill, configs[ModelConfig])
        check_vllm_settings(configs[RolloutConfig], world_size)

    def __init__(self, strategy, model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config=None, tokenizer=None,
                 distill: DistillConfig | None = None, teacher=None,
                 rollout: RolloutConfig | None = None) -> None:
        if distill is None or teacher is None:
            fail("distill", distill, "DistillationTrainer needs distill=DistillConfig(...) and "
                 "teacher=build_teacher(run, distill)")
        super().__init__(strategy, model, optimizer, scheduler, train_dataloader,
                         eval_dataloader, config, tokenizer)
        self.distill = distill
        self.teacher = teacher_strategy(strategy, distill).prepare(teacher)
        widths = {vocab_width(self.model.module.config), vocab_width(self.teacher.module.config)}
        self.vocab = widths.pop() if len(widths) == 1 else len(tokenizer)  # the shared tokens
        self.rollouts = strategy.rollout_engine(
            self.model, distill.rollout_gather, rollout,
            longest_prompt(train_dataloader, eval_dataloader, key="input_ids")
            + distill.max_new_tokens)
        self._synced_at: int | None = None

    # ------------------------------------------------------------ steps
    def on_policy(self, step: int) -> bool:
        """Whether optimizer step ``step`` trains on the student's samples (the same on every
        rank and in a resumed run).

        Args:
            step: optimizer steps done before it.

        Returns:
            A draw of probability ``lmbda``.
        """
        return random.Random(self.strategy.config.seed * 1_000_003 + step).random() < \
            self.distill.lmbda

    def train_steps(self, epoch: int, count: int) -> Iterator[Step]:
        """The loader's next micro-batches; on an on-policy step their completions are the
        student's samples.

        Args:
            epoch: the epoch (the sampler is already set to it).
            count: how many optimizer steps to yield.

        Yields:
            ``Step``: its micro-batches and ``on_policy`` (1 or 0).
        """
        rows = iter(self.train_dataloader)
        for _ in range(count):
            batches = list(islice(rows, self.strategy.accumulation_steps))
            on = self.on_policy(self.global_step)
            if on:
                with sampling_rng(self.strategy.config.seed, self.global_step,
                                  self.strategy.rank):
                    batches = [self.sampled_batch(b) for b in batches]
            yield Step(batches, {"on_policy": (float(on), 1)})

    def generate(self, prompts: list[list[int]], sample: bool) -> list[list[int]]:
        """The student's completions of ``prompts`` (up to their end token); every rank calls
        this alike.

        Args:
            prompts: prompt token ids.
            sample: sample at the configured temperature, top-p and top-k (False: greedy).

        Returns:
            One completion per prompt.
        """
        d, tok = self.distill, self.tokenizer
        settings = dict(max_new_tokens=d.max_new_tokens, do_sample=sample,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        if sample:
            settings.update(temperature=d.temperature, top_p=d.top_p, top_k=d.top_k)
        if self._synced_at != self.global_step:  # the student moved since the last sync
            self.rollouts.sync()
            self._synced_at = self.global_step
        ids, mask = left_padded(prompts, tok.pad_token_id)
        out = generate_completions(self.rollouts, ids.to(self.model.device),
                                   mask.to(self.model.device), settings)
        return until_eos(out.cpu(), tok.eos_token_id)

    def sampled_batch(self, batch: dict) -> dict:
        """``batch``'s prompts with the student's sampled completions in place of its own.

        Args:
            batch: collated SFT rows.

        Returns:
            A batch of prompt + sample rows, scored on the samples.
        """
        prompts = prompts_of(batch)
        return completion_batch(prompts, self.generate(prompts, sample=True),
                                self.tokenizer.pad_token_id)

    # ------------------------------------------------------------ loss
    def loss_counts(self, batch: dict) -> dict[str, int]:
        return {"tokens": int(scored_mask(batch).sum())}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The generalized JSD summed over the micro-batch's completion tokens, as its share of
        the step's token mean.

        Args:
            batch: a micro-batch on the device.

        Returns:
            ``(loss, {"jsd": (sum, tokens)})``.
        """
        tokens = self.micro_counts["tokens"]
        most = int(self.strategy.all_reduce(tokens, op="max"))  # chunks every rank runs
        total = chunked_jsd_sum(self.model, self.teacher, batch, self.distill.beta,
                                self.cfg.logits_chunk_size, most, self.vocab)
        return self.normalize(total, "tokens"), {"jsd": (total.item(), tokens)}

    def eval_metrics(self, batch: dict) -> dict:
        """The held-out divergence on the dataset's completions and, with
        ``eval_exact_match``, greedy completions against them.

        Args:
            batch: held-out rows on the device.

        Returns:
            ``loss``, ``jsd`` and maybe ``exact_match`` ((sum, count) pairs).
        """
        out = super().eval_metrics(batch)
        if self.distill.eval_exact_match:
            eos = self.tokenizer.eos_token_id
            wanted = [[t for t in row if t != IGNORE] for row in batch["labels"][:, 1:].tolist()]
            got = self.generate(prompts_of(batch), sample=False)
            hits = sum(_strip(a, eos) == _strip(b, eos) for a, b in zip(got, wanted))
            out["exact_match"] = (float(hits), len(got))
        return out


def _strip(tokens: list[int], eos: int) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == eos else tokens
