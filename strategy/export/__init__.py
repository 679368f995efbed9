"""Hugging Face export: ``save_model`` streams sharded safetensors from any ZeRO stage (full
model, PEFT adapter, or merged), and ``python -m strategy.export`` turns a DeepSpeed checkpoint
into the same directory offline, reading its files tensor by tensor (``zero_reader``: mapped
``weights_only`` loads, DeepSpeed's file layout) into the same shard plan and writer.

May import: ``strategy.errors``, ``strategy.internals``, ``strategy.log``, ``strategy.dist``,
``strategy.atomic_fs``, ``strategy.dtypes``, ``strategy.model``, ``strategy.parallel`` (which
parameters AutoTP split), ``strategy.checkpoint`` (tags and safe loading, for the offline export).
Nothing here trains or holds optimizer state.
"""

from strategy.export.metadata import save_model_metadata
from strategy.export.offline import export_checkpoint
from strategy.export.save import save_model

__all__ = ["export_checkpoint", "save_model", "save_model_metadata"]
