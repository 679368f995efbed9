"""What a trainer takes: a trainer class names its data with a ``data`` class attribute, and
``Run`` builds the (train, held-out) loaders from it. ``SFT`` samples, preference ``PAIRS``,
KTO's ``UNPAIRED`` completions and online-RL ``PROMPTS`` are the built-in kinds; a trainer of new
data declares a ``DataSpec`` of its own loader and collator.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        pack: ``pack(samples, max_len) -> rows`` for ``--packing_samples`` (None: no packing).
        collate_packed: ``collate_packed(pad_id) -> collate_fn`` of packed rows.
        parts: ``parts(tokenizer, cfg) -> make(row, where)`` for ``--streaming`` (None: the
            data cannot be streamed).
        assemble: one sample from ``make``'s parts (with ``parts``).
    """

    load: Loader
    collate: Collator
    pack: Callable[[list, int], list] | None = None
    collate_packed: Collator | None = None
    parts: Callable | None = None
    assemble: Callable | None = None

    def samples(self, path: str, tokenizer: Any, cfg: Any, max_samples: int = -1,
                **source: Any) -> list:
        """The samples of ``path`` (packed rows when ``cfg.packing_samples``).

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
        if not cfg.packing_samples:
            return rows
        if self.pack is None:
            fail("packing_samples", True, "this trainer's data cannot be packed; drop the flag")
        return self.pack(rows, cfg.max_len)

    def collate_fn(self, pad_id: int, packed: bool) -> Callable:
        """The collate function for plain or packed rows.

        Args:
            pad_id: the tokenizer's pad token id.
            packed: whether the rows are packed (``collate_packed``) or plain (``collate``).

        Returns:
            The ``collate_fn`` for the loaders.
        """
        return (self.collate_packed if packed else self.collate)(pad_id)

    def loaders(self, run: Any) -> tuple[Any, Any]:
        """(train, held-out) loaders for ``run`` (a ``Run``): shuffled, resumable training shards;
        held-out shards that count every sample once.

        Args:
            run: the ``Run`` holding the strategy, tokenizer and data config.

        Returns:
            The training loader and the held-out loader (None without ``--eval_dataset``).

        Raises:
            ConfigError: fewer training samples than one optimizer step takes.
        """
        cfg, strategy = run.data, run.strategy
        if cfg.streaming:
            train = self.stream(run)
        else:
            train = self.samples(cfg.dataset, run.tokenizer, cfg, cfg.max_samples,
                                 **train_source(cfg))
        collate_fn = self.collate_fn(run.tokenizer.pad_token_id, cfg.packing_samples)
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
        held = self.samples(cfg.eval_dataset, run.tokenizer, cfg,  # rows as training sees them
                            split=cfg.eval_split)
        return train_loader, strategy.setup_eval_dataloader(
            held, strategy.config.micro_eval_batch_size, collate_fn=collate_fn)


    def stream(self, run: Any) -> TokenStream:
        """``--dataset`` streamed: this data-parallel rank's samples, tokenized as they come.

        Args:
            run: the ``Run`` (strategy, tokenizer, data config).

        Returns:
            A ``TokenStream``.

        Raises:
            ConfigError: this trainer's data cannot be streamed.
        """
        if self.parts is None:
            fail("streaming", True, "this trainer's data cannot be streamed; drop the flag")
        cfg, strategy = run.data, run.strategy
        rows = open_stream(cfg.dataset, cfg.dataset_split, cfg)
        return TokenStream(rows, self.parts(run.tokenizer, cfg), self.assemble, cfg, cfg.dataset,
                           strategy.data_parallel_rank, strategy.data_parallel_size,
                           strategy.config.seed)


def train_source(cfg: Any) -> dict:
    """Where the training rows come from: ``--dataset_split``, mixed by ``--dataset_probs``."""
    return {"split": cfg.dataset_split, "probabilities": cfg.probabilities()}


def prompts_per_rank(strategy_config: Any, world_size: int, group_size: int) -> int:
    """Prompts each rank samples per rollout: its completions per optimizer step (micro batch x
    accumulation) in groups of ``group_size``.

    Raises:
        ConfigError: the completions per step do not divide into groups.
    """
    per_rank = (strategy_config.micro_train_batch_size
                * strategy_config.accumulation_steps(world_size))
    if per_rank % group_size:
        dp = strategy_config.data_parallel_size(world_size)
        fail("train_batch_size", strategy_config.train_batch_size,
             f"each rank's {per_rank} completions per step (micro x accumulation) must divide "
             f"into groups of group_size={group_size}; use a multiple of {group_size * dp}")
    return per_rank // group_size


@dataclass(frozen=True)
class PromptSpec:
    """Prompts for online RL: each rank's share of a rollout's prompts per batch (from
    ``run.grpo``'s group size), left-padded; held-out prompts in order."""

    def loaders(self, run: Any) -> tuple[Any, Any]:
        """(train, held-out) prompt loaders for ``run``.

        Args:
            run: the ``Run``; its ``grpo`` config sets the group size and completion length.

        Returns:
            The training loader and the held-out loader (None without ``--eval_dataset``).

        Raises:
            ConfigError: fewer prompts than one rollout takes.
        """
        cfg, strategy, grpo = run.data, run.strategy, run.grpo
        per_rank = prompts_per_rank(strategy.config, strategy.world_size, grpo.group_size)
        longest = cfg.max_len - grpo.max_new_tokens
        collate_fn = collate.collate_prompts(run.tokenizer.pad_token_id)
        train = files.load_prompts(cfg.dataset, run.tokenizer, cfg, longest, cfg.max_samples,
                                   **train_source(cfg))
        needed = per_rank * strategy.data_parallel_size
        if len(train) < needed:
            raise ConfigError(f"train_batch_size={strategy.config.train_batch_size} is invalid: "
                              f"a rollout needs {needed} prompts but {cfg.dataset} has "
                              f"{len(train)}; lower it or add data")
        train_loader = strategy.setup_dataloader(train, per_rank, shuffle=True,
                                                 collate_fn=collate_fn)
        if not cfg.eval_dataset:
            return train_loader, None
        held = files.load_prompts(cfg.eval_dataset, run.tokenizer, cfg, longest,
                                  split=cfg.eval_split)
        return train_loader, strategy.setup_eval_dataloader(
            held, strategy.config.micro_eval_batch_size, collate_fn=collate_fn)


SFT = DataSpec(files.load_sft, collate.collate_sft, packing.pack, packing.collate_packed,
               files.sft_parts, files.sft_sample)
PAIRS = DataSpec(files.load_pairs, collate.collate_pairs, packing.pack_pairs,
                 packing.collate_packed_pairs, files.pair_parts, files.pair_sample)
UNPAIRED = DataSpec(unpaired.load_kto, unpaired.collate_kto)  # KTO: no packing or streaming
PROMPTS = PromptSpec()
