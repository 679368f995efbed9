"""Resume checkpoints on DeepSpeed's ``save_checkpoint``/``load_checkpoint``.

What an exact resume needs travels inside: step, consumed samples, the sampler's position,
every RNG (one ``rng_state_<rank>.safetensors`` per rank), the scheduler, and the caller's
``client_state``. A save is written under ``<save_dir>/.incomplete/<tag>`` and renamed into
``<save_dir>/<tag>`` by rank 0 only after every rank finished, then ``latest`` is replaced
atomically: a killed save never becomes the one ``load_checkpoint`` picks. A checkpoint
saved at another world size is converted to DeepSpeed's universal format and loaded from that.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

from strategy import dist
from strategy.config import fail
from strategy.export import save_model_metadata
from strategy.retention import HF_SUFFIX, META, STAGING, apply_retention, read_meta, remove_dir, scan, validate_limits
from strategy.rng_state import capture_rng, restore_rng, save_rng
from strategy.safe_load import verify_torch_files, weights_only_loads

LATEST = "latest"
CLIENT_KEY = "strategy_client_state"  # the caller's client_state, kept apart from DeepSpeed's own keys
UNIVERSAL = "universal"  # <tag>/universal: the converted checkpoint, made once on first use
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]{0,199}")


@dataclass
class ResumeState:
    """Where a resumed run stands; ``epoch_consumed`` goes to ``sampler.set_epoch(epoch, epoch_consumed)``."""

    tag: str  # the checkpoint loaded
    global_step: int  # optimizer steps done
    consumed_samples: int  # global samples consumed by those steps
    epoch: int | None  # the sampler's epoch (None when no dataloader was given at save)
    epoch_consumed: int | None  # global samples of that epoch already consumed


def validate_tag(tag: Any) -> str:
    """A tag is one plain path component, so it cannot escape ``save_dir``."""
    tag = str(tag)
    if not _TAG.fullmatch(tag):
        fail("tag", tag, "use letters, digits and _ . + = - only, starting with a letter or digit "
             "(one directory name inside save_dir)")
    if tag in (LATEST, "latest_universal") or tag.endswith(HF_SUFFIX):
        fail("tag", tag, f"'latest', 'latest_universal' and names ending in {HF_SUFFIX!r} are reserved; pick another")
    return tag


# ------------------------------------------------------------ progress


def _sampler_of(dataloader: Any) -> Any:
    sampler = getattr(dataloader, "sampler", dataloader)
    if not hasattr(sampler, "load_state_dict") or not hasattr(sampler, "num_replicas"):
        fail("dataloader", type(sampler).__name__, "pass the loader from strategy.setup_dataloader "
             "(its ResumableDistributedSampler records the position)")
    return sampler


def progress(engine: Any, dataloader: Any = None) -> dict:
    """Step, consumed samples and (with a loader) the sampler's epoch and position in it.

    Every optimizer step consumes ``train_batch_size`` samples, so the position follows from
    DeepSpeed's ``global_samples`` and the loader's epoch length (epochs counted from 0)."""
    out = {"global_step": int(engine.global_steps), "consumed_samples": int(engine.global_samples),
           "epoch": None, "epoch_consumed": None}
    if dataloader is not None:
        sampler = _sampler_of(dataloader)
        batch = getattr(dataloader, "batch_size", None) or 1
        per_rank = sampler.num_samples // batch * batch if getattr(dataloader, "drop_last", True) else \
            sampler.num_samples
        per_epoch = max(per_rank * sampler.num_replicas, 1)
        out["epoch"], out["epoch_consumed"] = divmod(out["consumed_samples"], per_epoch)
    return out


def _check_boundary(engine: Any) -> None:
    accum = engine.gradient_accumulation_steps()
    if engine.micro_steps % accum:
        fail("save_ckpt", f"micro step {engine.micro_steps % accum} of {accum}",
             "save right after optimizer_step at an accumulation boundary (the step's gradients are not saved)")


# ------------------------------------------------------------ save


def on_rank_0(fn: Any, *args: Any) -> Any:
    """Run ``fn`` on rank 0 only (a collective): every rank gets its result, or raises its error,
    so a failure on rank 0 never leaves the other ranks waiting in a barrier."""
    out = None
    if dist.is_rank_0():
        try:
            out = ("ok", fn(*args))
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            out = ("error", e)
    kind, value = dist.broadcast_object(out)
    if kind == "error":
        if dist.is_rank_0():
            raise value
        try:
            error = type(value)(*value.args)
        except Exception:  # noqa: BLE001 - an exception type that cannot be rebuilt from its args
            error = RuntimeError(str(value))
        raise error
    return value



def _write_json(path: str, data: dict) -> None:
    """Write-then-rename with fsync: readers see the old file or the new one, never half."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _write_latest(save_dir: str, tag: str) -> None:
    tmp = os.path.join(save_dir, f".{LATEST}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(tag)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))


def _param_groups(engine: Any) -> list[dict]:
    """Per-group hyperparameters (JSON-safe); ZeRO-3 universal loading copies group 0's to all groups."""
    groups = getattr(engine.optimizer, "param_groups", None) or []
    keep = (int, float, bool, str, type(None))
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()
             if k not in ("params", "names") and (isinstance(v, keep) or isinstance(v, tuple))} for g in groups]


