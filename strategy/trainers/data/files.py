"""Local JSON/JSONL/Parquet files into token ids: SFT (prompt -> response), preference pairs and
online-RL prompts."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

import datasets

from strategy.errors import DataError
from strategy.log import get_logger
from strategy.trainers.config import DataConfig
from strategy.trainers.data.chat import (
    as_messages,
    check_messages,
    split_conversations,
    tokenize_chat,
    tokenize_chat_response,
)
from strategy.trainers.losses import IGNORE

__all__ = ["DataError", "load_pairs", "load_prompts", "load_sft", "read_rows"]

log = get_logger("data")


FILE_KINDS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv",
              ".arrow": "arrow"}


def _one_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def _split_of(data: Any, path: str, split: str) -> datasets.Dataset:
    """``split`` of a DatasetDict (a Dataset is its own one split)."""
    if not isinstance(data, datasets.DatasetDict):
        return data
    if split not in data:
        raise DataError(f"dataset={path!r}: no split {split!r}; it has {sorted(data)} (set "
                        "--dataset_split / --eval_split)")
    return data[split]


def hub_name(source: str) -> bool:
    """Whether ``source`` reads as a Hub dataset id (``name`` or ``org/name``) rather than a local
    path (``./x``, ``/x``, ``x.jsonl``, ``a/b/c``, a pattern)."""
    return not (source.startswith((".", "/", "~")) or os.path.splitext(source)[1]
                or source.count("/") > 1 or glob.has_magic(source))


def source_exists(source: str) -> bool:
    """A local file, folder or glob with matches, or a name only the Hub can resolve (checked
    when it loads)."""
    return os.path.exists(source) or bool(glob.glob(source)) or hub_name(source)


def load_table(path: str, split: str = "train", streaming: bool = False) -> Any:
    """One dataset through ``datasets``: a data file or a glob of them (one split), a folder
    written by ``save_to_disk``, a local folder laid out as a Hub dataset repository, or a Hub id
    (the offline switches apply).

    Args:
        path: the file, glob, folder or Hub id.
        split: the split to take from folders and Hub ids.
        streaming: read rows lazily (an ``IterableDataset``) instead of all at once.

    Returns:
        The rows as a ``datasets.Dataset`` (``IterableDataset`` when streaming).

    Raises:
        DataError: nothing there, an unknown file kind or split, or rows that cannot be read.
    """
    datasets.disable_progress_bars()
    files = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    if not files or not source_exists(path):
        raise DataError(f"dataset={path!r}: no such file, folder or matching pattern; pass a "
                        "local data file, folder or glob, or a Hub dataset id")
    if os.path.isfile(files[0]):
        ext = os.path.splitext(files[0])[1].lower()
        if ext not in FILE_KINDS:
            raise DataError(f"dataset={path!r}: unknown extension {ext!r}; use "
                            f"{', '.join(sorted(FILE_KINDS))}, a folder or a Hub id")
        return _load(path, f"as {FILE_KINDS[ext]}", datasets.load_dataset, FILE_KINDS[ext],
                     data_files=files, split="train", streaming=streaming)
    if any(os.path.isfile(os.path.join(path, name)) for name in SAVED_MARKERS):
        table = _split_of(_load(path, "from disk", datasets.load_from_disk, path), path, split)
        return table.to_iterable_dataset(num_shards=1) if streaming else table
    where = "as a dataset folder" if os.path.isdir(path) else "from the Hub"
    if streaming:
        return _load(path, where, datasets.load_dataset, path, split=split, streaming=True)
    return _split_of(_load(path, where, datasets.load_dataset, path), path, split)


SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes


def _load(path: str, how: str, load, *args: Any, **kwargs: Any) -> Any:
    try:
        return load(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets raises many types for unreadable data
        raise DataError(f"dataset={path!r}: cannot be read {how} ({_one_line(e)}); check "
                        "its files") from None


def mix_tables(path: str, tables: list, probabilities: list[float] | None = None,
               seed: int = 42) -> Any:
    """Several datasets as one: concatenated, or mixed by ``probabilities`` with a seeded draw
    until every one is used up (as OpenRLHF mixes); streamed ones stay streamed.

    Args:
        path: the comma-separated sources, for messages.
        tables: the datasets, all ``Dataset`` or all ``IterableDataset``.
        probabilities: one weight per dataset (None: concatenate).
        seed: the mixing draw's seed.

    Returns:
        The mixed dataset.

    Raises:
        DataError: datasets whose columns differ.
    """
    if len(tables) == 1:
        return tables[0]
    try:
        if probabilities is None:
            return datasets.concatenate_datasets(tables)
        return datasets.interleave_datasets(tables, probabilities, seed=seed,
                                            stopping_strategy="all_exhausted")
    except ValueError as e:  # columns that differ between the datasets
        raise DataError(f"dataset={path!r}: the datasets cannot be mixed ({_one_line(e)}); "
                        "give them the same columns") from None


def read_rows(path: str, max_samples: int = -1, split: str = "train",
              probabilities: list[float] | None = None, seed: int = 42) -> list[dict]:
    """Rows of one dataset or of several comma-separated ones (``mix_tables``).

    Args:
        path: one ``load_table`` source, or several separated by commas.
        max_samples: at most this many rows (-1: all), taken after mixing.
        split: the split of folders and Hub ids.
        probabilities: one weight per dataset (None: concatenate).
        seed: the mixing draw's seed.

    Returns:
        The rows as dicts.

    Raises:
        DataError: from ``load_table`` or ``mix_tables``.
    """
    tables = [load_table(part.strip(), split) for part in path.split(",")]
    rows = mix_tables(path, tables, probabilities, seed).to_list()
    return rows if max_samples < 0 else rows[:max_samples]


@dataclass
class Stats:
    """What happened to the rows of one file, reported once on rank 0."""

    path: str
    kept: int = 0
    truncated: int = 0
    dropped_long: int = 0
    skipped_bad: list[str] = field(default_factory=list)

    def report(self) -> None:
        log.info("%s: kept %d, truncated %d, dropped over max_len %d, skipped bad rows %d",
                 self.path, self.kept, self.truncated, self.dropped_long, len(self.skipped_bad))


def text_field(row: dict, key: str, where: str) -> str:
    if row.get(key) is None:
        present = sorted(k for k, v in row.items() if v is not None)
        raise DataError(f"{where}: missing key {key!r} (has {present}); "
                        f"set the right --{{input,output,prompt,chosen,rejected,messages}}_key")
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: {key!r} is empty or not text; fix the row or pass "
                        "--skip_bad_rows")
    return value


class Tokenize:
    """Turns (prompt, response) text into ids with labels on the response only."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, tools: list[dict] | None = None) -> None:
        self.tok, self.cfg, self.tools = tokenizer, cfg, tools
        if tokenizer.eos_token_id is None:
            raise DataError("tokenizer has no eos_token; set one so responses can end")

    def prompt(self, text: str) -> str:
        """The prompt as the model sees it: in ``--input_template`` (OpenRLHF's ``{}`` form; a
        written ``\\n`` is a newline) or the chat template's user turn (with the ``tools``'
        schemas when given), or as it is."""
        if self.cfg.input_template:
            return self.cfg.input_template.replace("\\n", "\n").format(text)
        if not self.cfg.apply_chat_template:
            return text
        return self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                            add_generation_prompt=True, tools=self.tools)

    def pair(self, prompt: str, response: str) -> tuple[list[int], list[int], int]:
        """(input_ids, labels, number of tokens cut) for one prompt/response."""
        prompt_ids = self.tok(self.prompt(prompt), add_special_tokens=False)["input_ids"]
        response_ids = self.tok(response, add_special_tokens=False)["input_ids"]
        response_ids = response_ids + [self.tok.eos_token_id]
        return self.cut(prompt_ids + response_ids, [IGNORE] * len(prompt_ids) + response_ids)

    def response(self, prompt: Any, response: Any, where: str) -> tuple[list[int], list[int], int]:
        """Like ``pair`` for TRL's rows: text, or turn lists rendered with the chat template
        (only the response's assistant turns scored)."""
        if isinstance(prompt, str) and isinstance(response, str):
            return self.pair(prompt, response)
        turns = (as_messages(prompt, "user", where), as_messages(response, "assistant", where))
        return self.cut(*tokenize_chat_response(self.tok, *turns, where))

    def cut(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int], int]:
        """Ids and labels cut to ``max_len``, and how many tokens were cut."""
        cut = max(0, len(ids) - self.cfg.max_len)
        return ids[: self.cfg.max_len], labels[: self.cfg.max_len], cut


