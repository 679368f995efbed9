"""The data pipeline: files to rows (``files``), chats through the tokenizer's template
(``chat``), padding-free packing (``packing``), KTO's unpaired rows (``unpaired``), collation,
and what each trainer takes (``spec``: a ``DataSpec`` a trainer class declares, from which ``Run``
builds its loaders).

May import: ``strategy`` below ``trainers``, ``trainers.config`` and ``trainers.losses``.
"""

from strategy.trainers.data.collate import collate_pairs, collate_prompts, collate_sft
from strategy.trainers.data.files import (
    DataError,
    load_pairs,
    load_prompts,
    load_sft,
    read_rows,
)
from strategy.trainers.data.spec import (
    PAIRS,
    PROMPTS,
    SFT,
    UNPAIRED,
    DataSpec,
    PromptSpec,
)

__all__ = ["PAIRS", "PROMPTS", "SFT", "UNPAIRED", "DataError", "DataSpec", "PromptSpec",
           "collate_pairs", "collate_prompts", "collate_sft", "load_pairs", "load_prompts",
           "load_sft", "read_rows"]
