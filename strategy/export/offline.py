"""DeepSpeed checkpoint -> Hugging Face directory, in one process without the training ranks.

``python -m strategy.export CKPT_DIR OUT_DIR [--tag T] [--max_shard_size S] [--dtype D]
[--merge_lora] [--config_dir DIR]``

The model's ``config.json`` (and ``adapter_config.json`` for a LoRA run, tokenizer files when
present) are looked up in the tag directory, then ``CKPT_DIR``, or ``--config_dir``. The model is
built on the meta device (no weights), the files ``save_model`` would write are planned from its
shapes, and each tensor is read from the checkpoint (``zero_reader``: ``weights_only`` loads of
mapped files), written to its shard and let go before the next: memory holds about one tensor, not
the model. Same layout as ``save_model``: tied weights once, a LoRA adapter alone unless
``--merge_lora``, written atomically.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import transformers
from torch import nn

from strategy.atomic_fs import atomic_directory
from strategy.checkpoint.tags import resolve_tag
from strategy.dtypes import resolve_dtype
from strategy.errors import ConfigError, StrategyError
from strategy.export.memory import trim_heap
from strategy.export.metadata import write_export_metadata
from strategy.export.shards import ShardWriter
from strategy.export.units import ExportPlan, plan_export
from strategy.export.zero_reader import TensorInfo, ZeroCheckpoint
from strategy.log import get_logger
from strategy.model import unique_state_tensors

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

log = get_logger("export")


def find_tag(ckpt_dir: Path, tag: str | None) -> str:
    """The complete checkpoint to export (``resolve_tag``'s rules), or a one-line error."""
    found = resolve_tag(str(ckpt_dir), tag)
    if found is None:
        raise ConfigError(f"ckpt_dir={str(ckpt_dir)!r} is invalid: it holds no complete "
                          "checkpoint; pass the directory save_ckpt wrote (or --tag with one "
                          "inside it)")
    return found


def find_metadata_dir(ckpt_dir: Path, tag: str, config_dir: Path | None) -> Path:
    candidates = [config_dir] if config_dir else [ckpt_dir / tag, ckpt_dir]
    for directory in candidates:
        if (directory / "config.json").is_file():
            return directory
    shown = str(config_dir) if config_dir else None
    raise ConfigError(f"config_dir={shown!r} is invalid: no config.json in "
                      f"{', '.join(map(str, candidates))}; pass --config_dir with the model's "
                      "config.json (and adapter_config.json for a LoRA run)")


def build_skeleton(meta_dir: Path) -> nn.Module:
    """The architecture named in ``config.json`` (wrapped by peft when ``adapter_config.json`` is
    there), fp32, on the meta device: shapes and names only, no memory for weights."""
    config = transformers.AutoConfig.from_pretrained(str(meta_dir))
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        if cls is not None:
            model = cls(config).float()
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if (meta_dir / "adapter_config.json").is_file():
            from peft import PeftConfig, get_peft_model  # adapters only (peft loads bnb, ~1 s)

            model = get_peft_model(model, PeftConfig.from_pretrained(str(meta_dir)))
    return model


def check_matches(model: nn.Module, index: dict[str, TensorInfo]) -> None:
    """Every tensor of the model is in the checkpoint with its shape (tied copies may be absent:
    they share their first name's data), and the checkpoint holds nothing else."""
    expected = model.state_dict(keep_vars=True)
    tied = set(expected) - {name for name, _ in unique_state_tensors(model)}
    missing = [name for name in expected if name not in index and name not in tied]
    unexpected = [name for name in index if name not in expected]
    misshapen = [f"{name} {index[name].shape} vs {tuple(tensor.shape)}"
                 for name, tensor in expected.items()
                 if name in index and index[name].shape != tuple(tensor.shape)]
    if missing or unexpected or misshapen:
        raise ConfigError(f"config_dir is invalid: the checkpoint does not match config.json "
                          f"(missing {missing[:5]}, unexpected {unexpected[:5]}, shapes "
                          f"{misshapen[:3]}); pass --config_dir with the training model's config")


def checkpoint_names(model: nn.Module, index: dict[str, TensorInfo]) -> dict[int, str]:
    """id(tensor) -> a name the checkpoint holds it under (a tied tensor has several)."""
    names: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in index:
            names.setdefault(id(tensor), name)
    return names


@contextmanager
def filled(tensors: list[torch.Tensor], checkpoint: ZeroCheckpoint,
           names: dict[int, str]) -> Iterator[None]:
    """Within the block each meta tensor holds its checkpoint values: swapped in place
    (``torch.utils.swap_tensors``), so a unit's ``produce`` reads them through the module as
    ``save_model`` reads gathered parameters; swapped back (values freed) afterwards."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for tensor in {id(t): t for t in tensors}.values():
            value = checkpoint.read(names[id(tensor)])
            if isinstance(tensor, nn.Parameter):
                value = nn.Parameter(value, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, value)
            swapped.append((tensor, value))
        yield
    finally:
        for tensor, value in reversed(swapped):
            torch.utils.swap_tensors(tensor, value)


def write_weights(directory: Path, plan: ExportPlan, checkpoint: ZeroCheckpoint,
                  names: dict[int, str]) -> None:
    """Every planned tensor, unit by unit, in plan order; each unit's memory is handed back before
    the next is read."""
    writer = ShardWriter(directory, plan.shards, plan.prefix)
    for unit in plan.units:
        with filled(unit.sources, checkpoint, names):
            unit.write(writer)
        trim_heap()
    writer.close()


def load_tokenizer(meta_dir: Path):
    if any((meta_dir / name).is_file() for name in _TOKENIZER_FILES):
        return transformers.AutoTokenizer.from_pretrained(str(meta_dir))
    return None


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                      max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None,
                      merge_lora: bool = False, config_dir: str | Path | None = None) -> Path:
    """Write ``out_dir`` from a DeepSpeed checkpoint; weights are fp32 unless ``dtype`` says
    otherwise.

    Args:
        ckpt_dir: the checkpoint directory (``save_ckpt``'s ``save_dir``).
        out_dir: the HF directory to create; replaced atomically if it exists.
        tag: the checkpoint to export; None takes the one ``latest`` names.
        max_shard_size: bytes per safetensors shard, or a size such as ``"5GB"``.
        dtype: dtype of the written weights; None keeps the master weights' fp32.
        merge_lora: fold LoRA adapters into the base weights instead of writing the adapter.
        config_dir: where ``config.json`` is; None looks in the tag's folder, then ``ckpt_dir``.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ConfigError: no complete checkpoint, no ``config.json``, or a checkpoint that does not
            match it.
        CheckpointFileError: a checkpoint file is damaged or of a kind this export cannot read.
    """
    ckpt_dir = Path(ckpt_dir)
    tag = find_tag(ckpt_dir, tag)
    meta_dir = find_metadata_dir(ckpt_dir, tag, Path(config_dir) if config_dir else None)
    dtype = resolve_dtype(dtype)
    with ZeroCheckpoint(ckpt_dir / tag) as checkpoint:
        model = build_skeleton(meta_dir)
        check_matches(model, checkpoint.index)
        plan = plan_export(model, dtype, max_shard_size, merge_lora)
        tokenizer = load_tokenizer(meta_dir)
        with atomic_directory(out_dir) as tmp:
            write_weights(tmp, plan, checkpoint, checkpoint_names(model, checkpoint.index))
            write_export_metadata(model, tokenizer, tmp, plan.adapter_only,
                                  dtype or plan.shards.main_dtype())
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m strategy.export",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("ckpt_dir", help="directory that save_ckpt / engine.save_checkpoint wrote")
    parser.add_argument("out_dir", help="HF directory to create (replaced atomically if it exists)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the newest complete)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 500MB, 5GB")
    parser.add_argument("--dtype", default=None, help="fp32 (default), bf16 or fp16")
    parser.add_argument("--merge_lora", action="store_true",
                        help="LoRA run: write the merged model, not the adapter")
    parser.add_argument("--config_dir", default=None,
                        help="where config.json (+ adapter_config.json) live, if not in the "
                             "checkpoint")
    args = parser.parse_args(argv)
    try:
        tag = find_tag(Path(args.ckpt_dir), args.tag)
        out = export_checkpoint(args.ckpt_dir, args.out_dir, tag, args.max_shard_size, args.dtype,
                                args.merge_lora, args.config_dir)
    except StrategyError as exc:  # one line naming the file or the flag, no traceback
        sys.exit(f"{parser.prog}: error: {exc}")
    log.info("exported %s (tag %s) to %s", args.ckpt_dir, tag, out)