def _admit(stats: Stats, cut: int, labels: list[int], cfg: DataConfig, where: str) -> bool:
    """Apply the overlong policy; a sample whose response was cut away entirely is always
    dropped."""
    if cut and cfg.overlong == "error":
        raise DataError(f"{where}: {cut} tokens over max_len={cfg.max_len}; raise --max_len or set "
                        "--overlong")
    if cut and (cfg.overlong == "drop" or all(v == IGNORE for v in labels)):
        stats.dropped_long += 1
        return False
    stats.truncated += bool(cut)
    return True


def admitted_parts(rows, name: str, split: str, cfg: DataConfig, stats: Stats, make):
    """``make(row, where) -> [(ids, labels, cut), ...]`` for each row; a bad row raises, or is
    counted and skipped with ``skip_bad_rows``; the overlong policy then admits each part (a row
    is kept only if all its parts are)."""
    for i, row in enumerate(rows):
        where = f"{name} [{split}] row {i}"
        try:
            parts = make(row, where)
        except DataError as e:
            if not cfg.skip_bad_rows:
                raise
            stats.skipped_bad.append(str(e))
            continue
        if all(_admit(stats, cut, labels, cfg, where) for _, labels, cut in parts):
            yield parts


def finished(out: list[dict], stats: Stats, path: str) -> list[dict]:
    stats.kept = len(out)
    stats.report()
    if not out:
        raise DataError(f"dataset={path!r}: no usable rows after checks; see the counts above")
    return out