def _publish(save_dir: str, staged: str, tag: str, meta: dict) -> str:
    """Rank 0: mark the staged checkpoint complete, move it into place, point ``latest`` at it."""
    _write_json(os.path.join(staged, META), meta)
    staging = os.path.dirname(staged)
    for name in os.listdir(staging):  # DeepSpeed drops zero_to_fp32.py beside its tags: keep it in save_dir
        if os.path.isfile(os.path.join(staging, name)):
            os.replace(os.path.join(staging, name), os.path.join(save_dir, name))
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final):  # re-saving a tag: the old one goes only once the new one is whole
        remove_dir(final, save_dir)
    os.replace(staged, final)
    _write_latest(save_dir, tag)
    return final


def save_checkpoint(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                    max_num: int = 3, max_mem: float = 1000, metric: float | None = None, keep_best: int = 0,
                    higher_is_better: bool = False) -> str:
    """Save on every rank (collective); returns the checkpoint's directory. See the module docstring."""
    rng = capture_rng()  # before anything here could draw a random number
    tag = validate_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    validate_limits(max_num, max_mem, keep_best)
    _check_boundary(engine)
    staging = os.path.join(save_dir, STAGING)
    on_rank_0(_reset_staging, staging)  # drops what a killed save left
    staged = os.path.join(staging, tag)
    error = None
    try:
        engine.save_checkpoint(staging, tag, client_state={CLIENT_KEY: dict(client_state or {})}, save_latest=False)
    except Exception as e:  # noqa: BLE001 - a failed write comes before DeepSpeed's closing barrier:
        error = _write_error(e, save_dir)
        dist.barrier()  # meet the ranks that are waiting in it
    try:
        save_rng(rng, staged, dist.get_rank()) if error is None else None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
        error = _write_error(e, save_dir)
    failed = dist.first_error(error)  # also the barrier: every rank's files are on disk
    if failed:
        raise RuntimeError(f"saving checkpoint {tag!r} to {save_dir} failed on rank {failed[0]} ({failed[1]}); "
                           f"free disk space and save again: earlier checkpoints are intact and load_ckpt still "
                           f"picks the newest of them")
    on_rank_0(save_model_metadata, engine, staged)  # config.json for `python -m strategy.export`
    meta = {"format": 1, "tag": tag, "saved_at": time.time(), "world_size": dist.get_world_size(),
            "zero_stage": int(engine.zero_optimization_stage()), "metric": None if metric is None else float(metric),
            "param_groups": _param_groups(engine), **progress(engine)}
    final = on_rank_0(_publish, save_dir, staged, tag, meta)
    deleted = on_rank_0(apply_retention, save_dir, max_num, max_mem, keep_best, higher_is_better)
    if deleted:
        dist.print0(f"checkpoint retention deleted {deleted} from {save_dir}")
    return final


def _write_error(e: Exception, save_dir: str) -> str:
    free = shutil.disk_usage(save_dir).free if os.path.isdir(save_dir) else -1
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}; {free} bytes free"


def _reset_staging(staging: str) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging, exist_ok=True)


