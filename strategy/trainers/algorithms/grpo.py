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
import itertools
from typing import Any, Callable, Iterator

import torch

from strategy.agents import load_agent
from strategy.config.cluster import ClusterConfig
from strategy.errors import fail
from strategy.rollout.config import RolloutConfig
from strategy.tools import ToolAgent, load_tools, tool_schemas, tool_turn
from strategy.trainers.algorithms.ahead import EngineRollouts
from strategy.trainers.algorithms.completions import longest_prompt, sampling_rng
from strategy.trainers.algorithms.episodes import EpisodeRunner
from strategy.trainers.algorithms.experience import ExperienceMaker
from strategy.trainers.algorithms.grpo_checks import check_grpo_settings
from strategy.trainers.algorithms.policy_update import PolicyUpdate
from strategy.trainers.config import GRPOConfig
from strategy.trainers.data import PROMPTS
from strategy.trainers.data.spec import prompts_per_rank
from strategy.trainers.loop import Step, StepPlan, Trainer, plan_steps

Reward = Callable[[list[str], list[str], list[dict]], list[float]]


def by_step(batches: list[dict], steps: int) -> list[list[dict]]:
    """A rollout's micro-batches in its ``steps`` optimizer steps: runs of the same
    ``rollout_step`` (the experience stage's cut, of any count each under ``--dynamic_batch``),
    or, for micro-batches that carry none (a subclass's own), equal runs in order."""
    if all("rollout_step" in b for b in batches):
        return [list(run) for _, run in itertools.groupby(batches, lambda b: b["rollout_step"])]
    per_step = len(batches) // steps
    return [batches[i:i + per_step] for i in range(0, len(batches), per_step)]


