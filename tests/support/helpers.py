"""Shared pieces of test bodies that run inside the ranks."""

from __future__ import annotations

import torch


def gathered_state(engine) -> dict[str, torch.Tensor]:
    """Full fp32 copies of every parameter on every rank (ZeRO-3 partitions gathered)."""
    import deepspeed

    module = getattr(engine, "module", engine)
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def make_strategy(
    stage: int = 2,
    bf16: bool = False,
    offload: bool = False,
    micro: int = 2,
    total: int = 8,
    lr: float = 1e-2,
    l2: float = 0.1,
    optimizer: str = "fused_adam",
    **kw,
):
    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig

    overrides = (
        {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else {}
    )
    cfg = StrategyConfig(
        zero_stage=stage,
        bf16=bf16,
        adam_offload=offload,
        micro_train_batch_size=micro,
        train_batch_size=total,
        max_norm=1.0,
        seed=1,
        ds_config_overrides=overrides,
        **kw,
    )
    strategy = DeepSpeedStrategy(
        cfg, OptimConfig(learning_rate=lr, l2=l2, lr_warmup_ratio=0.25, optimizer=optimizer)
    )
    strategy.setup_distributed()
    return strategy


def load_example_module(name: str) -> dict:
    """The globals of ``examples/<name>.py``, loaded by path (examples are scripts, not a
    package)."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    return runpy.run_path(str(path), run_name=f"example_{name}")


def load_example(name: str):
    """The ``main`` of ``examples/<name>.py``."""
    return load_example_module(name)["main"]


def forbid_process_group(monkeypatch, world_size: int | None = 2) -> None:
    """Any start of a process group fails the test: the checks under test must come before it.
    ``world_size``: what the launcher's environment says (None: leave it)."""
    import deepspeed

    def reached(*args, **kwargs):
        raise AssertionError("init_distributed was reached")

    monkeypatch.setattr(deepspeed, "init_distributed", reached)
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))


def torchrun_command(script: str, *args: str, port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` at 2 ranks on this machine."""
    import sys

    from strategy.dist import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(port or free_port()), script, *args]
