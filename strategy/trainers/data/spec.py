"""What a trainer takes: a trainer class names its data with a ``data`` class attribute, and
the (train, held-out) loaders are built from it with explicit values (the strategy, tokenizer and
``DataConfig``). ``SFT`` samples, preference ``PAIRS``,
KTO's ``UNPAIRED`` completions and online-RL ``PROMPTS`` are the built-in kinds; a trainer of new
data declares a ``DataSpec`` of its own loader and collator.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from torch.utils.data import DataLoader

from strategy.errors import ConfigError, fail
from strategy.trainers.data import collate, files, packing, unpaired
from strategy.trainers.data.stream import TokenStream, open_stream

Loader = Callable[..., list]  # (path, tokenizer, DataConfig, max_samples) -> samples
Collator = Callable[[int], Callable]  # pad id -> collate_fn


@dataclass(frozen=True)
class DataSpec:
    """Samples a trainer trains on, ``micro_train_batch_size`` of them per micro-batch.

    Attributes:
        load: ``load(path, tokenizer, data_config, max_samples) -> samples``.
        collate: ``collate(pad_id) -> collate_fn`` of plain batches.
        pack: ``pack(samples, max_len) -> rows`` for ``--pack_dataset`` (None: no packing).
        collate_packed: ``collate_packed(pad_id) -> collate_fn`` of packed rows.
        collate_micro: ``collate_micro(pad_id) -> collate_fn`` packing a micro-batch of samples
            into one padding-free row (``--packing_samples``; None: no packing).
        parts: ``parts(tokenizer, cfg) -> make(row, where)`` for ``--streaming`` (None: the
            data cannot be streamed).
        assemble: one sample from ``make``'s parts (with ``parts``).
    """

    load: Loader
    collate: Collator
    pack: Callable[[list, int], list] | None = None
    collate_packed: Collator | None = None
    collate_micro: Collator | None = None
    parts: Callable | None = None
    assemble: Callable | None = None

    def samples(self, path: str, tokenizer: Any, cfg: Any, max_samples: int = -1,
                **source: Any) -> list:
        """The samples of ``path`` (packed rows when ``cfg.pack_dataset``).

        Args:
            path: what ``files.read_rows`` reads (files, folders, Hub ids, comma-separated).
            tokenizer: turns text into ids.
            cfg: the ``DataConfig``.
            max_samples: at most this many samples (-1: all).
            **source: ``split`` and ``probabilities`` for ``files.read_rows``.

        Returns:
            The samples, or packed rows of them.

        Raises:
            ConfigError: packing asked of data that cannot be packed.
        """
        rows = self.load(path, tokenizer, cfg, max_samples, **source)
        if not cfg.pack_dataset:
            return rows
        if self.pack is None:
            fail("pack_dataset", True, "this trainer's data cannot be packed; drop the flag")
        return self.pack(rows, cfg.max_len)

    def collate_fn(self, pad_id: int, cfg: Any) -> Callable:
        """The collate function: plain samples, the dataset's packed rows (``--pack_dataset``)
        or a micro-batch packed into one row (``--packing_samples``).

        Args:
            pad_id: the tokenizer's pad token id.
            cfg: the ``DataConfig``.

        Returns:
            The ``collate_fn`` for the loaders.

        Raises:
            ConfigError: ``--packing_samples`` for data that cannot be packed.
        """
        if cfg.packing_samples:
            if self.collate_micro is None:
                fail("packing_samples", True, "this trainer's data cannot be packed; drop the "
                     "flag")
            return self.collate_micro(pad_id)
        return (self.collate_packed if cfg.pack_dataset else self.collate)(pad_id)

    def loaders(self, strategy: Any, tokenizer: Any, cfg: Any) -> tuple[Any, Any]:
        """(train, held-out) loaders: shuffled, resumable training shards; held-out shards that
        count every sample once.

        Args:
            strategy: the started ``DeepSpeedStrategy`` (batch sizes, data-parallel shards).
            tokenizer: turns text into ids (its pad id pads batches).
            cfg: the ``DataConfig``.

        Returns:
            The training loader and the held-out loader (None without ``--eval_dataset``).

        Raises:
            ConfigError: fewer training samples than one optimizer step takes.
        """
        if cfg.streaming:
            train = self.stream(strategy, tokenizer, cfg)
        else:
            train = self.samples(cfg.dataset, tokenizer, cfg, cfg.max_samples,
                                 **train_source(cfg))
        collate_fn = self.collate_fn(tokenizer.pad_token_id, cfg)
        batch = strategy.config.train_batch_size
        if not cfg.streaming and len(train) < batch:
            raise ConfigError(f"train_batch_size={batch} is invalid: larger than the {len(train)} "
                              f"training samples in {cfg.dataset}; lower it or add data")
        micro = strategy.config.micro_train_batch_size
        if cfg.streaming:  # the stream deals, shuffles and resumes itself
            train_loader = DataLoader(train, batch_size=micro, collate_fn=collate_fn)
        else:
            train_loader = strategy.setup_dataloader(train, micro, shuffle=True,
                                                     collate_fn=collate_fn)
        if not cfg.eval_dataset:
            return train_loader, None
        held = self.samples(cfg.eval_dataset, tokenizer, cfg,  # rows as training sees them
                            split=cfg.eval_split)
        return train_loader, strategy.setup_eval_dataloader(
            held, strategy.config.micro_eval_batch_size, collate_fn=collate_fn)

    def stream(self, strategy: Any, tokenizer: Any, cfg: Any) -> TokenStream:
        """``--dataset`` streamed: this data-parallel rank's samples, tokenized as they come.

        Args:
            strategy: the started ``DeepSpeedStrategy`` (data-parallel rank and size, seed).
            tokenizer: turns text into ids.
            cfg: the ``DataConfig``.

        Returns:
            A ``TokenStream``.

        Raises:
            ConfigError: this trainer's data cannot be streamed.
        """
        if self.parts is None:
            fail("streaming", True, "this trainer's data cannot be streamed; drop the flag")
        rows = open_stream(cfg.dataset, cfg.dataset_split, cfg)
        return TokenStream(rows, self.parts(tokenizer, cfg), self.assemble, cfg, cfg.dataset,
                           strategy.data_parallel_rank, strategy.data_parallel_size,
                           strategy.config.seed)


def train_source(cfg: Any) -> dict:
    """Where the training rows come from: ``--dataset_split``, mixed by ``--dataset_probs``."""
    return {"split": cfg.dataset_split, "probabilities": cfg.probabilities()}


def prompts_per_rank(strategy_config: Any, world_size: int, group_size: int,
                     rollout_batch_size: int | None = None) -> int:
    """Prompts each rank samples per rollout: ``rollout_batch_size`` over the data-parallel
    ranks, or (None) its completions per optimizer step (micro batch x accumulation) in groups
    of ``group_size``.

    Raises:
        ConfigError: the completions per step do not divide into groups, or a rollout's into
            optimizer steps or ranks.
    """
    dp = strategy_config.data_parallel_size(world_size)
    per_step = (strategy_config.micro_train_batch_size
                * strategy_config.accumulation_steps(world_size))
    if rollout_batch_size is not None:
        samples = rollout_batch_size * group_size
        if rollout_batch_size % dp or samples % strategy_config.train_batch_size:
            fail("rollout_batch_size", rollout_batch_size,
                 f"its {samples} completions (x group_size={group_size}) must divide into "
                 f"optimizer steps of train_batch_size={strategy_config.train_batch_size}, and "
                 f"its prompts over {dp} data-parallel ranks")
        return rollout_batch_size // dp
    if per_step % group_size:
        fail("train_batch_size", strategy_config.train_batch_size,
             f"each rank's {per_step} completions per step (micro x accumulation) must divide "
             f"into groups of group_size={group_size}; use a multiple of {group_size * dp}")
    return per_step // group_size


@dataclass(frozen=True)
class PromptSpec:
    """Prompts for online RL: each rank's share of a rollout's prompts per batch (from the group
    size), left-padded; held-out prompts in order."""

    def loaders(self, strategy: Any, tokenizer: Any, cfg: Any, group_size: int,
                max_new_tokens: int, tools: list[dict] | None = None,
                rollout_batch_size: int | None = None) -> tuple[Any, Any]:
        """(train, held-out) prompt loaders.

        Args:
            strategy: the started ``DeepSpeedStrategy`` (batch sizes, data-parallel shards).
            tokenizer: turns text into ids.
            cfg: the ``DataConfig``.
            group_size: completions sampled per prompt.
            max_new_tokens: the longest completion (a prompt gets ``max_len`` less this).
            tools: tool schemas for the chat template (``--tools``), or None.
            rollout_batch_size: prompts per rollout on all ranks (None: one optimizer step's).

        Returns:
            The training loader and the held-out loader (None without ``--eval_dataset``).

        Raises:
            ConfigError: fewer prompts than one rollout takes.
        """
        per_rank = prompts_per_rank(strategy.config, strategy.world_size, group_size,
                                    rollout_batch_size)
        longest = cfg.max_len - max_new_tokens
        collate_fn = collate.collate_prompts(tokenizer.pad_token_id)
        train = files.load_prompts(cfg.dataset, tokenizer, cfg, longest, cfg.max_samples,
                                   tools=tools, **train_source(cfg))
        needed = per_rank * strategy.data_parallel_size
        if len(train) < needed:
            raise ConfigError(f"train_batch_size={strategy.config.train_batch_size} is invalid: "
                              f"a rollout needs {needed} prompts but {cfg.dataset} has "
                              f"{len(train)}; lower it or add data")
        train_loader = strategy.setup_dataloader(train, per_rank, shuffle=True,
                                                 collate_fn=collate_fn)
        if not cfg.eval_dataset:
            return train_loader, None
        held = files.load_prompts(cfg.eval_dataset, tokenizer, cfg, longest, tools=tools,
                                  split=cfg.eval_split)
        return train_loader, strategy.setup_eval_dataloader(
            held, strategy.config.micro_eval_batch_size, collate_fn=collate_fn)


SFT = DataSpec(files.load_sft, collate.collate_sft, packing.pack, packing.collate_packed,
               packing.collate_micro_batch, files.sft_parts, files.sft_sample)
PAIRS = DataSpec(files.load_pairs, collate.collate_pairs, packing.pack_pairs,
                 packing.collate_packed_pairs, partial(packing.collate_micro_batch, pairs=True),
                 files.pair_parts, files.pair_sample)
UNPAIRED = DataSpec(unpaired.load_kto, unpaired.collate_kto)  # KTO: no packing or streaming
PROMPTS = PromptSpec()
