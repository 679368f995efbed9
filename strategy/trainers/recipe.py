"""The former name of ``strategy.trainers.run`` (kept so existing scripts import ``Run`` from
it); new code imports ``from strategy.trainers import Run``."""

from strategy.trainers.run import Run, check_model, check_paths, hf_config, load_tokenizer

__all__ = ["Run", "check_model", "check_paths", "hf_config", "load_tokenizer"]