def sft_parts(tokenizer: Any, cfg: DataConfig):
    """``make(row, where)`` of SFT rows: prompt/response, TRL's prompt/completion, or chats."""
    tok = Tokenize(tokenizer, cfg)

    def make(row: dict, where: str) -> list[tuple[list[int], list[int], int]]:
        if row.get(cfg.messages_key) is not None:
            messages = check_messages(row[cfg.messages_key], where)
            return [tok.cut(*tokenize_chat(tokenizer, messages, where))]
        if cfg.input_key not in row and "prompt" in row and "completion" in row:  # TRL's layout
            return [tok.response(row["prompt"], row["completion"], where)]
        keys = (cfg.input_key, cfg.output_key)
        prompt, response = (text_field(row, key, where) for key in keys)
        return [tok.pair(prompt, response)]
    return make


def pair_parts(tokenizer: Any, cfg: DataConfig):
    """``make(row, where)`` of preference rows: text, or TRL's conversations."""
    tok = Tokenize(tokenizer, cfg)

    def make(row: dict, where: str) -> list[tuple[list[int], list[int], int]]:
        chosen, rejected = row.get(cfg.chosen_key), row.get(cfg.rejected_key)
        if isinstance(chosen, list) and isinstance(rejected, list):  # conversations
            prompt = row.get(cfg.prompt_key)
            if prompt is None:  # the prompt is the turns both share
                prompt, chosen, rejected = split_conversations(chosen, rejected)
            return [tok.response(prompt, chosen, where), tok.response(prompt, rejected, where)]
        keys = (cfg.prompt_key, cfg.chosen_key, cfg.rejected_key)
        prompt, chosen, rejected = (text_field(row, key, where) for key in keys)
        return [tok.pair(prompt, chosen), tok.pair(prompt, rejected)]
    return make


def sft_sample(parts: list) -> dict:
    ((ids, labels, _),) = parts
    return {"input_ids": ids, "labels": labels}


def pair_sample(parts: list) -> dict:
    (c_ids, c_labels, _), (r_ids, r_labels, _) = parts
    return {"chosen_ids": c_ids, "chosen_labels": c_labels, "rejected_ids": r_ids,
            "rejected_labels": r_labels}


def _load_samples(path: str, make, assemble, cfg: DataConfig, max_samples: int,
                  source: dict) -> list[dict]:
    stats, split = Stats(path), source.get("split", "train")
    rows = read_rows(path, max_samples, **source)
    samples = [assemble(p) for p in admitted_parts(rows, path, split, cfg, stats, make)]
    return finished(samples, stats, path)


def load_sft(path: str, tokenizer: Any, cfg: DataConfig, max_samples: int = -1,
             **source: Any) -> list[dict]:
    """SFT samples ``{"input_ids", "labels"}`` from prompt/response rows or chat rows (a
    ``messages`` list); rows failing checks raise, or are counted and skipped."""
    return _load_samples(path, sft_parts(tokenizer, cfg), sft_sample, cfg, max_samples, source)


def load_pairs(path: str, tokenizer: Any, cfg: DataConfig, max_samples: int = -1,
               **source: Any) -> list[dict]:
    """Preference samples ``{"chosen_ids", "chosen_labels", "rejected_ids",
    "rejected_labels"}``."""
    return _load_samples(path, pair_parts(tokenizer, cfg), pair_sample, cfg, max_samples, source)


def load_prompts(path: str, tokenizer: Any, cfg: DataConfig, max_prompt_len: int,
                 max_samples: int = -1, tools: list[dict] | None = None,
                 **source: Any) -> list[dict]:
    """Prompts for online RL ``{"prompt_ids", "prompt", "row"}`` (the row goes to the reward);
    a prompt over ``max_prompt_len`` tokens keeps its end under ``truncate``; ``tools``' schemas
    go into the chat template."""
    stats, tok = Stats(path), Tokenize(tokenizer, cfg, tools)
    kept: list[dict] = []

    def make(row: dict, where: str) -> list[tuple[list[int], list[int], int]]:
        text = tok.prompt(text_field(row, cfg.input_key, where))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = max(0, len(ids) - max_prompt_len)
        kept.append({"prompt_ids": ids[cut:], "prompt": text, "row": row})
        return [(ids[cut:], ids[cut:], cut)]

    rows = read_rows(path, max_samples, **source)
    split = source.get("split", "train")
    out = [kept[-1] for _ in admitted_parts(rows, path, split, cfg, stats, make)]
    return finished(out, stats, path)
