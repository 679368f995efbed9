"""Loading resume checkpoints: every rank loads the checkpoint rank 0 picked, through
``weights_only`` loads; a checkpoint from another world size goes through DeepSpeed's universal
format (converted once, on rank 0)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from strategy import dist
from strategy.checkpoint.layout import META, UNIVERSAL, RunLayout, read_meta
from strategy.checkpoint.progress import ResumeState, progress, sampler_of
from strategy.checkpoint.rng_state import restore_rng
from strategy.checkpoint.safe_load import verify_torch_files, weights_only_loads
from strategy.checkpoint.save import CLIENT_KEY
from strategy.checkpoint.tags import node_view, resolve_common_tag, resolve_tag
from strategy.errors import CheckpointFileError, fail
from strategy.internals import convert_to_universal, universal_checkpoint_loading
from strategy.log import get_logger
from strategy.quant import is_four_bit

log = get_logger("checkpoint")


def ensure_universal(ckpt_dir: str) -> str:
    """Rank 0: convert ``ckpt_dir`` with DeepSpeed's ``ds_to_universal`` once; returns its dir."""
    out = os.path.join(ckpt_dir, UNIVERSAL)
    if os.path.isfile(os.path.join(out, META)):
        return out
    tmp = f"{out}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    convert_to_universal(ckpt_dir, tmp)
    shutil.copy2(os.path.join(ckpt_dir, META), os.path.join(tmp, META))  # marks it complete
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    leftover = os.path.join(ckpt_dir, "latest_universal")
    if os.path.isfile(leftover):
        os.unlink(leftover)
    return out


def _load_universal(engine: Any, ckpt_dir: str, meta: dict, **kw: Any) -> tuple[Any, dict]:
    dist.on_rank_0(ensure_universal, ckpt_dir)
    with universal_checkpoint_loading(engine):
        path, state = engine.load_checkpoint(ckpt_dir, UNIVERSAL, **kw)
    # DeepSpeed's ZeRO-3 universal load copies group 0's hyperparameters to every group
    groups = getattr(engine.optimizer, "param_groups", None) or []
    for group, saved in zip(groups, meta.get("param_groups") or [], strict=False):
        group.update({key: tuple(value) if isinstance(value, list) else value
                      for key, value in saved.items() if key != "lr"})
    return path, state


class LoadedCheckpoint(tuple):
    """What a resume loaded: unpacks as ``(path, client_state)``, DeepSpeed's and OpenRLHF's pair,
    and carries where the run stands (``resume``), so nothing is left on the strategy.

    Args:
        path: the checkpoint directory loaded, or None when there was nothing to resume.
        client_state: the ``client_state`` it was saved with (``{}`` when nothing was loaded).
        resume: step, consumed samples, epoch and position in it; None when nothing was loaded.

    Attributes:
        resume: the ``ResumeState``, or None.
    """

    def __new__(cls, path: str | None, client_state: dict,
                resume: ResumeState | None) -> LoadedCheckpoint:
        out = super().__new__(cls, (path, client_state))
        out.resume = resume
        return out

    @property
    def path(self) -> str | None:
        """The checkpoint directory loaded, or None."""
        return self[0]

    @property
    def client_state(self) -> dict:
        """The ``client_state`` saved with it."""
        return self[1]

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.client_state, self.resume)

    def __repr__(self) -> str:
        return (f"LoadedCheckpoint(path={self.path!r}, client_state={self.client_state!r}, "
                f"resume={self.resume!r})")


def check_layout(meta: dict, layout: RunLayout, ckpt_dir: str) -> None:
    """A checkpoint resumes at the sequence- and tensor-parallel sizes it was saved at."""
    mismatch = layout.mismatch(meta)
    if mismatch is not None:
        name, saved, now = mismatch
        fail(name, now, f"{ckpt_dir} was saved at {name}={saved}; resume with the same size")


def check_resumable(load_dir: str, layout: RunLayout) -> None:
    """Before any process group starts: the checkpoint a resume would pick was saved at the same
    sequence- and tensor-parallel sizes (this rank's view of ``load_dir``).

    Args:
        load_dir: the checkpoint directory (nothing to check when it holds no checkpoint).
        layout: the run's ``RunLayout``.

    Raises:
        ConfigError: the checkpoint was saved at another sequence- or tensor-parallel size.
    """
    tag = resolve_tag(load_dir, None) if os.path.isdir(load_dir) else None
    if tag is not None:
        check_layout(read_meta(os.path.join(load_dir, tag)), layout, os.path.join(load_dir, tag))