# ------------------------------------------------------------ load


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag to load: the given one (must be complete), else ``latest`` if complete, else the newest
    complete checkpoint; None when there is none."""
    if tag is not None:
        tag = validate_tag(tag)
        if read_meta(os.path.join(load_dir, tag)) is None:
            done = [e.name for e in scan(load_dir) if e.is_ckpt]
            fail("tag", tag, f"{load_dir} holds no complete checkpoint of that name; use one of {done}")
        return tag
    try:
        with open(os.path.join(load_dir, LATEST)) as fh:
            latest = fh.read().strip()
        if _TAG.fullmatch(latest) and read_meta(os.path.join(load_dir, latest)) is not None:
            return latest
    except FileNotFoundError:
        pass
    done = [e for e in scan(load_dir) if e.is_ckpt]
    return done[-1].name if done else None




def ensure_universal(ckpt_dir: str) -> str:
    """Rank 0: convert ``ckpt_dir`` with DeepSpeed's ``ds_to_universal`` once; returns the universal dir."""
    from deepspeed.checkpoint import ds_to_universal

    out = os.path.join(ckpt_dir, UNIVERSAL)
    if os.path.isfile(os.path.join(out, META)):
        return out
    tmp = f"{out}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=ckpt_dir, output_folder=tmp, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    ds_to_universal.main(args)
    shutil.copy2(os.path.join(ckpt_dir, META), os.path.join(tmp, META))  # marks the conversion complete
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    for leftover in ("latest_universal",):
        if os.path.isfile(os.path.join(ckpt_dir, leftover)):
            os.unlink(os.path.join(ckpt_dir, leftover))
    return out


def _load_universal(engine: Any, ckpt_dir: str, meta: dict, **kw: Any) -> tuple[Any, dict]:
    on_rank_0(ensure_universal, ckpt_dir)
    old = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = True  # read only inside load_checkpoint
    try:
        path, state = engine.load_checkpoint(ckpt_dir, UNIVERSAL, **kw)
    finally:
        engine._config.load_universal_checkpoint = old
    groups = getattr(engine.optimizer, "param_groups", None) or []
    for group, saved in zip(groups, meta.get("param_groups") or [], strict=False):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k != "lr"})
    return path, state


def load_checkpoint(engine: Any, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, dataloader: Any = None,
                    universal: bool | None = None) -> tuple[str | None, dict, ResumeState | None]:
    """Load on every rank (collective). Returns the checkpoint directory (None: nothing to resume),
    the caller's client_state and the :class:`ResumeState`. ``universal`` forces (True) or forbids
    (False) the universal conversion; by default it is used when the world size changed."""
    tag = on_rank_0(resolve_tag, load_dir, tag)  # every rank loads the checkpoint rank 0 found
    if tag is None:
        return None, {}, None
    ckpt_dir = os.path.join(load_dir, tag)
    meta = read_meta(ckpt_dir)
    kw = {"load_optimizer_states": load_optimizer_states, "load_lr_scheduler_states": load_lr_scheduler_states}
    if universal is None:
        universal = meta["world_size"] != dist.get_world_size() and meta["zero_stage"] > 0
    verify_torch_files(ckpt_dir)
    with weights_only_loads():
        if universal:
            path, state = _load_universal(engine, ckpt_dir, meta, **kw)
        else:
            path, state = engine.load_checkpoint(load_dir, tag, **kw)
    if path is None:
        raise RuntimeError(f"load_dir={load_dir!r}: DeepSpeed could not load tag {tag!r}; check {ckpt_dir}")
    pos = progress(engine, dataloader)  # the position in this run's loader (the world size may have changed)
    if dataloader is not None:
        _sampler_of(dataloader).load_state_dict({"epoch": pos["epoch"], "consumed": pos["epoch_consumed"]})
    if not restore_rng(ckpt_dir, dist.get_rank()):
        print(f"[rank {dist.get_rank()}] {ckpt_dir} has no RNG state for this rank (saved at {meta['world_size']} "
              "ranks); its RNG streams continue from the seed", flush=True)
    resume = ResumeState(tag, pos["global_step"], pos["consumed_samples"], pos["epoch"], pos["epoch_consumed"])
    return ckpt_dir, dict((state or {}).get(CLIENT_KEY, {})), resume
