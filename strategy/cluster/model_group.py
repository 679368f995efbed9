"""Model groups of their own on Ray, as OpenRLHF places them: the reference
(``--ref_num_nodes``/``--ref_num_gpus_per_node`` without ``--colocate_actor_ref``), the reward
model (``--reward_num_nodes``/``--reward_num_gpus_per_node`` without
``--colocate_critic_reward``), frozen, and PPO's critic (``--critic_num_nodes``/
``--critic_num_gpus_per_node``, as the reward model), trained. Each rank is a Ray actor running
our ``DeepSpeedStrategy`` on a device of its own, the group's rendezvous its own. Actor rank ``i``
asks rank ``i mod size`` of each (the reference: each micro-batch's log-probs; the reward model:
each completion's score; the critic: values, and their gradient back); a group's size divides
the actor group's.

Each rank takes one call at a time and is asked as often as every other, so the ranks' ZeRO-3
gathers pair up as a launcher's ranks' would. A critic rank serving several actor ranks takes
their calls in turns (``Turns``), so each critic rank forwards and backpropagates in the same
order as every other.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch

from strategy.dist import free_port


class RayRank:
    """What the driver asks of each rank it places: where it runs, and (of a group's first
    rank) the group's rendezvous."""

    def where(self) -> dict:
        import ray  # the optional extra: a Ray job only

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "devices": [str(d) for d in context.get_accelerator_ids().get("GPU", [])],
                "pid": os.getpid()}

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0's, for the group's store)."""
        import ray  # the optional extra: a Ray job only

        return ray.util.get_node_ip_address(), free_port()


def group_run(command: str, argv: list[str], env: dict[str, str], cwd: str) -> tuple[Any, Any]:
    """A group rank's ``Run`` (its strategy started on this group's ranks, the tokenizer loaded)
    and the trainer's config, from the job's settings checked as the actor group checks them."""
    from strategy.checkpoint import CheckpointConfig  # heavy: a Ray job's start only
    from strategy.cluster.settings import configs  # as above
    from strategy.config import StrategyConfig  # as above
    from strategy.deepspeed_strategy import DeepSpeedStrategy  # as above
    from strategy.optim import OptimConfig  # as above
    from strategy.trainers.config import (  # as above
        DataConfig,
        LoraConfig,
        ModelConfig,
        TrainConfig,
    )
    from strategy.trainers.run import Run, load_tokenizer  # as above

    if os.path.isdir(cwd):  # the driver's folder, where this node sees it (relative paths)
        os.chdir(cwd)
    by_type = configs(command, argv)
    os.environ.update(env)
    strategy = DeepSpeedStrategy(by_type[StrategyConfig], by_type[OptimConfig],
                                 by_type[CheckpointConfig])
    strategy.setup_distributed()
    run = Run(strategy, model_cfg=by_type[ModelConfig], train=by_type[TrainConfig],
              data=by_type[DataConfig], lora=by_type[LoraConfig], configs=by_type)
    run.tokenizer = load_tokenizer(run.model_cfg)
    return run, next(c for c in by_type.values() if hasattr(c, "kl_coef"))


class FrozenRank(RayRank):
    """One rank of a reference or reward group, in a Ray actor (made remote by the driver)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.temperature = 1.0

    def start(self, kind: str, command: str, argv: list[str], env: dict[str, str],
              cwd: str) -> None:
        """The strategy (this group's ranks only) and the frozen model, loaded as the actor
        group's ranks would load it, from the job's settings checked as they check them."""
        from strategy.trainers.algorithms.preference import reference_model  # heavy: a start
        from strategy.trainers.algorithms.rewards import model_reward  # as above

        run, trainer = group_run(command, argv, env, cwd)
        if kind == "ref":
            self.model = run.strategy.prepare(reference_model(run, None))
            self.temperature = trainer.temperature
        else:
            self.model = model_reward(run, trainer)

    def logps(self, batch: dict) -> torch.Tensor:
        """The reference's log-probs of ``batch``'s targets (a trainer's micro-batch)."""
        from strategy.trainers.losses.lm import token_logps  # as ``start``

        device = torch.device(self.model.device)
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.no_grad():
            return token_logps(self.model, moved, self.temperature)[0].cpu()

    def scores(self, prompts: list[str], completions: list[str],
               ended: list[bool] | None) -> list[float]:
        """The reward model's score of each prompt + completion (``ModelReward``)."""
        return self.model(prompts, completions, [], ended)


class Turns:
    """Calls from ``callers`` callers taken in a fixed order: caller 0's n-th call, caller 1's,
    ..., then each one's (n+1)-th. Callers that make the same calls (actor ranks running the same
    program) are served in the same order on every rank of a group, whatever order they arrive
    in, and none waits on a call that waits on it: a caller's n-th call needs only the others'
    (n-1)-th, made before its own."""

    def __init__(self, callers: int, timeout: float) -> None:
        self.callers, self.timeout = callers, timeout
        self.served = 0  # calls served so far, all callers together
        self.changed = threading.Condition()

    @contextmanager
    def of(self, caller: int) -> Iterator[None]:
        """Wait (at most ``timeout`` seconds) for ``caller``'s turn; the turn passes on when the
        block ends, raised or not."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.served % self.callers == caller,
                                         self.timeout):
                raise TimeoutError(f"the actor rank before this one's turn did not call within "
                                   f"{self.timeout:g} s")
        try:
            yield
        finally:
            with self.changed:
                self.served += 1
                self.changed.notify_all()


def in_turn(lead_only: bool = False) -> Callable:
    """A ``CriticRank`` method taken in its caller's turn (its first argument: the caller's
    index among the actor ranks this rank serves); ``lead_only``: done for caller 0 only (a
    persistence call every actor rank makes, once per critic rank), the others' turns pass."""
    def wrap(method: Callable) -> Callable:
        @wraps(method)
        def taken(self, caller: int, *args: Any) -> Any:
            with self.turns.of(caller):
                if lead_only and caller:
                    return None
                return method(self, caller, *args)
        return taken
    return wrap