def pick_tag(load_dir: str, tag: str | None, node_local: bool = False) -> str | None:
    """Collective: the tag every rank loads: rank 0's pick, or on node-local storage the newest
    checkpoint complete on every node."""
    if not node_local:
        return dist.on_rank_0(resolve_tag, load_dir, tag)
    views = dist.on_node_writers(node_view, load_dir)
    chosen = resolve_common_tag(views, load_dir, tag)
    newest = [done[-1] if done else None for _, done in views]
    if any(name != chosen for name in newest):
        log.info("newest complete per node: %s; every rank resumes from %s, the newest complete "
                 "on all of them", newest, chosen)
    return chosen


def load_checkpoint(engine: Any, load_dir: str, tag: str | None = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    dataloader: Any = None, universal: bool | None = None,
                    layout: RunLayout | None = None, node_local: bool = False,
                    load_module_strict: bool = True) -> LoadedCheckpoint:
    """Load on every rank (collective).

    Args:
        engine: the DeepSpeed engine to load into.
        load_dir: the directory holding the checkpoints.
        tag: the checkpoint to load (default: the one ``latest`` names, else the newest complete).
        load_optimizer_states: also load the optimizer states.
        load_lr_scheduler_states: also load the LR scheduler's state.
        dataloader: the run's loader, whose sampler is moved to the resumed position (optional).
        universal: force (True) or forbid (False) the universal conversion; by default it is
            used when the world size changed and ZeRO is on.
        layout: the run's ``RunLayout`` (default ``RunLayout()``); its sequence- and
            tensor-parallel sizes must match the saved ones.
        node_local: each node reads its own copy of ``load_dir``.
        load_module_strict: the saved weights must name exactly the model's (DeepSpeed's
            ``load_module_strict``; a 4-bit model always loads non-strictly).

    Returns:
        A ``LoadedCheckpoint``: ``(checkpoint directory, client_state)`` with the
        ``ResumeState`` as ``.resume``; ``(None, {})`` with ``resume`` None when ``load_dir``
        holds no checkpoint to resume.

    Raises:
        ConfigError: ``tag`` is invalid or not complete, or the layout differs from the saved one.
        CheckpointFileError: a universal load on node-local storage, missing or truncated
            ``.pt`` files, or DeepSpeed could not load the tag.
    """
    layout = layout or RunLayout()
    tag = pick_tag(load_dir, tag, node_local)
    if tag is None:
        return LoadedCheckpoint(None, {}, None)
    ckpt_dir = os.path.join(load_dir, tag)
    meta = read_meta(ckpt_dir)
    check_layout(meta, layout, ckpt_dir)
    kw = {"load_optimizer_states": load_optimizer_states,
          "load_lr_scheduler_states": load_lr_scheduler_states,
          "load_module_strict": load_module_strict}
    if is_four_bit(engine.module):  # bitsandbytes' quantisation state rides along in the saved
        kw["load_module_strict"] = False  # module state, which a loaded 4-bit model cannot take
    if universal is None:
        universal = meta["world_size"] != dist.get_world_size() and meta["zero_stage"] > 0
    if universal and node_local:
        raise CheckpointFileError(f"{ckpt_dir}: resuming at another world size converts every "
                                  "rank's files, which node-local storage spreads over the nodes; "
                                  "copy each node's files into one shared directory and load that")
    verify_torch_files(ckpt_dir)
    with weights_only_loads():
        if universal:
            path, state = _load_universal(engine, ckpt_dir, meta, **kw)
        else:
            path, state = engine.load_checkpoint(load_dir, tag, **kw)
    if path is None:
        raise CheckpointFileError(f"load_dir={load_dir!r}: DeepSpeed could not load tag {tag!r}; "
                                  f"check {ckpt_dir}")
    position = progress(engine, dataloader, layout.samples_per_step)  # in this run's loader
    if dataloader is not None:
        sampler_of(dataloader).load_state_dict({"epoch": position["epoch"],
                                                "consumed": position["epoch_consumed"]})
    if not restore_rng(ckpt_dir, dist.get_rank()):
        log.warning("%s has no RNG state for this rank (saved at %s ranks); its RNG streams "
                    "continue from the seed", ckpt_dir, meta["world_size"])
    resume = ResumeState(tag, position["global_step"], position["consumed_samples"],
                         position["epoch"], position["epoch_consumed"])
    return LoadedCheckpoint(ckpt_dir, dict((state or {}).get(CLIENT_KEY, {})), resume)
