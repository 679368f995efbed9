"""GRPO's experience stage (OpenRLHF's ``ExperienceMaker``): a rollout's completions from the
rollout engine (or played episodes), scored, shaped, cut into micro-batches with their reference
log-probs and advantages. A mixin of ``GRPOTrainer``: it reads the trainer's ``grpo`` settings,
``rollouts`` engine, tokenizer, reward and episodes, and calls its ``advantages``
(``PolicyUpdate``'s, or a subclass's: PPO's GAE)."""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import GenerationConfig

from strategy.trainers.algorithms.completions import (
    completion_batch,
    generate_completions,
    left_padded,
    sampling_rng,
    token_layout,
    until_eos,
)
from strategy.trainers.algorithms.episodes import Episode, turn_values
from strategy.trainers.algorithms.groups import Sampled, deal, informative
from strategy.trainers.algorithms.token_budget import agreed_bounds
from strategy.trainers.losses import (
    length_shaped_rewards,
    padding_free,
    shared_prompts,
    token_logps,
)


def repeated(batch: dict, group: int) -> tuple[list[list[int]], list[str], list[dict]]:
    """A prompt batch's prompt tokens (unpadded), texts and rows, each ``group`` times in a
    row."""
    ids = [row[m.bool()].tolist() for row, m in zip(batch["prompt_ids"].cpu(),
                                                     batch["prompt_mask"].cpu())]
    return tuple([x for x in column for _ in range(group)]
                 for column in (ids, batch["prompts"], batch["rows"]))


