"""A LoRA adapter merged into its base model and saved whole, OpenRLHF's
``python -m openrlhf.cli.lora_combiner`` with its flags (examples/scripts/combine_lora.sh):

python -m strategy.cli.lora_combiner --model_path BASE --lora_path ADAPTER \
    --output_path MERGED [--is_rm] [--bf16]
strategy lora-combiner --model_path BASE --lora_path ADAPTER --output_path MERGED

``ADAPTER`` is what a LoRA run saves (``--lora_rank``: ``adapter_config.json`` and
``adapter_model.safetensors`` in ``--save_path``); ``--is_rm`` merges a reward model's (the
sequence classifier's, its ``score`` head saved with the adapter). One process, no ranks: the
base loads on CPU in its checkpoint's dtype (``--bf16``: bfloat16), peft merges the adapter
(``merge_and_unload``), and the whole model is saved with safetensors beside the base's
tokenizer (the adapter folder's where the base has none). A path that will not do is one line,
exit 2, before the base loads.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from strategy.config import parse_configs, print_settings_and_exit
from strategy.config.fields import doc
from strategy.dist import first_line
from strategy.errors import ConfigError, fail


@dataclass(frozen=True)
class LoraCombinerConfig:
    """lora_combiner's settings (OpenRLHF's names). Validated on construction."""

    model_path: str = doc("the base model's directory (or Hub name) the adapter was trained on")
    lora_path: str = doc("the LoRA adapter's directory (adapter_config.json)")
    output_path: str = doc("where the merged model is saved")
    is_rm: bool = doc("a reward model (AutoModelForSequenceClassification) instead of a causal "
                      "LM", False)
    bf16: bool = doc("load and save in bfloat16 (default: the base checkpoint's dtype)", False)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.lora_path, "adapter_config.json")):
            fail("lora_path", self.lora_path, "no adapter_config.json there; give the folder a "
                 "LoRA run saved (its --save_path)")
        if os.path.abspath(self.output_path) in (os.path.abspath(self.model_path),
                                                 os.path.abspath(self.lora_path)):
            fail("output_path", self.output_path, "it would overwrite an input; choose a new "
                 "folder")


def combine(config: LoraCombinerConfig) -> None:
    """Load the base, apply and merge the adapter, save the whole model and a tokenizer.

    Args:
        config: the checked settings.

    Raises:
        ConfigError: the base or the adapter does not load (one line naming which).
    """
    import torch  # deferred: --help and bad paths answer without torch's import
    from peft import PeftModel  # as above
    from transformers import (  # as above
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    dtype = torch.bfloat16 if config.bf16 else "auto"
    auto = AutoModelForSequenceClassification if config.is_rm else AutoModelForCausalLM
    try:
        base = auto.from_pretrained(config.model_path, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model_path={config.model_path!r} is invalid: cannot load it "
                          f"({first_line(exc)}); pass the base model's directory") from None
    try:
        merged = PeftModel.from_pretrained(base, config.lora_path).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()]  # torch's: a heading,
        reason = " ".join(lines[:2]) if lines and lines[0].endswith(":") else first_line(exc)
        raise ConfigError(f"lora_path={config.lora_path!r} is invalid: it does not fit "  # then
                          f"{config.model_path!r} ({reason}); give the adapter trained "  # why
                          "on that base (--is_rm for a reward model's)") from None
    merged.save_pretrained(config.output_path)
    for source in (config.model_path, config.lora_path):
        try:
            AutoTokenizer.from_pretrained(source).save_pretrained(config.output_path)
            break
        except (OSError, ValueError):  # no tokenizer in the base: the adapter folder's
            continue


def main(argv: list[str] | None = None) -> None:
    """Merge and save; a bad flag or path is one line, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        (config,), namespace = parse_configs([LoraCombinerConfig], argv)
        if namespace.print_config:
            print_settings_and_exit([config], namespace)
        combine(config)
    except ConfigError as error:
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(2) from None
    print(f"saved the merged model to {config.output_path}")


if __name__ == "__main__":
    main()
