"""DeepSpeed checkpoint -> Hugging Face directory, in one process without the training ranks.

``python -m strategy.export CKPT_DIR OUT_DIR [--tag T] [--max_shard_size S] [--dtype D] [--merge_lora]``

The weights come from DeepSpeed's own fp32 consolidation (``zero_to_fp32``) for ZeRO 1-3, or the
module state for ZeRO-0. The model's ``config.json`` (and ``adapter_config.json`` for a LoRA run,
tokenizer files when present) are looked up in the tag directory, then ``CKPT_DIR``, or
``--config_dir``. The result is written by ``save_model``: same layout, tied weights once, atomic.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from strategy.export import resolve_dtype, save_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_tag(ckpt_dir: Path, tag: str | None) -> str:
    """``tag`` or the one named in ``CKPT_DIR/latest``; the result must be a directory inside ``CKPT_DIR``."""
    if tag is None:
        latest = ckpt_dir / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"{latest} not found: pass --tag with a checkpoint directory inside {ckpt_dir}")
        tag = latest.read_text().strip()
    path = (ckpt_dir / tag).resolve()
    if path.parent != ckpt_dir.resolve() or not path.is_dir():
        raise FileNotFoundError(f"--tag {tag!r} is not a checkpoint directory inside {ckpt_dir}: pass an existing tag")
    return tag


def find_metadata_dir(ckpt_dir: Path, tag: str, config_dir: Path | None) -> Path:
    candidates = [config_dir] if config_dir else [ckpt_dir / tag, ckpt_dir]
    for d in candidates:
        if (d / "config.json").is_file():
            return d
    raise FileNotFoundError(f"no config.json in {', '.join(map(str, candidates))}: pass --config_dir with the "
                            f"model's config.json (and adapter_config.json for a LoRA run)")


def load_fp32_state_dict(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """All weights (frozen ones included) as one fp32 state dict."""
    if any((ckpt_dir / tag).glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    states = ckpt_dir / tag / "mp_rank_00_model_states.pt"
    if not states.is_file():
        raise FileNotFoundError(f"{states} not found: CKPT_DIR/--tag must name a DeepSpeed checkpoint")
    module = torch.load(states, map_location="cpu", weights_only=True)["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}


def build_model(meta_dir: Path) -> nn.Module:
    """The architecture named in ``config.json`` (wrapped by peft when ``adapter_config.json`` is there), fp32."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(meta_dir))
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    model = cls._from_config(config, dtype=torch.float32) if cls else \
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if (meta_dir / "adapter_config.json").is_file():
        from peft import PeftConfig, get_peft_model

        model = get_peft_model(model, PeftConfig.from_pretrained(str(meta_dir)))
    return model


def load_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Strict except for tied copies the model shares anyway."""
    result = model.load_state_dict(state, strict=False)
    tied = {n for n, t in model.state_dict(keep_vars=True).items()} - {n for n, _ in _unique(model)}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint does not match config.json: missing {missing[:5]}, unexpected "
                         f"{result.unexpected_keys[:5]}: pass --config_dir with the training model's config")


def _unique(model: nn.Module):
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                      max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None,
                      merge_lora: bool = False, config_dir: str | Path | None = None) -> Path:
    """Write ``out_dir`` from a DeepSpeed checkpoint; weights are fp32 unless ``dtype`` says otherwise."""
    ckpt_dir = Path(ckpt_dir)
    tag = resolve_tag(ckpt_dir, tag)
    meta_dir = find_metadata_dir(ckpt_dir, tag, Path(config_dir) if config_dir else None)
    model = build_model(meta_dir)
    load_weights(model, load_fp32_state_dict(ckpt_dir, tag))
    tokenizer = None
    if any((meta_dir / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(meta_dir))
    return save_model(model, tokenizer, out_dir, max_shard_size=max_shard_size, dtype=resolve_dtype(dtype),
                      merge_lora=merge_lora)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m strategy.export", description=__doc__.splitlines()[0])
    p.add_argument("ckpt_dir", help="directory that save_ckpt / engine.save_checkpoint wrote")
    p.add_argument("out_dir", help="HF directory to create (replaced atomically if it exists)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CKPT_DIR/latest)")
    p.add_argument("--max_shard_size", default="5GB", help="largest safetensors shard, e.g. 500MB, 5GB")
    p.add_argument("--dtype", default=None, help="fp32 (default), bf16 or fp16")
    p.add_argument("--merge_lora", action="store_true", help="LoRA run: write the merged model, not the adapter")
    p.add_argument("--config_dir", default=None, help="where config.json (+ adapter_config.json) live, "
                                                      "if not in the checkpoint")
    a = p.parse_args(argv)
    out = export_checkpoint(a.ckpt_dir, a.out_dir, a.tag, a.max_shard_size, a.dtype, a.merge_lora, a.config_dir)
    print(f"exported {a.ckpt_dir} (tag {resolve_tag(Path(a.ckpt_dir), a.tag)}) to {out}", flush=True)