class ExperienceMaker:
    """``rollout`` (``sample`` or ``filtered_sample``, then ``experience``), ``generate`` and
    ``play``, and the reward shaping between them (``shape_rewards``)."""

    _ahead: tuple | None  # (prompts, generation, version): ``EngineRollouts``' rollout in flight
    _synced_at: int | None  # the global step the rollout engine's weights are of
    _sync_s: float | None  # the last sync's seconds, logged with its rollout
    _components: dict  # the latest rollout's scores by reward

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample: bool, group: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None) -> torch.Tensor:
        """Completions (right of the prompts; padded after their end) from the policy. Every rank
        calls this alike; under ZeRO-3 the ranks keep stepping until all are done.

        Args:
            prompt_ids: left-padded prompt token ids.
            prompt_mask: their attention mask.
            sample: sample at the configured temperature, top-p and top-k (False: greedy).
            group: rows come in runs of ``group`` copies of one prompt (its prompt's forward then
                runs once: ``RolloutEngine.generate``).
            max_new_tokens: at most this many tokens (None: ``grpo.max_new_tokens``).
            temperature: the sampling temperature (None: ``grpo.temperature``).

        Returns:
            The completion token ids, one row per prompt.
        """
        self._sync_rollouts()
        return generate_completions(self.rollouts, prompt_ids, prompt_mask,
                                    self._settings(sample, max_new_tokens, temperature), group)

    def _settings(self, sample: bool, max_new_tokens: int | None = None,
                  temperature: float | None = None) -> dict:
        g = self.grpo
        settings = dict(max_new_tokens=max_new_tokens or g.max_new_tokens, do_sample=sample,
                        eos_token_id=self.tokenizer.eos_token_id,
                        pad_token_id=self.tokenizer.pad_token_id)
        if sample:
            settings.update(temperature=g.temperature if temperature is None else temperature,
                            top_p=g.top_p, top_k=g.top_k)
        return settings

    def _sync_rollouts(self, in_flight: bool = False) -> None:
        """The rollout engine to the policy's weights, if they moved since its last sync: an
        in-flight generation finished first (nothing else may use the engine meanwhile), or
        (``in_flight``: partial rollouts) stopped between two engine steps for it."""
        if self._ahead is not None and not in_flight:
            self._ahead[1].join()
        if self._synced_at != self.global_step:
            start = time.perf_counter()
            (self.rollouts.sync_in_flight if in_flight else self.rollouts.sync)()
            self._synced_at, self._sync_s = self.global_step, time.perf_counter() - start

    def _completions(self, completions: torch.Tensor) -> list[list[int]]:
        """Each completion's tokens up to and including its first end-of-sequence token."""
        return until_eos(completions, self.tokenizer.eos_token_id)

    def _texts(self, completions: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(completions, skip_special_tokens=True)

    def _score(self, prompts: list[str], completions: list[list[int]], texts: list[str],
               rows: list[dict]) -> torch.Tensor:
        """Rewards of decoded completions; a reward model also learns which ended with EOS (it
        scores them at its own EOS, where it was trained)."""
        args = ([not cut for cut in self._truncated(completions)],) if getattr(
            self.reward, "scores_eos", False) else ()
        rewards = self.strategy.checked(self.reward, prompts, texts, rows, *args)  # every rank
        self._components = dict(getattr(self.reward, "last", {}))
        return torch.tensor(rewards, dtype=torch.float32)

    def sample(self, batch: dict, round_: int = 0) -> Sampled:
        """``group_size`` completions of each of this rank's prompts, scored (every rank calls
        this alike).

        Args:
            batch: this rank's prompts (``prompt_ids``, ``prompt_mask``, ``prompts``, ``rows``).
            round_: the step's sampling round (a fresh draw of the step's generator for each).

        Returns:
            The ``Sampled`` groups.
        """
        g = self.grpo.group_size
        with sampling_rng(self.strategy.config.seed, self.global_step, self.strategy.rank,
                          round_):
            if self.episodes is not None:
                return self.play(batch, sample=True, group=g)
            ids, mask = self._grouped(batch)
            out = self.generate(ids, mask, sample=True, group=g)
        return self._scored(batch, out, getattr(self.rollouts, "logprobs", None))

    def play(self, batch: dict, sample: bool, group: int) -> Sampled:
        """``--agent_func_path`` or ``--tools``: ``group`` episodes of each prompt, played to
        their end with the environment (``episodes``; every rank calls this alike). Scores are
        the episodes' rewards (with ``--tools``: the reward of the last turn, the answer).

        Args:
            batch: this rank's prompts.
            sample: sample the model's turns (False: greedy).
            group: episodes per prompt.

        Returns:
            The ``Sampled`` episodes: completions are everything after the prompt, turns and
            feedback; ``episodes`` says which tokens the model made.
        """
        prompt_ids, prompts, rows = repeated(batch, group)
        episodes = self.episodes.run(prompts, prompt_ids, rows, self.answer_key,
                                     self.model_turns(sample))
        return self.played(batch, group, episodes)

    def model_turns(self, sample: bool, generator: torch.Generator | None = None) -> Callable:
        """The episodes' model turns: a batch of contexts in, each one's new tokens (and their
        engine log-probs) out. With a ``generator`` (episodes played ahead, on a thread of their
        own): the engine as it is, without a sync, seeded from it."""
        def turn(contexts: list[list[int]], max_new: int):
            ids, mask = left_padded(contexts, self.tokenizer.pad_token_id)
            ids, mask = ids.to(self.model.device), mask.to(self.model.device)
            if generator is None:
                out = self.generate(ids, mask, sample, max_new_tokens=max_new)
            else:
                out = self.rollouts.generate(ids, mask, GenerationConfig(
                    **self._settings(sample, max_new)), generator=generator)[:, ids.shape[1]:]
            return self._completions(out.cpu()), getattr(self.rollouts, "logprobs", None)
        return turn

    def played(self, batch: dict, group: int, episodes: list[Episode]) -> Sampled:
        """``play``'s ``Sampled`` of ``batch``'s played ``episodes`` (``group`` per prompt),
        scored (every rank calls this alike)."""
        prompt_ids, prompts, rows = repeated(batch, group)
        if self.grpo.tools:  # the reward scores the answer: the last turn, without a call
            answers = [e.last_turn() for e in episodes]
            scores = self._score(prompts, answers, self._texts(answers), rows)
            for e, score in zip(episodes, scores.tolist()):
                e.rewards[-1] += score
        engine = [e.engine_logps for e in episodes] if self.rollout_config.vllm else []
        return Sampled(prompt_ids, [e.tokens for e in episodes], [e.reward for e in episodes],
                       prompts, rows, {}, engine, episodes)

    def _grouped(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts, each repeated ``group_size`` times."""
        g, device = self.grpo.group_size, self.model.device
        return (batch["prompt_ids"].repeat_interleave(g, dim=0).to(device),
                batch["prompt_mask"].repeat_interleave(g, dim=0).to(device))

    def _scored(self, batch: dict, out: torch.Tensor,
                engine: list[list[float]] | None) -> Sampled:
        """``Sampled`` of generated completions (``out``: right of the prompts, ``group_size``
        per prompt), scored; with the engine's log-probs of their tokens when it gave them
        (vLLM)."""
        completions = self._completions(out.cpu())
        engine_logps = [] if engine is None else [lp[:len(c)] for lp, c in zip(engine,
                                                                                completions)]
        prompt_ids, prompts, rows = repeated(batch, self.grpo.group_size)
        scores = self._score(prompts, completions, self._texts(completions), rows)
        return Sampled(prompt_ids, completions, scores.tolist(), prompts, rows,
                       {k: list(v) for k, v in self._components.items()}, engine_logps)

    def filtered_sample(self, batch: dict) -> tuple[Sampled, int, dict]:
        """DAPO's dynamic sampling: rounds of prompts until every rank's share of kept groups
        is full, or ``max_sampling_rounds`` (``groups``: the pool, dealt out in one order).

        Args:
            batch: this rank's first round of prompts.

        Returns:
            ``(this rank's groups, how many at their end are filler, metrics)``.
        """
        g = self.grpo
        target = self.per_rank * self.strategy.data_parallel_size
        pool: list[Sampled] = []
        for round_ in range(g.max_sampling_rounds):
            if round_:
                batch = self.next_prompts()
            groups = self.sample(batch, round_).split(g.group_size)
            kept = [x for x, keep in zip(groups, informative(groups, *g.dynamic_filtering_range))
                    if keep]
            pool += [x for part in self.strategy.all_gather_object(kept)
                     for x in part]  # rank order
            if len(pool) >= target:
                break
        sampled, filler = deal(pool, self.per_rank, self.strategy.data_parallel_rank, groups)
        rounds = round_ + 1
        metrics = {"sampling_rounds": (float(rounds), 1),
                   "dynamic_filtering_pass_rate": (100.0 * len(pool) / (rounds * target), 1),
                   "filler_groups": (float(max(target - len(pool), 0)), 1)}  # every rank's
        return sampled, filler, metrics

    def rollout(self, batch: dict) -> tuple[list[dict], dict]:
        """The experience stage: this rank's micro-batches of completions with their rewards,
        reference log-probs and advantages (``advantages``), and the rollout's metrics as
        (sum, count) pairs. With ``--dynamic_filtering`` the completions are those of the kept
        groups (``filtered_sample``).

        Args:
            batch: this rank's prompts (``prompt_ids``, ``prompt_mask``, ``prompts``, ``rows``).

        Returns:
            ``(micro-batches, metrics)``.
        """
        start = time.perf_counter()
        filler, metrics = 0, {}
        if self.grpo.dynamic_filtering:
            sampled, filler, metrics = self.filtered_sample(batch)
        else:
            sampled = self.sample(batch)
        self._components = sampled.components
        batches, more = self.experience(sampled, filler * self.grpo.group_size)
        return batches, {**more, **metrics, **self._sync_metric(),
                         "generation_s": (time.perf_counter() - start, 1)}

    def _sync_metric(self) -> dict:
        """This rollout's ``weight_sync_s`` (none when the policy had not moved), taken once."""
        seconds, self._sync_s = self._sync_s, None
        return {} if seconds is None else {"weight_sync_s": (seconds, 1)}

    def experience(self, sampled: Sampled, filler: int = 0) -> tuple[list[dict], dict]:
        """Micro-batches of ``sampled`` with shaped rewards, reference log-probs and
        advantages; its metrics.

        Args:
            sampled: this rank's completions for the step.
            filler: how many at its end train nothing (a short dynamic-sampling step).

        Returns:
            ``(micro-batches, metrics)``.
        """
        completions, episodes = sampled.completions, sampled.episodes
        truncated = torch.tensor([not e.done for e in episodes] if episodes
                                 else self._truncated(completions))
        rewards = torch.tensor(sampled.scores, dtype=torch.float32)
        rewards, shaped = self.shape_rewards(rewards, completions, truncated)
        trained = torch.arange(len(completions)) < len(completions) - filler
        if self.grpo.mask_truncated_completions:  # no loss on them; their rewards still count
            trained &= ~truncated
        lengths = [len(p) + len(c) for p, c in zip(sampled.prompt_ids, completions)]
        batches = []
        for index, (i, end, step) in enumerate(self.micro_batch_bounds(lengths)):
            prompts, part = sampled.prompt_ids[i:end], episodes[i:end]
            b = self._micro_batch(prompts, completions[i:end], rewards[i:end], index=index,
                                  scored=[e.model for e in part] or None)
            b["rollout_step"] = step
            width = b["input_ids"].shape[1]
            if sampled.engine_logps:
                b["engine_logp"] = token_layout(prompts, sampled.engine_logps[i:end], width)
            if part:  # each turn's reward on its last model token
                b["turn_rewards"] = token_layout(prompts, turn_values(part), width)
            if not trained[i:end].all():
                b["trained"] = trained[i:end]
            batches.append(b)
        if self.ref_model is not None:
            for b, logp in zip(batches, self.reference_logps(batches)):
                b["ref_logp"] = logp
        self.advantages(batches)
        real = slice(0, len(completions) - filler)  # the filler's figures are not the step's
        lengths = [sum(e.model) for e in episodes] or [len(c) for c in completions]
        metrics = self._rollout_metrics(rewards[real], lengths[real], truncated[real], shaped)
        if episodes:
            metrics.update(self.episodes.metrics(episodes[real]))
        return batches, metrics

    def micro_batch_bounds(self, lengths: list[int]) -> list[tuple[int, int, int]]:
        """Where this rank's rollout (rows of ``lengths`` tokens, in order) is cut into training
        micro-batches: ``--micro_train_batch_size`` rows each, or with ``--dynamic_batch`` by
        the ``--max_tokens_per_gpu`` budget (``token_budget``; collective: every rank cuts each
        optimizer step's rows into the most micro-batches any rank needs).

        Args:
            lengths: each row's prompt + completion tokens.

        Returns:
            ``(first row, end row, optimizer step of the rollout)`` per micro-batch.
        """
        steps = self._span // self.grpo.ppo_epochs  # optimizer steps per pass over the rollout
        if not self.grpo.dynamic_batch:
            micro, per_step = self.strategy.config.micro_train_batch_size, len(lengths) // steps
            return [(i, min(i + micro, len(lengths)), i // per_step)
                    for i in range(0, len(lengths), micro)]
        return agreed_bounds(self.strategy, lengths, steps, self.grpo.max_tokens_per_gpu,
                             self.packing)

    def reference_logps(self, batches: list[dict]) -> list[torch.Tensor]:
        """The reference's log-probs of each micro-batch's targets (on the CPU): forwarded here,
        or asked of the reference's own Ray group (``strategy.rollout.remote_models``), in
        ``experience_forwards``' micro-batches."""
        remote = getattr(self.ref_model, "logps_of", None)

        def forward(parts: list[dict]) -> list[torch.Tensor]:
            if remote is not None:
                return remote(parts)
            with torch.no_grad():
                return [token_logps(self.ref_model, self.to_device(b),
                                    self.grpo.temperature)[0].cpu() for b in parts]

        return self.experience_forwards(batches, forward)

    def _rollout_metrics(self, rewards: torch.Tensor, lengths: list[int],
                         truncated: torch.Tensor, shaped: dict) -> dict:
        stats = self.strategy.all_reduce({"sum": rewards.sum().item(),
                                          "sq": rewards.pow(2).sum().item(),
                                          "n": float(rewards.numel())}, op="sum")
        mean = stats["sum"] / max(stats["n"], 1)
        std = max(stats["sq"] / max(stats["n"], 1) - mean**2, 0.0) ** 0.5
        metrics = {"reward": (rewards.sum().item(), rewards.numel()), "reward_std": (std, 1),
                   "completion_length": (float(sum(lengths)), len(lengths)),
                   "truncated": (float(truncated.sum()), len(lengths)), **shaped}
        if len(self._components) > 1:  # each reward of a weighted sum, on its own
            metrics.update({f"reward_{name}": (float(sum(scores)), len(scores))
                            for name, scores in self._components.items()})
        return metrics

    def _truncated(self, completions: list[list[int]]) -> list[bool]:
        """Which were cut at ``max_new_tokens``: they do not end with the end-of-sequence
        token."""
        eos = self.tokenizer.eos_token_id
        return [not c or c[-1] != eos for c in completions]

    def shape_rewards(self, rewards: torch.Tensor, completions: list[list[int]],
                      truncated: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The rollout's rewards after the length penalties (``--overlong_buffer_len``,
        ``--stop_properly_penalty_coef``; ``losses.length_shaped_rewards``), before advantages.

        Args:
            rewards: one per completion, as the reward gave them.
            completions: the completions' tokens.
            truncated: which were cut at ``max_new_tokens``.

        Returns:
            The rewards to train on, and the penalties' counts as metrics.
        """
        g = self.grpo
        lengths = torch.tensor([len(c) for c in completions])
        return length_shaped_rewards(rewards, lengths, truncated, g.max_new_tokens,
                                     g.overlong_buffer_len, g.overlong_penalty_factor,
                                     g.stop_properly_penalty_coef)


    def _micro_batch(self, prompts: list[list[int]], completions: list[list[int]],
                     rewards: torch.Tensor, index: int,
                     scored: list[list[bool]] | None = None) -> dict:
        pad = self.tokenizer.pad_token_id
        batch = {**completion_batch(prompts, completions, pad, scored),
                 "rewards": rewards.clone(),
                 "rollout_index": index}
        if self.packing:  # the forwards skip the padding; their outputs come back padded
            batch.update(padding_free(batch["input_ids"], batch["attention_mask"]))
        elif self.share_prompts:  # each distinct prompt forwarded once
            batch.update(shared_prompts(prompts, completions, pad))
        return batch