class CriticRank(RayRank):
    """One rank of PPO's critic group (``--critic_num_nodes``/``--critic_num_gpus_per_node``
    without ``--colocate_critic_reward``), in a Ray actor: the critic engine at its own ZeRO
    stage, trained on actor rank ``i``'s micro-batches at its rank ``i``. The actor rank computes
    the value loss on the values this rank sends and sends back its gradient with respect to
    them; this rank backpropagates it through the critic (the chain rule: the same gradient as
    the loss taken here) and steps at DeepSpeed's accumulation boundary.

    A group smaller than the actor group's serves ``callers`` actor ranks per rank (``i mod
    size``), in turns: its DeepSpeed accumulation is ``callers`` times the actor ranks' (the
    group's size in its batch settings), so a step averages the same micro-batches' gradients as
    the torchrun path's critic does."""

    def __init__(self, callers: int = 1, timeout: float = 300.0) -> None:
        self.run: Any = None
        self.ppo: Any = None
        self.engine: Any = None
        self.scale: tuple[float, float] | None = None
        self.pending: dict[int, torch.Tensor] = {}  # per caller: the values awaiting backward
        self.turns = Turns(callers, timeout)

    def start(self, kind: str, command: str, argv: list[str], env: dict[str, str],
              cwd: str) -> None:
        """The strategy (this group's ranks only) and the critic, built as the actor group's
        ranks would build it (``build_critic``), not yet an engine (``prepare``)."""
        from strategy.trainers.algorithms.ppo import build_critic  # heavy: a start only

        self.run, self.ppo = group_run(command, argv, env, cwd)
        self.engine = build_critic(self.run, self.ppo)

    @in_turn()
    def prepare(self, caller: int, total_steps: int) -> tuple[float, float]:
        """The critic's optimizer and schedule over ``total_steps`` (the actor's), and its
        engine (at caller 0's call); the (mean, std) its values are scaled by
        (``critic_scale``)."""
        from strategy.trainers.algorithms.ppo import critic_scale, critic_strategy  # as start

        if self.scale is None:
            own = critic_strategy(self.run.strategy, self.ppo)
            optimizer = own.create_optimizer(self.engine, lr=self.ppo.critic_learning_rate)
            schedule = own.create_scheduler(optimizer, num_training_steps=max(total_steps, 1))
            self.scale = critic_scale(self.ppo, self.engine.config)
            self.engine = own.prepare((self.engine, optimizer, schedule))
        return self.scale

    @in_turn()
    def values(self, caller: int, batch: dict, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_values`` of ``batch`` (their mask too); with ``grad`` the graph is kept for
        ``backward``."""
        from strategy.trainers.losses import token_values  # as ``start``

        device = torch.device(self.engine.device)
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.set_grad_enabled(grad):
            values, mask = token_values(self.engine, moved)
        if grad:
            self.pending[caller] = values
        return values.detach().cpu(), mask.cpu()

    @in_turn()
    def backward(self, caller: int, grad: torch.Tensor, last: bool | None = None) -> None:
        """Backpropagate ``grad`` (the loss's gradient with respect to the values last sent to
        ``caller``) through the critic, and step it at the accumulation boundary: as DeepSpeed
        counts, or (``last`` given: steps of varying counts of micro-batches, the same on every
        actor rank) after the last caller's step's last."""
        if last is not None:
            self.run.strategy.accumulation_boundary(
                self.engine, last and caller == self.turns.callers - 1)
        values = self.pending.pop(caller)
        surrogate = (values * grad.to(values.device)).sum()  # d surrogate / d values = grad
        self.run.strategy.backward(surrogate, self.engine)
        self.run.strategy.optimizer_step(self.engine)

    @in_turn(lead_only=True)
    def sleep(self, caller: int) -> None:
        """The critic's training states off the device until its next backward
        (the strategy's ``sleep``: nothing without ``--ds_enable_sleep``)."""
        self.run.strategy.sleep(self.engine)

    @in_turn(lead_only=True)
    def save_ckpt(self, caller: int, save_dir: str, tag: str, metric: float | None) -> None:
        """The critic's resume checkpoint (collective over the group; its rank 0 writes)."""
        self.run.strategy.save_ckpt(self.engine, save_dir=save_dir, tag=tag, metric=metric)

    @in_turn(lead_only=True)
    def load_ckpt(self, caller: int, load_dir: str, tag: str) -> None:
        """The critic's state from its checkpoint ``tag`` (collective over the group)."""
        self.run.strategy.load_ckpt(self.engine, load_dir, tag=tag)

    @in_turn(lead_only=True)
    def save_model(self, caller: int, path: str, max_shard_size: int | str) -> None:
        """The critic exported as a Hugging Face directory (collective; rank 0 writes)."""
        self.run.strategy.save_model(self.engine, self.run.tokenizer, path,
                                     max_shard_size=max_shard_size)
