"""Group relative policy optimization (GRPO) on the shared loop.

A rollout: each rank takes its prompts, samples ``group_size`` completions of each with the policy,
scores them (a ``module:function`` callable or a reward model), and turns the rewards into one
advantage per completion (``--advantage_estimator``, OpenRLHF's meanings: by default GRPO's reward
less the group mean, over the group std; RLOO, Dr. GRPO, REINFORCE++ and its baseline variant, the
last two whitened over every rank's completion tokens). Then ``ppo_epochs`` optimizer steps, each
over the whole rollout: the clipped policy-gradient loss (``--clip_eps``, or ``--clip_eps_low`` /
``--clip_eps_high``, optionally ``--dual_clip``) plus ``kl_coef`` times a KL estimate
(``--kl_estimator``, k3 by default) to a frozen reference (with ``--kl_in_reward`` that KL goes
into each token's reward instead, the advantages becoming per-token returns), aggregated by
``--policy_loss_agg``:
every completion token of the step weighing the same (default; the loop's token-weighted
``normalize``), each completion's token mean averaged over completions (the GRPO paper), or each
completion's token sum over ``max_new_tokens`` (Dr. GRPO). The first step's log-probs become the
"old" ones (ratio 1).
Log-probs (policy and reference) are taken at the sampling temperature: the ratio and the KL are
those of the distribution the completions were drawn from when ``top_p`` is 1 and ``top_k`` 0
(the defaults). Truncated sampling (``top_p`` < 1 or ``top_k`` > 0) draws from the renormalized
head of that distribution while the log-probs stay those of the whole one (as in TRL). Nothing
else shapes the sampling: the checkpoint's ``generation_config`` (a ``repetition_penalty``,
``min_p``...) is set aside while generating.

Completions come from the strategy's ``rollout_engine`` (``strategy.rollout``), synced once per
rollout: ``--rollout_engine vllm`` a vLLM engine on each rank (``weight_sync_s`` logged), whose
sampled tokens' log-probs are compared with the trainer's each rollout
(``engine_logprob_diff``, mean and max) and, with ``--is_correction tis|icepop``, weigh each
token's loss (OpenRLHF's vLLM importance-sampling correction). Under ZeRO-3 the ``hf`` engine,
with ``--rollout_gather full`` (default), gathers the policy once into a plain copy on every rank
that generates without collectives (refused before the first step when it would not fit in a
rank's free memory); ``layer`` runs DeepSpeed's partitioned forward (one gather
per layer per generated token, ``synced_gpus`` keeping ranks in step), bounded by ZeRO-3's memory
budget however large the model.

With ``--dynamic_filtering`` (DAPO's dynamic sampling, ``groups``) a rollout keeps only groups
whose mean reward lies strictly inside ``--dynamic_filtering_range`` and samples more rounds of
prompts until the step is full (at most ``--max_sampling_rounds``); the kept groups of every rank
are pooled and dealt out alike, so every rank trains the same number of micro-batches.

Sampling draws from a generator seeded by (seed, step, rank, round), so a resumed run samples
exactly what the uninterrupted one did; prompts come from a cursor of rounds drawn
(``next_prompts``), saved with each checkpoint. Checkpoints fall between rollouts
(``save_steps`` a multiple of ``ppo_epochs``). Optimizer steps are the loop's steps: a rollout
spans ``ppo_epochs`` of them.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator

import torch

from strategy.agents import load_agent
from strategy.config import StrategyConfig
from strategy.errors import fail
from strategy.rollout.config import RolloutConfig
from strategy.rollout.vllm_checks import check_vllm_settings
from strategy.tools import ToolAgent, load_tools, tool_schemas, tool_turn
from strategy.trainers.algorithms.ahead import EngineRollouts
from strategy.trainers.algorithms.completions import (
    completion_batch,
    generate_completions,
    left_padded,
    longest_prompt,
    sampling_rng,
    token_layout,
    until_eos,
)
from strategy.trainers.algorithms.episodes import EpisodeRunner, turn_values
from strategy.trainers.algorithms.groups import Sampled, deal, informative
from strategy.trainers.algorithms.rewards import load_reward_fn
from strategy.trainers.config import DataConfig, GRPOConfig, ModelConfig, TrainConfig
from strategy.trainers.data import PROMPTS
from strategy.trainers.data.spec import prompts_per_rank
from strategy.trainers.loop import Largest, Step, StepPlan, Trainer, plan_steps
from strategy.trainers.losses import (
    discounted_returns,
    engine_is_weights,
    engine_logprob_gap,
    grpo_token_losses,
    kl_estimate,
    length_shaped_rewards,
    outcome_advantages,
    outcome_token_rewards,
    padding_free,
    scored_mask,
    shared_prompts,
    token_logps,
    token_moments,
    whiten,
)
from strategy.trainers.losses.advantages import WHITENED

Reward = Callable[[list[str], list[str], list[dict]], list[float]]
PER_TURN = ("gae", "reinforce")  # estimators that take each episode turn's reward where it falls


def repeated(batch: dict, group: int) -> tuple[list[list[int]], list[str], list[dict]]:
    """A prompt batch's prompt tokens (unpadded), texts and rows, each ``group`` times in a
    row."""
    ids = [row[m.bool()].tolist() for row, m in zip(batch["prompt_ids"].cpu(),
                                                     batch["prompt_mask"].cpu())]
    return tuple([x for x in column for _ in range(group)]
                 for column in (ids, batch["prompts"], batch["rows"]))


def check_grpo(strategy_config: Any, train: Any, grpo: GRPOConfig, max_len: int,
               world_size: int) -> None:
    """Before any process group starts: what GRPO cannot run with, one line each."""
    for name in ("sequence_parallel_size", "tensor_parallel_size"):
        if getattr(strategy_config, name) > 1:
            fail(name, getattr(strategy_config, name), "GRPO generates whole sequences on every "
                 "rank; run it data-parallel (size 1)")
    prompts_per_rank(strategy_config, world_size, grpo.group_size)
    for name in ("max_steps", "save_steps", "eval_steps"):
        value = getattr(train, name)
        if value > 0 and value % grpo.ppo_epochs:
            fail(name, value, f"a rollout spans ppo_epochs={grpo.ppo_epochs} optimizer steps; "
                 f"use a multiple of {grpo.ppo_epochs}")
    if grpo.max_new_tokens >= max_len:
        fail("max_new_tokens", grpo.max_new_tokens, f"prompt and completion share max_len="
             f"{max_len}; raise --max_len or lower --max_new_tokens")


def check_rollout(rollout: RolloutConfig, grpo: GRPOConfig, world_size: int) -> None:
    """The rollout engine's settings GRPO/PPO cannot run with, before any process group."""
    check_vllm_settings(rollout, world_size)
    if rollout.async_rollouts and not rollout.vllm:
        fail("async_rollouts", rollout.async_rollouts, "the hf engine generates with the "
             "training ranks' own module, so nothing would overlap; add --rollout_engine vllm")
    if rollout.async_rollouts and grpo.dynamic_filtering:
        fail("async_rollouts", rollout.async_rollouts, "dynamic sampling decides the next "
             "round from this one's rewards; drop one of them")
    if rollout.async_rollouts and grpo.episodic:
        fail("async_rollouts", rollout.async_rollouts, "an episode's next turn waits for the "
             "environment's answer to the last; drop --async_rollouts (or the environment: "
             "--agent_func_path, --tools)")
    if rollout.is_correction is not None and grpo.policy_loss_type != "ppo":
        fail("is_correction", rollout.is_correction, "it weighs each token's loss, as "
             "OpenRLHF's; use it with --policy_loss_type ppo or drop it")


