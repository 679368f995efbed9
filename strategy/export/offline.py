"""DeepSpeed checkpoint -> Hugging Face directory, in one process without the training ranks.

``python -m strategy.export CKPT_DIR OUT_DIR [--tag T] [--max_shard_size S] [--dtype D]
[--merge_lora] [--config_dir DIR]``

The model's ``config.json`` (and ``adapter_config.json`` for a LoRA run, tokenizer files when
present) are looked up in the tag directory, then ``CKPT_DIR``, or ``--config_dir``. The result
is written by ``save_model``: same layout, tied weights once, atomic.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from peft import PeftConfig, get_peft_model
from torch import nn

from strategy.checkpoint.safe_load import weights_only_loads
from strategy.checkpoint.tags import resolve_tag
from strategy.dtypes import resolve_dtype
from strategy.errors import ConfigError
from strategy.export.save import save_model
from strategy.model import unique_state_tensors

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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
    raise ConfigError(f"config_dir={str(config_dir)!r} is invalid: no config.json in "
                      f"{', '.join(map(str, candidates))}; pass --config_dir with the model's "
                      "config.json (and adapter_config.json for a LoRA run)")


def load_fp32_state_dict(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """All weights (frozen ones included) as one fp32 state dict."""
    with weights_only_loads():
        if any((ckpt_dir / tag).glob("*optim_states.pt")):
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        states = ckpt_dir / tag / "mp_rank_00_model_states.pt"
        if not states.is_file():
            raise ConfigError(f"tag={tag!r} is invalid: {states} not found; CKPT_DIR/--tag must "
                              "name a DeepSpeed checkpoint")
        module = torch.load(states, map_location="cpu", weights_only=True)["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}


def build_model(meta_dir: Path) -> nn.Module:
    """The architecture named in ``config.json`` (wrapped by peft when ``adapter_config.json`` is
    there), fp32."""
    config = transformers.AutoConfig.from_pretrained(str(meta_dir))
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is not None:
        model = cls(config).float()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if (meta_dir / "adapter_config.json").is_file():
        model = get_peft_model(model, PeftConfig.from_pretrained(str(meta_dir)))
    return model


def load_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Strict except for tied copies the model shares anyway."""
    result = model.load_state_dict(state, strict=False)
    names = set(model.state_dict(keep_vars=True))
    tied = names - {name for name, _ in unique_state_tensors(model)}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ConfigError(f"config_dir is invalid: the checkpoint does not match config.json "
                          f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}); pass "
                          "--config_dir with the training model's config")


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                      max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None,
                      merge_lora: bool = False, config_dir: str | Path | None = None) -> Path:
    """Write ``out_dir`` from a DeepSpeed checkpoint; weights are fp32 unless ``dtype`` says
    otherwise."""
    ckpt_dir = Path(ckpt_dir)
    tag = find_tag(ckpt_dir, tag)
    meta_dir = find_metadata_dir(ckpt_dir, tag, Path(config_dir) if config_dir else None)
    model = build_model(meta_dir)
    load_weights(model, load_fp32_state_dict(ckpt_dir, tag))
    tokenizer = None
    if any((meta_dir / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(meta_dir))
    return save_model(model, tokenizer, out_dir, max_shard_size=max_shard_size,
                      dtype=resolve_dtype(dtype), merge_lora=merge_lora)


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
    tag = find_tag(Path(args.ckpt_dir), args.tag)
    out = export_checkpoint(args.ckpt_dir, args.out_dir, tag, args.max_shard_size, args.dtype,
                            args.merge_lora, args.config_dir)
    print(f"exported {args.ckpt_dir} (tag {tag}) to {out}", flush=True)
