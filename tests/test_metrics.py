"""The rank-0 metrics logger: JSONL, TensorBoard, loss curve, and wandb in offline mode."""

from __future__ import annotations

import json
import sys
import types

from strategy.metrics import MetricsLogger, NullLogger, create_logger


def test_logger_writes_jsonl_tensorboard_and_curve(tmp_path):
    log = create_logger(str(tmp_path))
    assert isinstance(log, MetricsLogger)
    for step in range(1, 4):
        log.log(step, {"loss": 1.0 / step, "lr": 0.1, "grad_norm": None})
    log.log(3, {"loss": 0.5}, prefix="eval")
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[0] == {"step": 1, "train/loss": 1.0, "train/lr": 0.1} and rows[-1] == {
        "step": 3,
        "eval/loss": 0.5,
    }
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents*"))


def test_no_log_dir_or_other_rank_gets_null_logger(tmp_path, monkeypatch):
    assert type(create_logger(None)) is NullLogger
    monkeypatch.setenv("RANK", "1")
    assert type(create_logger(str(tmp_path / "x"))) is NullLogger and not (tmp_path / "x").exists()


def test_wandb_runs_offline_by_default(tmp_path, monkeypatch):
    calls = {}

    class Run:
        def log(self, row, step):
            calls.setdefault("rows", []).append((step, row))

        def finish(self):
            calls["finished"] = True

    fake = types.SimpleNamespace(init=lambda **kw: calls.update(init=kw) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = create_logger(str(tmp_path), use_wandb=True, run_name="r", config={"lr": 1})
    log.log(5, {"loss": 2.0})
    log.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["config"] == {"lr": 1}
    assert calls["rows"] == [(5, {"train/loss": 2.0})] and calls["finished"]


def test_log_prefixes_and_rank_zero_filter(monkeypatch, capsys):
    """One prefix scheme from strategy.log; ranks > 0 print only warnings, naming the rank."""
    import pytest

    from strategy import log

    checkpoint = log.get_logger("checkpoint")
    monkeypatch.setenv("RANK", "0")
    checkpoint.info("saved %s", "/ckpt/global_step4")
    log.print0("plain", 1)
    monkeypatch.setenv("RANK", "1")
    checkpoint.info("not shown on rank 1")
    checkpoint.warning("no RNG state for this rank")
    log.print0("not shown either")
    assert capsys.readouterr().out.splitlines() == [
        "[checkpoint] saved /ckpt/global_step4", "plain 1",
        "[checkpoint rank 1] no RNG state for this rank"]
    with pytest.raises(ValueError, match="log topic 'ckpt' is unknown"):
        log.get_logger("ckpt")  # every prefix comes from the one table


def test_an_on_policy_run_plots_its_own_figure(tmp_path):
    """A run that logs a sampled reward gets rl_curves.png (reward, held-out, KL, length,
    policy loss; each reward of a weighted sum too), linear scales, and no loss_curve.png."""
    from strategy.metrics import plot_rl_curves

    log = create_logger(str(tmp_path))
    for step in range(1, 5):
        log.log(step, {"loss": -0.01 * step, "reward": 0.1 * step, "reward_format": 1.0,
                       "reward_std": 0.5,
                       "kl": 0.001 * step, "completion_length": 7.0})
    log.log(4, {"exact_match": 0.5, "reward": 0.4}, prefix="eval")
    log.close()
    assert (tmp_path / "rl_curves.png").stat().st_size > 1000
    assert not (tmp_path / "loss_curve.png").exists()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    panels = plot_rl_curves(rows, str(tmp_path / "again.png"))
    assert [title for title, _ in panels] == [
        "sampled reward", "held-out reward and exact match", "KL to the reference",
        "completion length (tokens)", "policy loss"]  # no value loss logged: no panel
    assert {scale for _, scale in panels} == {"linear"}
    assert _drawn_keys(plot_rl_curves, rows, tmp_path)[0] == ["train/reward", "train/reward_format"]
    with_value = rows + [{"step": 5, "train/critic_loss": 0.3}]
    assert plot_rl_curves(with_value, str(tmp_path / "ppo.png"))[-1] == ("value loss", "linear")


def _drawn_keys(plot, rows, tmp_path) -> list[list[str]]:
    """The line labels of each panel ``plot`` draws (matplotlib's figure, captured)."""
    import matplotlib.pyplot as plt

    figures = []
    original = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append([[line.get_label() for line in ax.get_lines()] for ax in fig.axes])
        return original(fig, *args, **kwargs)

    plt.Figure.savefig = keep
    try:
        plot(rows, str(tmp_path / "labels.png"))
    finally:
        plt.Figure.savefig = original
    return figures[-1]
