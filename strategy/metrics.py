"""Metric sinks: TensorBoard + a JSONL file (+ wandb when asked) on rank 0, a null logger elsewhere,
so training loops never branch on rank."""

from __future__ import annotations

import json
import os
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from strategy import dist


class NullLogger:
    """Accepts everything, writes nothing (ranks > 0)."""

    def log(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
        pass

    def close(self) -> None:
        pass


class MetricsLogger(NullLogger):
    """Writes each ``log`` call to TensorBoard event files, ``metrics.jsonl`` and optionally
    wandb."""

    def __init__(self, log_dir: str, use_wandb: bool = False, run_name: str | None = None,
                 config: dict | None = None) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self.jsonl = open(self.path, "a")
        self.tb = SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard"))
        self.wandb = _start_wandb(log_dir, run_name, config) if use_wandb else None

    def log(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
        row = {f"{prefix}/{k}": float(v) for k, v in metrics.items() if v is not None}
        for key, value in row.items():
            self.tb.add_scalar(key, value, step)
        self.jsonl.write(json.dumps({"step": step, **row}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def close(self) -> None:
        self.tb.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
        rows = [json.loads(line) for line in open(self.path)]
        out = os.path.dirname(self.path)
        if any("train/reward" in row for row in rows):  # an on-policy run
            plot_rl_curves(rows, os.path.join(out, "rl_curves.png"))
        else:
            plot_curves(self.path, os.path.join(out, "loss_curve.png"))


def _pyplot():
    import matplotlib  # heavy (~0.5 s): imported once, at the end of a run, on rank 0 only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use, as matplotlib requires

    return plt


# an on-policy run's panels: (title, the keys drawn in it); a panel without data is left out
RL_PANELS = (
    ("sampled reward", ("train/reward",)),  # + each reward of a weighted sum (train/reward_*)
    ("held-out reward and exact match", ("eval/reward", "eval/exact_match")),
    ("KL to the reference", ("train/kl",)),
    ("completion length (tokens)", ("train/completion_length", "eval/completion_length")),
    ("policy loss", ("train/loss",)),
    ("value loss", ("train/critic_loss",)),
)


def plot_rl_curves(rows: list[dict], png_path: str) -> list[tuple[str, str]]:
    """An on-policy run in one figure: sampled and held-out reward, KL, completion length, policy
    (and value) loss, each in its own panel on a linear scale (the policy loss is near zero and
    often negative, the reward bounded: a log scale fits neither).

    Returns:
        The panels drawn, as (title, y scale).
    """
    plt = _pyplot()
    components = sorted({k for row in rows for k in row
                         if k.startswith("train/reward_") and k != "train/reward_std"})
    panels = [(title, keys + tuple(components) * (title == "sampled reward"))
              for title, keys in RL_PANELS]
    panels = [(title, keys) for title, keys in panels if any(k in row for row in rows
                                                             for k in keys)]
    cols = min(3, len(panels))
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, squeeze=False,
                             figsize=(4.5 * cols, 3.2 * ((len(panels) + cols - 1) // cols)))
    drawn = []
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 50 else None, label=key)
        ax.set(xlabel="optimizer step", title=title, yscale="linear")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        drawn.append((title, ax.get_yscale()))
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return drawn


def plot_curves(jsonl_path: str, png_path: str,
                keys: tuple[str, ...] = ("train/loss", "eval/loss")) -> None:
    """Plot the logged losses against the step into a PNG."""
    plt = _pyplot()
    rows = [json.loads(line) for line in open(jsonl_path)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="." if len(points) < 50 else None, label=key)
    ax.set(xlabel="optimizer step", ylabel="loss", yscale="log", title="training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def _start_wandb(log_dir: str, run_name: str | None, config: dict | None) -> Any:
    try:
        import wandb  # optional dependency
    except ImportError:
        raise RuntimeError("use_wandb=True but wandb is not installed; pip install wandb, "
                           "or drop --use_wandb") from None
    mode = os.environ.get("WANDB_MODE", "offline")  # works without network unless the user opts in
    return wandb.init(dir=log_dir, name=run_name, config=config or {}, mode=mode)


def create_logger(log_dir: str | None, use_wandb: bool = False, run_name: str | None = None,
                  config: dict | None = None) -> NullLogger:
    """A real logger on rank 0 (when ``log_dir`` is set), a null one everywhere else."""
    if log_dir is None or not dist.is_rank_0():
        return NullLogger()
    return MetricsLogger(log_dir, use_wandb, run_name, config)
