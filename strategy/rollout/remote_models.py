"""The clients of the models' Ray groups of their own (``strategy.cluster.model_group``): an
actor rank's reference, reward model or critic when the driver placed it apart. Actor rank ``i``
asks group rank ``i mod size``; a dead or silent rank is one line naming it and its node. Ray is
imported only once a group is asked for (the driver's ``GROUPS_VAR`` names one).
"""

from __future__ import annotations

import json
import os

import torch

from strategy.dist import first_line, get_rank
from strategy.errors import RankFailedError

GROUPS_VAR = "STRATEGY_MODEL_GROUPS"  # an actor rank's environment: the groups' ranks
GROUP_NAMES = {"ref": "reference group", "critic": "critic group", "reward": "reward model group"}


class RemoteGroup:
    """An actor rank's view of one group: its rank ``i mod size``, asked within ``--ray_timeout``;
    a dead or silent rank is one line naming it and its node."""

    def __init__(self, kind: str, namespace: str, ranks: list[dict], timeout: float) -> None:
        import ray  # the optional extra: a Ray job only

        self.place, self.size = ranks[get_rank() % len(ranks)], len(ranks)
        self.kind, self.timeout, self.ray = kind, timeout, ray
        self.handle = ray.get_actor(self.place["name"], namespace=namespace)

    def ask(self, method: str, calls: list[tuple]) -> list:
        """``method(*args)`` for each ``args`` of ``calls``, in order; the answers."""
        refs = [getattr(self.handle, method).remote(*args) for args in calls]
        try:
            return self.ray.get(refs, timeout=self.timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise RankFailedError(f"{self._named()} did not answer within --ray_timeout="
                                  f"{self.timeout:g} s") from None
        except self.ray.exceptions.RayActorError as exc:
            raise RankFailedError(f"{self._named()} died: {first_line(exc)}") from None

    def _named(self) -> str:
        return (f"{GROUP_NAMES[self.kind]} rank {self.place['rank']} (node {self.place['ip']} "
                f"{self.place['node_id'][:8]})")


class RemoteReference(RemoteGroup):
    """The reference in a group of its own: the trainers ask it ``logps_of`` (a local
    reference is a model they forward themselves)."""

    def logps_of(self, batches: list[dict]) -> list[torch.Tensor]:
        """Each micro-batch's reference log-probs (their layout as a local forward's)."""
        return self.ask("logps", [(b,) for b in batches])


class RemoteReward(RemoteGroup):
    """The reward model in a group of its own, called as ``ModelReward`` is."""

    scores_eos = True

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict],
                 ended: list[bool] | None = None) -> list[float]:
        return self.ask("scores", [(prompts, completions, ended)])[0]


class RemoteCritic(RemoteGroup):
    """PPO's critic in a group of its own: ``values`` come from its rank ``i mod size`` (with
    gradients on, as a leaf of this rank's graph), and ``backward`` sends the loss's gradient
    with respect to them back, where the critic backpropagates it and steps. Each call names
    this rank's turn among the actor ranks that rank serves (``CriticRank``). Persistence calls
    are collective over the critic group, as over the actor group."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.leaf: torch.Tensor | None = None
        self.caller = get_rank() // self.size  # this rank's turn at its critic rank
        self.last: bool | None = None  # steps of varying counts: the next backward ends one

    def ask(self, method: str, calls: list[tuple]) -> list:
        return super().ask(method, [(self.caller, *args) for args in calls])

    def prepare(self, total_steps: int) -> tuple[float, float]:
        """The critic's optimizer and schedule; the (mean, std) its values are scaled by."""
        return tuple(self.ask("prepare", [(total_steps,)])[0])

    def values(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's values of ``batch`` and their mask (``token_values``)."""
        grad = torch.is_grad_enabled()
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        values, mask = self.ask("values", [(cpu, grad)])[0]
        device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), "cpu")
        values, mask = values.to(device), mask.to(device)
        self.leaf = values.requires_grad_() if grad else None
        return values, mask

    def backward(self, loss: torch.Tensor) -> None:
        """Train the critic on ``loss``, a function of the last ``values`` taken with gradients."""
        if self.leaf is None:
            raise RuntimeError("RemoteCritic.backward without values taken with gradients on")
        (grad,) = torch.autograd.grad(loss, self.leaf)
        self.leaf = None
        self.ask("backward", [(grad.cpu(), self.last)])

    def sleep(self) -> None:
        """The critic's training states off its device until its next backward."""
        self.ask("sleep", [()])

    def save_ckpt(self, save_dir: str, tag: str, metric: float | None) -> None:
        self.ask("save_ckpt", [(save_dir, tag, metric)])

    def load_ckpt(self, load_dir: str, tag: str) -> None:
        self.ask("load_ckpt", [(load_dir, tag)])

    def save_model(self, path: str, max_shard_size: int | str) -> None:
        self.ask("save_model", [(path, max_shard_size)])


def remote_group(kind: str) -> RemoteGroup | None:
    """This actor rank's ``kind`` group (``"ref"``, ``"critic"`` or ``"reward"``, from the
    driver's ``GROUPS_VAR``), or None: the model is then this rank's own."""
    groups = json.loads(os.environ.get(GROUPS_VAR) or "{}")
    if kind not in groups.get("ranks", {}):
        return None
    cls = {"ref": RemoteReference, "critic": RemoteCritic, "reward": RemoteReward}[kind]
    return cls(kind, groups["namespace"], groups["ranks"][kind], groups["timeout"])
