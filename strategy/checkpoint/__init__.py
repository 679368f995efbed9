"""Resume checkpoints: crash-safe save (staged, published whole, ``latest`` replaced atomically),
load through ``weights_only`` loads (universal format across world sizes), the exact position in
the data, every RNG, tags, retention by count/size/best metric, and their ``CheckpointConfig``.

May import: ``strategy.errors``, ``strategy.internals``, ``strategy.log``, ``strategy.dist``,
``strategy.atomic_fs``, ``strategy.config.fields``. Knows nothing of Hugging Face: the facade
passes in what writes a model's ``config.json`` beside the weights.
"""

from strategy.checkpoint.config import CheckpointConfig, Retention
from strategy.checkpoint.layout import RunLayout
from strategy.checkpoint.load import LoadedCheckpoint, check_resumable, load_checkpoint
from strategy.checkpoint.progress import ResumeState, progress
from strategy.checkpoint.save import save_checkpoint
from strategy.checkpoint.storage import CheckpointStorage, deepspeed_section, find_storage
from strategy.checkpoint.tags import resolve_tag, validate_tag

__all__ = ["CheckpointConfig", "CheckpointStorage", "LoadedCheckpoint", "ResumeState", "Retention",
           "RunLayout", "check_resumable", "deepspeed_section", "find_storage", "load_checkpoint",
           "progress", "resolve_tag", "save_checkpoint", "validate_tag"]