class GRPOTrainer(EngineRollouts, ExperienceMaker, PolicyUpdate, Trainer):
    """The policy trains; ``ref_model`` (needed when ``kl_coef`` > 0) becomes an eval engine;
    ``reward(prompts, completions, rows) -> floats`` scores completions (``rewards``).

    Built on the public ``Trainer`` hooks: ``train_steps`` runs a rollout and yields it as
    ``ppo_epochs`` optimizer steps; ``resume_position`` places the prompt sampler by rollouts.
    The stages are mixins, a module each: the experience stage (``ExperienceMaker``: generate,
    score, shape, micro-batches), the update (``PolicyUpdate``: advantages, the loss), and what
    only a vLLM engine does (``EngineRollouts``: rollouts generated ahead); a subclass overrides
    any of their methods as it would this class's.

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
    config_classes = (GRPOConfig, RolloutConfig, ClusterConfig)

    @classmethod
    def check_settings(cls, configs: dict, world_size: int) -> None:
        """GRPO's refusals (``grpo_checks.check_grpo_settings``): the settings it cannot run
        with, an importable reward function, and a reference model when there is a KL penalty.

        Args:
            configs: the parsed configs by class.
            world_size: ranks the launcher started.

        Raises:
            ConfigError: a setting GRPO cannot run with.
        """
        check_grpo_settings(configs, cls.config_classes[0], world_size)

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
        self.varying_micro_batches = grpo.dynamic_batch  # a token budget's micro-batches
        shared = grpo.shared_prompt_forward  # None: where a forward call does not gather weights
        self.share_prompts = not strategy.config.partitions_parameters if shared is None \
            else shared
        if isinstance(ref_model, torch.nn.Module):  # else a group of its own (``logps_of``)
            ref_model = strategy.prepare(ref_model)
        self.ref_model = ref_model
        self.per_rank = prompts_per_rank(strategy.config, strategy.world_size, grpo.group_size,
                                         grpo.rollout_batch_size)
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
            grpo.agent_timeout, strategy,
            {"temperature": grpo.temperature, "top_p": grpo.top_p, "top_k": grpo.top_k})

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
                                tools=tools, rollout_batch_size=grpo.rollout_batch_size)

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
        per_rollout = prompts_per_rank(strategy.config, strategy.world_size, grpo.group_size,
                                       grpo.rollout_batch_size)
        per_rollout *= strategy.data_parallel_size
        ppo = grpo.updates_per_rollout(strategy.config.train_batch_size)
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
        span = self._span
        epoch, within = divmod(self.global_step // span, self._rounds_per_epoch)
        return epoch, within * span

    @property
    def _span(self) -> int:
        """Optimizer steps per rollout."""
        return self.grpo.updates_per_rollout(self.strategy.config.train_batch_size)

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
        self._rounds_drawn = int(state.get("prompt_rounds", self.global_step // self._span))
        self.load_ahead(state.get("ahead") or [])

    @property
    def _rounds_per_epoch(self) -> int:
        return max(self.step_plan.steps_per_epoch // self._span, 1)

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

    def train_steps(self, epoch: int, count: int) -> Iterator[Step]:
        """A rollout of the next prompts, trained on for ``ppo_epochs`` optimizer steps.

        Args:
            epoch: the epoch (the sampler is already set to it).
            count: how many optimizer steps to yield (a multiple of ``ppo_epochs``).

        Yields:
            ``Step``: the rollout's micro-batches and metrics, ``ppo_epochs`` times per rollout.
        """
        steps = self._span // self.grpo.ppo_epochs  # optimizer steps per pass over a rollout
        for _ in range(count // self._span):
            self.sleep_trained()
            if self.rollout_config.async_rollouts:
                batches, rollout_metrics = self.rollout_ahead()
            else:
                batches, rollout_metrics = self.rollout(self.next_prompts())
            self._old_logps = {}
            number = self.global_step // self._span + 1  # logged: the rollout apart from the step
            rollout_metrics = {**rollout_metrics, "rollout": (float(number), 1)}
            if steps > 1:  # later steps' micro-batches: the rollout's policy, before any update
                self.rollout_logps(batches)
            for _ in range(self.grpo.ppo_epochs):
                for step_batches in by_step(batches, steps):
                    yield Step(step_batches, rollout_metrics)

    def sleep_trained(self) -> None:
        """The trained engines' training states off the device while a rollout is made
        (``--ds_enable_sleep``: the strategy's ``sleep``; each wakes at its next backward)."""
        self.strategy.sleep(*self.trained_engines().values())

    # ------------------------------------------------------------ evaluation
    def eval_metrics(self, batch: dict) -> dict:
        """Greedy completions of held-out prompts: mean reward, exact match (when rows carry
        ``answer_key``) and length; with ``--eval_temperature``, ``--eval_n_samples`` sampled
        completions of each, drawn from the generator of (seed, step, rank) so a rerun evaluates
        the same samples (``eval_figures``).

        Args:
            batch: held-out prompts on the device.

        Returns:
            ``(sum, count)`` pairs: ``reward``, ``completion_length``, maybe ``exact_match``.
        """
        g = self.grpo
        sampled, k = g.eval_temperature > 0, g.eval_n_samples  # k is 1 unless sampled
        rows = [row for row in batch["rows"] for _ in range(k)]
        with sampling_rng(self.strategy.config.seed, self.global_step, self.strategy.rank):
            if self.episodes is not None:  # greedy episodes; the answer is the last model turn
                played = self.play(batch, sample=False, group=1).episodes
            else:
                ids, mask = (batch[key].repeat_interleave(k, dim=0)
                             for key in ("prompt_ids", "prompt_mask"))
                completions = self._completions(self.generate(
                    ids, mask, sample=sampled, group=k, temperature=g.eval_temperature).cpu())
        if self.episodes is not None:
            texts = self._texts([e.last_turn() for e in played])
            rewards = torch.tensor([e.reward for e in played])
            lengths = [sum(e.model) for e in played]
        else:
            texts = self._texts(completions)
            rewards = self._score([p for p in batch["prompts"] for _ in range(k)], completions,
                                  texts, rows)
            lengths = [len(c) for c in completions]
        hits = None
        if self.answer_key and all(self.answer_key in row for row in batch["rows"]):
            hits = [t.strip() == str(r[self.answer_key]).strip() for t, r in zip(texts, rows)]
        out = eval_figures(rewards, hits, lengths, k, sampled)
        if self.episodes is not None:
            out.update(self.episodes.metrics(played))
        return out

def eval_figures(rewards: torch.Tensor, hits: list[bool] | None, lengths: list[int],
                 k: int = 1, sampled: bool = False) -> dict:
    """Held-out metrics of ``k`` completions per prompt (rows in runs of ``k``): ``reward`` (the
    mean over every completion), ``completion_length`` and ``exact_match``; sampled, as
    OpenRLHF's ``compute_eval_metrics``, also ``pass1`` (= ``reward``) and ``pass<k>`` (each
    prompt's best reward, averaged over prompts), and ``exact_match_pass<k>`` (a prompt with any
    sample right).

    Args:
        rewards: one reward per completion.
        hits: whether each completion is the row's answer (None: no answers).
        lengths: each completion's tokens.
        k: completions per prompt.
        sampled: whether they were sampled (greedy: no pass figures).

    Returns:
        ``(sum, count)`` pairs.
    """
    n, prompts = len(lengths), len(lengths) // k
    by_prompt = rewards.float().reshape(prompts, k)
    out = {"reward": (by_prompt.sum().item(), n), "completion_length": (float(sum(lengths)), n)}
    if sampled:
        out["pass1"] = out["reward"]
    if k > 1:
        out[f"pass{k}"] = (by_prompt.max(dim=1).values.sum().item(), prompts)
    if hits is not None:
        right = torch.tensor(hits, dtype=torch.float).reshape(prompts, k)
        out["exact_match"] = (right.sum().item(), n)
        if k > 1:
            out[f"exact_match_pass{k}"] = (right.max(dim=1).values.sum().item(), prompts)
    return out