class GRPOTrainer(EngineRollouts, Trainer):
    """The policy trains; ``ref_model`` (needed when ``kl_coef`` > 0) becomes an eval engine;
    ``reward(prompts, completions, rows) -> floats`` scores completions (``rewards``).

    Built on the public ``Trainer`` hooks: ``train_steps`` runs a rollout and yields it as
    ``ppo_epochs`` optimizer steps; ``resume_position`` places the prompt sampler by rollouts.
    What only a vLLM engine does (rollouts generated ahead, the engine's log-probs compared) is
    ``EngineRollouts``'.

    Args:
        strategy: the ``DeepSpeedStrategy``.
        model: the policy to train.
        optimizer: the policy's optimizer.
        scheduler: its learning-rate schedule.
        train_dataloader: the prompt loader (``PROMPTS``).
        eval_dataloader: held-out prompts, or None.
        config: the ``TrainConfig``.
        tokenizer: decodes completions; its eos and pad ids end and pad them.
        grpo: the ``GRPOConfig`` (required).
        ref_model: the frozen reference for the KL term (required when ``kl_coef`` > 0).
        reward: ``reward(prompts, completions, rows) -> floats`` (required without
            ``grpo.agent_func_path``, whose environment rewards the episodes).
        answer_key: the row key of the reference answer for eval ``exact_match`` (None: off;
            an episode's last model turn is compared), and an environment's ``label``.
        rollout: the ``RolloutConfig``: which engine generates (None: ``hf``).
        packing: forward the update's micro-batches (policy, reference, critic) without their
            padding (``--packing_samples``: one packed row per micro-batch, per-sample attention
            on ``sdpa_varlen`` or flash attention; ``losses.padding_free``). Otherwise, with
            ``grpo.shared_prompt_forward`` (by default below ZeRO-3), each distinct prompt of a
            micro-batch is forwarded once and its completions on its KV cache
            (``losses.shared_prompts``).
        max_len: with ``grpo.agent_func_path``, an episode's prompt, turns and feedback at most
            (``--max_len``; None: the longest prompt + ``max_turns`` x ``max_new_tokens``).

    Raises:
        ConfigError: ``grpo`` or ``reward`` is missing, or ``kl_coef`` > 0 without ``ref_model``.
    """

    data = PROMPTS
    command = "grpo"
    resume_by_samples = False  # a step consumes completions, not loader samples
    config_classes = (GRPOConfig, RolloutConfig)

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:
        """GRPO's refusals (``check_grpo``), an importable reward function, and a reference
        model when there is a KL penalty.

        Args:
            configs: the parsed configs by class.
            world_size: ranks the launcher started.

        Raises:
            ConfigError: a setting GRPO cannot run with.
        """
        grpo, model = configs[cls.config_classes[0]], configs[ModelConfig]
        if configs[DataConfig].streaming:
            fail("streaming", True, "GRPO's prompts are read whole; drop --streaming")
        if configs[DataConfig].pack_dataset:
            fail("pack_dataset", True, "prompts are not packed; --packing_samples forwards the "
                 "update's micro-batches padding-free")
        check_grpo(configs[StrategyConfig], configs[TrainConfig], grpo,
                   configs[DataConfig].max_len, world_size)
        check_rollout(configs[RolloutConfig], grpo, world_size)
        for spec in grpo.reward_names():
            if spec != "model":
                load_reward_fn(spec)  # importable and callable, or one line now
        if grpo.agent_func_path:
            load_agent(grpo.agent_func_path)  # an environment class, or one line now
        if grpo.tools:
            load_tools(grpo.tools)  # functions with schemas, or one line now
            if not configs[DataConfig].apply_chat_template:
                fail("tools", grpo.tools, "the tools' schemas reach the model through the chat "
                     "template; add --apply_chat_template")
        if grpo.kl_coef > 0 and (model.ref_pretrain or model.pretrain) is None:
            fail("kl_coef", grpo.kl_coef, "the reference is the --pretrain model (or "
                 "--ref_pretrain); pass one or set --kl_coef 0")

    def __init__(self, strategy, model, optimizer, scheduler, train_dataloader,
                 eval_dataloader=None, config=None, tokenizer=None, grpo: GRPOConfig | None = None,
                 ref_model=None, reward: Reward | None = None, answer_key: str | None = "output",
                 packing: bool = False, rollout: RolloutConfig | None = None,
                 max_len: int | None = None) -> None:
        if grpo is None or (reward is None and not grpo.agent_func_path):
            fail("grpo", grpo, "GRPOTrainer needs grpo=GRPOConfig(...) and a reward callable "
                 "(or grpo.agent_func_path)")
        if grpo.kl_coef > 0 and ref_model is None:
            fail("kl_coef", grpo.kl_coef, "a KL penalty needs ref_model; pass one or set 0")
        super().__init__(strategy, model, optimizer, scheduler, train_dataloader,
                         eval_dataloader, config, tokenizer)
        self.grpo, self.reward, self.answer_key = grpo, reward, answer_key
        self.packing = packing
        shared = grpo.shared_prompt_forward  # None: where a forward call does not gather weights
        self.share_prompts = not strategy.config.partitions_parameters if shared is None \
            else shared
        self.ref_model = strategy.prepare(ref_model) if ref_model is not None else None
        self.per_rank = prompts_per_rank(strategy.config, strategy.world_size, grpo.group_size)
        self._old_logps: dict[int, torch.Tensor] = {}  # micro-batch -> first update's log-probs
        self.rollout_config = rollout or RolloutConfig()
        longest = longest_prompt(train_dataloader, eval_dataloader) + grpo.max_new_tokens
        if grpo.episodic:  # an episode's context grows turn by turn
            longest = max_len or longest + (grpo.max_turns - 1) * grpo.max_new_tokens
        self.rollouts = strategy.rollout_engine(self.model, grpo.rollout_gather,
                                                self.rollout_config, longest)
        self._sync_s: float | None = None  # the last sync's seconds, logged with its rollout
        self._components: dict[str, list[float]] = {}  # the latest rollout's scores by reward
        self._synced_at: int | None = None  # the global step the rollout engine's weights are of
        self._rounds_drawn = 0  # rounds of prompts drawn so far (the prompt cursor)
        self._ahead: tuple | None = None  # --async_rollouts: (prompts, generation, version)
        self.episodes = None if not grpo.episodic else EpisodeRunner(
            *self._environment(), tokenizer, grpo.max_turns, grpo.max_new_tokens, longest,
            grpo.agent_timeout, strategy)

    def _environment(self) -> tuple[Callable[[], Any], str]:
        """The episodes' environment (an agent file's class, or ``ToolAgent`` for ``--tools``),
        and how errors name it."""
        g = self.grpo
        if g.agent_func_path:
            return load_agent(g.agent_func_path), f"agent_func_path={g.agent_func_path!r}"
        tools = load_tools(g.tools)
        tool_turn(self.tokenizer, [("check", "42")])  # a template without a tool role: one line
        return (functools.partial(ToolAgent, tools, tool_schemas(tools, g.tools), self.tokenizer,
                                  g.tool_timeout), f"tools={g.tools!r}")

    # ------------------------------------------------------------ plan and resume
    @classmethod
    def loaders(cls, strategy, tokenizer: Any, data: Any, grpo: GRPOConfig | None = None,
                **_: Any) -> tuple[Any, Any]:
        """Prompt loaders: each rank's share of a rollout's prompts per batch.

        Args:
            strategy: the started strategy.
            tokenizer: turns text into ids.
            data: the ``DataConfig``.
            grpo: the ``GRPOConfig`` (group size, completion length).

        Returns:
            The training and held-out prompt loaders.
        """
        tools = tool_schemas(load_tools(grpo.tools), grpo.tools) if grpo.tools else None
        return cls.data.loaders(strategy, tokenizer, data, grpo.group_size, grpo.max_new_tokens,
                                tools=tools)

    @classmethod
    def plan(cls, strategy, num_samples: int, cfg, grpo: GRPOConfig | None = None,
             **_: Any) -> StepPlan:
        """Rollouts per epoch from the prompts; each spans ``ppo_epochs`` optimizer steps.

        Args:
            strategy: the strategy (batch sizes, world size).
            num_samples: prompts in the training data.
            cfg: the ``TrainConfig`` (epochs, max steps).
            grpo: the ``GRPOConfig`` (group size, ``ppo_epochs``).

        Returns:
            The ``StepPlan``, in optimizer steps.
        """
        per_rollout = prompts_per_rank(strategy.config, strategy.world_size, grpo.group_size)
        per_rollout *= strategy.data_parallel_size
        ppo = grpo.ppo_epochs
        rollouts = plan_steps(num_samples, per_rollout, cfg.max_epochs,
                              cfg.max_steps // ppo if cfg.max_steps > 0 else -1)
        return StepPlan(rollouts.steps_per_epoch * ppo, rollouts.total_steps * ppo)

    @property
    def step_plan(self) -> StepPlan:
        return self.plan(self.strategy, len(self.train_dataloader.dataset), self.cfg, self.grpo)

    def resume_position(self, state) -> tuple[int, int]:
        """Resume between rollouts (the prompt cursor came back with ``load_checkpoint_state``).

        Args:
            state: the strategy's ``ResumeState`` (unused: ``global_step`` places the run).

        Returns:
            ``(epoch, optimizer steps of that epoch already done)``.
        """
        ppo = self.grpo.ppo_epochs
        epoch, within = divmod(self.global_step // ppo, self._rounds_per_epoch)
        return epoch, within * ppo

    def checkpoint_state(self) -> dict:
        """The prompt cursor: rounds of prompts drawn (more than rollouts with
        ``--dynamic_filtering``); with ``--async_rollouts`` every rank's rollout generated
        ahead (waited for; collective), so a resumed run trains on the same samples.

        Returns:
            ``{"prompt_rounds": n}``, and ``"ahead"``: by rank, ``(prompts, (output,
            log-probs), version)`` or None.
        """
        state = {"prompt_rounds": self._rounds_drawn}
        if self.rollout_config.async_rollouts:
            state["ahead"] = self.ahead_state()
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        """The prompt cursor back (a checkpoint without one: one round per rollout done).

        Args:
            state: what ``checkpoint_state`` saved.
        """
        self._rounds_drawn = int(state.get("prompt_rounds",
                                           self.global_step // self.grpo.ppo_epochs))
        self.load_ahead(state.get("ahead") or [])

    @property
    def _rounds_per_epoch(self) -> int:
        return max(self.step_plan.steps_per_epoch // self.grpo.ppo_epochs, 1)

    def next_prompts(self) -> dict:
        """This rank's share of the next round of prompts (a round: one rollout's prompts on
        every rank), from the cursor: round ``n`` is round ``n mod rounds_per_epoch`` of the
        data's shuffle for epoch ``n // rounds_per_epoch``, so extra rounds (dynamic sampling)
        carry on into the next shuffles.

        Returns:
            The collated prompt batch.
        """
        epoch, within = divmod(self._rounds_drawn, self._rounds_per_epoch)
        per_round = self.per_rank * self.strategy.data_parallel_size
        self.train_dataloader.sampler.load_state_dict({"epoch": epoch,
                                                       "consumed": within * per_round})
        self._rounds_drawn += 1
        return next(iter(self.train_dataloader))

    # ------------------------------------------------------------ rollout
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample: bool, group: int = 1, max_new_tokens: int | None = None) -> torch.Tensor:
        """Completions (right of the prompts; padded after their end) from the policy. Every rank
        calls this alike; under ZeRO-3 the ranks keep stepping until all are done.

        Args:
            prompt_ids: left-padded prompt token ids.
            prompt_mask: their attention mask.
            sample: sample at the configured temperature, top-p and top-k (False: greedy).
            group: rows come in runs of ``group`` copies of one prompt (its prompt's forward then
                runs once: ``RolloutEngine.generate``).
            max_new_tokens: at most this many tokens (None: ``grpo.max_new_tokens``).

        Returns:
            The completion token ids, one row per prompt.
        """
        self._sync_rollouts()
        return generate_completions(self.rollouts, prompt_ids, prompt_mask,
                                    self._settings(sample, max_new_tokens), group)

    def _settings(self, sample: bool, max_new_tokens: int | None = None) -> dict:
        g = self.grpo
        settings = dict(max_new_tokens=max_new_tokens or g.max_new_tokens, do_sample=sample,
                        eos_token_id=self.tokenizer.eos_token_id,
                        pad_token_id=self.tokenizer.pad_token_id)
        if sample:
            settings.update(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k)
        return settings

    def _sync_rollouts(self) -> None:
        """The rollout engine to the policy's weights, if they moved since its last sync (an
        in-flight generation finished first: nothing else may use the engine meanwhile)."""
        if self._ahead is not None:
            self._ahead[1].join()
        if self._synced_at != self.global_step:
            start = time.perf_counter()
            self.rollouts.sync()
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

        def turn(contexts: list[list[int]], max_new: int):
            ids, mask = left_padded(contexts, self.tokenizer.pad_token_id)
            out = self.generate(ids.to(self.model.device), mask.to(self.model.device), sample,
                                max_new_tokens=max_new)
            return self._completions(out.cpu()), getattr(self.rollouts, "logprobs", None)

        episodes = self.episodes.run(prompts, prompt_ids, rows, self.answer_key, turn)
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
        micro = self.strategy.config.micro_train_batch_size
        batches = []
        for i in range(0, len(completions), micro):
            prompts, part = sampled.prompt_ids[i:i + micro], episodes[i:i + micro]
            b = self._micro_batch(prompts, completions[i:i + micro], rewards[i:i + micro],
                                  index=i // micro, scored=[e.model for e in part] or None)
            width = b["input_ids"].shape[1]
            if sampled.engine_logps:
                b["engine_logp"] = token_layout(prompts, sampled.engine_logps[i:i + micro], width)
            if part:  # each turn's reward on its last model token
                b["turn_rewards"] = token_layout(prompts, turn_values(part), width)
            if not trained[i:i + micro].all():
                b["trained"] = trained[i:i + micro]
            batches.append(b)
        if self.ref_model is not None:
            with torch.no_grad():
                for b in batches:
                    b["ref_logp"] = token_logps(self.ref_model, self.to_device(b),
                                               self.grpo.temperature)[0].cpu()
        self.advantages(batches)
        real = slice(0, len(completions) - filler)  # the filler's figures are not the step's
        lengths = [sum(e.model) for e in episodes] or [len(c) for c in completions]
        metrics = self._rollout_metrics(rewards[real], lengths[real], truncated[real], shaped)
        if episodes:
            metrics.update(self.episodes.metrics(episodes[real]))
        return batches, metrics

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

    def trained_mask(self, batch: dict, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` less the rows of completions that train nothing
        (``--mask_truncated_completions``).

        Args:
            batch: a rollout micro-batch.
            mask: its scored positions, rows x tokens.

        Returns:
            The positions the losses train and count.
        """
        trained = batch.get("trained")
        return mask if trained is None else mask & trained.to(mask.device)[:, None]

    def advantages(self, batches: list[dict]) -> None:
        """The experience stage's last step: each micro-batch's ``advantages`` from its
        ``rewards`` (one per completion; ``--advantage_estimator``). With ``kl_in_reward`` or
        ``gamma`` < 1 they are per token (``token_advantages``: discounted returns). The
        whitened estimators use the moments of every rank's completion tokens, so any world size
        gives the single-process values. Subclasses with a critic override this (PPO: GAE).

        Args:
            batches: the rollout's micro-batches (``rewards``, maybe ``ref_logp``), set in place.
        """
        g = self.grpo
        rewards = torch.cat([b["rewards"] for b in batches])
        out = outcome_advantages(rewards, g.group_size, g.advantage_estimator, g.advantage_eps)
        if g.per_token:
            self.token_advantages(batches, out, lambda r, mask, _: discounted_returns(
                r, mask, g.gamma))
            return
        if g.advantage_estimator in WHITENED:
            lengths = torch.cat([self.trained_mask(b, scored_mask(b)).sum(-1).float()
                                 for b in batches])
            out = whiten(out, self.strategy.all_reduce(token_moments(out, lengths), op="sum"))
        for b, part in zip(batches, out.split([len(b["rewards"]) for b in batches])):
            b["advantages"] = part.clone()

    def token_advantages(self, batches: list[dict], outcomes: torch.Tensor,
                         estimate: Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor],
                         ) -> None:
        """Per-token advantages: each completion's ``outcomes`` entry on its last token, less
        ``kl_coef`` x the KL (the policy at rollout time against the reference) on every token
        with ``kl_in_reward``; ``estimate(token_rewards, mask, batch)`` turns them into
        advantages, whitened over every rank's tokens for the whitened estimators (OpenRLHF's
        ``compute_reward``, returns or GAE, and whitening). The KL's policy log-probs (this
        rollout's pass) become the first update's "old" ones (``old_logp``).

        Args:
            batches: the rollout's micro-batches, set in place.
            outcomes: one outcome per completion, in batch order.
            estimate: token rewards, their mask, the micro-batch -> advantages.
        """
        g, masks, offset = self.grpo, [], 0
        for b in batches:
            mask = scored_mask(b).float()
            rows = mask.shape[0]
            rewards = outcome_token_rewards(outcomes[offset:offset + rows].float(), mask)
            if "turn_rewards" in b and g.advantage_estimator in PER_TURN:  # rewards as given
                rewards = b["turn_rewards"].float() * mask
            offset += rows
            if g.kl_in_reward and "ref_logp" in b:  # the rollout's policy against the reference
                with torch.no_grad():
                    b["old_logp"] = token_logps(self.model, self.to_device(b),
                                                g.temperature)[0].cpu()
                rewards = rewards - g.kl_coef * kl_estimate(b["old_logp"], b["ref_logp"],
                                                            g.kl_estimator) * mask
            b["advantages"] = estimate(rewards, mask, b)
            masks.append(self.trained_mask(b, mask.bool()).float())
        if g.advantage_estimator in WHITENED:
            scored = torch.cat([b["advantages"][m.bool()] for b, m in zip(batches, masks)])
            moments = self.strategy.all_reduce(token_moments(scored, torch.ones_like(scored)),
                                               op="sum")
            for b, m in zip(batches, masks):
                b["advantages"] = whiten(b["advantages"], moments) * m

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

    # ------------------------------------------------------------ update
    def loss_counts(self, batch: dict) -> dict[str, int]:
        if "prompt_ids" in batch:  # evaluation: prompts
            return {"samples": int(batch["prompt_ids"].shape[0])}
        scored = self.trained_mask(batch, scored_mask(batch)).sum(dim=-1)
        return {"tokens": int(scored.sum()), "completions": int((scored > 0).sum())}

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        logp, mask = token_logps(self.model, batch, self.grpo.temperature)  # the sampler's
        mask = self.trained_mask(batch, mask)
        key = batch["rollout_index"]  # which micro-batch of the rollout
        gap = {}
        if key not in self._old_logps:  # the rollout's first update: ratio 1 (kl_in_reward: the
            self._old_logps[key] = batch.get("old_logp", logp.detach())  # rollout's own pass)
            if "engine_logp" in batch:  # the engine's log-probs beside the trainer's, once
                mean, largest = engine_logprob_gap(self._old_logps[key], batch["engine_logp"],
                                                   mask)
                gap = {"engine_logprob_diff": mean, "engine_logprob_diff_max": Largest(largest)}
        ref = batch.get("ref_logp", logp.detach())
        g = self.grpo
        low, high = g.clip_bounds
        losses, metrics = grpo_token_losses(
            logp, self._old_logps[key], ref, batch["advantages"], mask, low,
            0.0 if g.kl_in_reward else g.kl_coef, clip_eps_high=high, dual_clip=g.dual_clip,
            kl_estimator=g.kl_estimator, policy_loss_type=g.policy_loss_type)
        correction = self.rollout_config.is_correction
        if correction is not None:  # the engine's log-probs differ from the trainer's
            low_w, high_w = self.rollout_config.is_correction_threshold
            weights, more = engine_is_weights(self._old_logps[key], batch["engine_logp"], mask,
                                              correction, low_w, high_w)
            losses, metrics = losses * weights, {**metrics, **more}
        return self.aggregate(losses, mask), {**metrics, **gap}

    def aggregate(self, losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the step's loss over its token ``losses``
        (``policy_loss_agg``).

        Args:
            losses: per-token losses, zero where ``mask`` is off.
            mask: the scored (completion) tokens.

        Returns:
            The share, for ``compute_loss``.
        """
        if self.grpo.policy_loss_agg == "token_mean":
            return self.normalize(losses.sum(), "tokens")
        if self.grpo.policy_loss_agg == "seq_mean_token_mean":
            per_completion = losses.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        else:  # seq_mean_token_sum_norm: Dr. GRPO's constant length
            per_completion = losses.sum(dim=-1) / self.grpo.max_new_tokens
        return self.normalize(per_completion.sum(), "completions")

    def train_steps(self, epoch: int, count: int) -> Iterator[Step]:
        """A rollout of the next prompts, trained on for ``ppo_epochs`` optimizer steps.

        Args:
            epoch: the epoch (the sampler is already set to it).
            count: how many optimizer steps to yield (a multiple of ``ppo_epochs``).

        Yields:
            ``Step``: the rollout's micro-batches and metrics, ``ppo_epochs`` times per rollout.
        """
        for _ in range(count // self.grpo.ppo_epochs):
            if self.rollout_config.async_rollouts:
                batches, rollout_metrics = self.rollout_ahead()
            else:
                batches, rollout_metrics = self.rollout(self.next_prompts())
            self._old_logps = {}
            for _ in range(self.grpo.ppo_epochs):
                yield Step(batches, rollout_metrics)

    # ------------------------------------------------------------ evaluation
    def eval_metrics(self, batch: dict) -> dict:
        """Greedy completions of held-out prompts: mean reward, exact match (when rows carry
        ``answer_key``) and length.

        Args:
            batch: held-out prompts on the device.

        Returns:
            ``(sum, count)`` pairs: ``reward``, ``completion_length``, maybe ``exact_match``.
        """
        if self.episodes is not None:  # greedy episodes; the answer is the last model turn
            with sampling_rng(self.strategy.config.seed, self.global_step, self.strategy.rank):
                played = self.play(batch, sample=False, group=1).episodes
            texts = self._texts([e.last_turn() for e in played])
            rewards = torch.tensor([e.reward for e in played])
            lengths = [sum(e.model) for e in played]
        else:
            completions = self._completions(self.generate(
                batch["prompt_ids"], batch["prompt_mask"], sample=False).cpu())
            texts = self._texts(completions)
            rewards = self._score(batch["prompts"], completions, texts, batch["rows"])
            lengths = [len(c) for c in completions]
        n = len(texts)
        out = {"reward": (rewards.sum().item(), n), "completion_length": (float(sum(lengths)), n)}
        if self.episodes is not None:
            out.update(self.episodes.metrics(played))
        if self.answer_key and all(self.answer_key in row for row in batch["rows"]):
            hits = sum(t.strip() == str(r[self.answer_key]).strip()
                       for t, r in zip(texts, batch["rows"]))
            out["exact_match"] = (float(hits), n)
        return out
