"""Saving resume checkpoints on DeepSpeed's ``save_checkpoint``, crash-safely.

What an exact resume needs travels inside: step, consumed samples, every RNG (one
``rng_state_<rank>.safetensors`` per rank), the scheduler, and the caller's ``client_state``. A
save is written under ``<save_dir>/.incomplete/<tag>`` and published into ``<save_dir>/<tag>`` by
rank 0 only after every rank finished (a re-saved tag keeps its old directory until the new one
is whole), then ``latest`` is replaced atomically: a killed save never becomes the one
``load_checkpoint`` picks. On node-local storage each node's local rank 0 does the same for its
own copy, and a resume takes the newest checkpoint complete on every node.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable

from strategy import dist
from strategy.atomic_fs import publish_dir, write_file, write_json
from strategy.checkpoint.config import Retention
from strategy.checkpoint.layout import LATEST, META, STAGING, RunLayout
from strategy.checkpoint.progress import check_boundary, progress
from strategy.checkpoint.retention import apply_retention
from strategy.checkpoint.rng_state import capture_rng, save_rng
from strategy.checkpoint.tags import validate_tag
from strategy.errors import SaveError
from strategy.internals import engine_counters
from strategy.log import get_logger

log = get_logger("checkpoint")

CLIENT_KEY = "strategy_client_state"  # the caller's client_state, apart from DeepSpeed's own keys


def _param_groups(engine: Any) -> list[dict]:
    """Per-group hyperparameters (JSON-safe); ZeRO-3 universal loading copies group 0's to all."""
    groups = getattr(engine.optimizer, "param_groups", None) or []
    plain = (int, float, bool, str, type(None))
    return [{key: list(value) if isinstance(value, tuple) else value
             for key, value in group.items()
             if key not in ("params", "names") and isinstance(value, (*plain, tuple))}
            for group in groups]


def publish(save_dir: str, staged: str, tag: str, meta: dict, save_latest: bool = True) -> str:
    """Rank 0: mark the staged checkpoint complete, move it into place, point ``latest`` at it
    (unless not ``save_latest``)."""
    write_json(os.path.join(staged, META), meta)
    staging = os.path.dirname(staged)
    for name in os.listdir(staging):  # DeepSpeed drops zero_to_fp32.py beside its tags: keep it
        if os.path.isfile(os.path.join(staging, name)):
            os.replace(os.path.join(staging, name), os.path.join(save_dir, name))
    final = os.path.join(save_dir, tag)
    publish_dir(staged, final)
    if save_latest:
        write_file(os.path.join(save_dir, LATEST), tag)
    return final


def _on_node_writers(fn: Callable, *args: Any) -> Any:
    """``dist.on_node_writers``, returning this node's result (as ``on_rank_0``, rank 0's)."""
    return dist.on_node_writers(fn, *args)[dist.get_node_rank()]


def _reset_staging(staging: str) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging, exist_ok=True)


def _failure(save_dir: str, tag: str) -> Callable[[int, str], SaveError]:
    def make(rank: int, message: str) -> SaveError:
        return SaveError(f"saving checkpoint {tag!r} to {save_dir} failed on rank {rank} "
                         f"({message}); free disk space and save again: earlier checkpoints are "
                         "intact and load_ckpt still picks the newest of them")
    return make


def _free_bytes(path: str) -> str:
    return f"; {shutil.disk_usage(path).free if os.path.isdir(path) else -1} bytes free"


def _write_files(engine: Any, staging: str, tag: str, client_state: dict | None, rng,
                 rank_files: Callable[[str, int], None] | None) -> None:
    """Every rank writes its own files; a failure comes before DeepSpeed's closing barrier, so the
    failed rank meets the others there before the error is shared."""
    try:
        engine.save_checkpoint(staging, tag, client_state={CLIENT_KEY: dict(client_state or {})},
                               save_latest=False)
    except Exception:
        dist.barrier()
        raise
    save_rng(rng, os.path.join(staging, tag), dist.get_rank())
    if rank_files is not None:
        rank_files(os.path.join(staging, tag), dist.get_rank())


def save_checkpoint(engine: Any, save_dir: str, tag: str | None = None,
                    client_state: dict | None = None, retention: Retention | None = None,
                    metric: float | None = None,
                    write_metadata: Callable[[str], None] | None = None,
                    layout: RunLayout | None = None, node_local: bool = False,
                    rank_files: Callable[[str, int], None] | None = None,
                    save_latest: bool = True) -> str:
    """Save on every rank (collective). The publisher is rank 0, or with ``node_local`` each
    node's local rank 0 for its own copy; retention runs once every publisher has published.

    Args:
        engine: the DeepSpeed engine to save, right after an optimizer step.
        save_dir: the directory holding the checkpoints.
        tag: the checkpoint's name (default ``global_step<N>``).
        client_state: the caller's state, given back by ``load_checkpoint``.
        retention: what stays once it is published (default ``Retention()``).
        metric: ranks this checkpoint for ``keep_best``.
        write_metadata: ``write_metadata(dir)`` runs on the publisher before publishing (the
            facade writes the model's config.json there).
        layout: the run's ``RunLayout``, recorded for the resume to check (default
            ``RunLayout()``).
        node_local: each node writes and publishes its own copy of ``save_dir``.
        rank_files: ``rank_files(dir, rank)`` writes this rank's own extra files (the EMA
            weights' part) beside DeepSpeed's.
        save_latest: point ``latest`` at it (DeepSpeed's meaning: a resume without a tag loads
            the checkpoint ``latest`` names); False leaves ``latest`` as it was.

    Returns:
        The published checkpoint's directory, ``<save_dir>/<tag>``.

    Raises:
        ConfigError: ``tag`` is invalid or the engine is mid-accumulation.
        SaveError: writing failed on some rank (raised on every rank).
    """
    on_publisher = _on_node_writers if node_local else dist.on_rank_0
    retention = retention or Retention()
    layout = layout or RunLayout()
    rng = capture_rng()  # before anything here could draw a random number
    tag = validate_tag(f"global_step{engine_counters(engine)[0]}" if tag is None else tag)
    check_boundary(engine)
    staging = os.path.join(save_dir, STAGING)
    on_publisher(_reset_staging, staging)  # drops what a killed save left
    error, detail = None, ""
    try:
        _write_files(engine, staging, tag, client_state, rng, rank_files)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error, detail = exc, _free_bytes(save_dir)
    dist.raise_if_any_failed(error, _failure(save_dir, tag), detail)  # also the barrier
    staged = os.path.join(staging, tag)
    if write_metadata is not None:
        on_publisher(write_metadata, staged)
    meta = {"format": 1, "tag": tag, "saved_at": time.time(), "world_size": dist.get_world_size(),
            "zero_stage": int(engine.zero_optimization_stage()),
            "metric": None if metric is None else float(metric),
            "param_groups": _param_groups(engine), **layout.recorded(),
            "storage": "node_local" if node_local else "shared", "nodes": dist.get_num_nodes(),
            **progress(engine, samples_per_step=layout.samples_per_step)}
    final = on_publisher(publish, save_dir, staged, tag, meta, save_latest)
    deleted = on_publisher(apply_retention, save_dir, retention)
    if deleted:
        log.info("retention deleted %s from %s", deleted, save_dir)
    return final
