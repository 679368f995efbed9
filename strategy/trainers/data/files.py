"""Local JSON/JSONL/Parquet files into token ids: SFT (prompt -> response), preference pairs and
online-RL prompts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import datasets

from strategy.errors import DataError
from strategy.log import get_logger
from strategy.trainers.config import DataConfig
from strategy.trainers.data.chat import check_messages, tokenize_chat
from strategy.trainers.losses import IGNORE

__all__ = ["DataError", "load_pairs", "load_prompts", "load_sft", "read_rows"]

log = get_logger("data")


def read_rows(path: str, max_samples: int = -1) -> list[dict]:
    """Rows of a .json/.jsonl/.parquet file through ``datasets`` (no hub access)."""
    if not os.path.isfile(path):
        raise DataError(f"dataset={path!r}: no such file; pass a local .json, .jsonl or .parquet "
                        "file")
    ext = os.path.splitext(path)[1].lower()
    kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(ext)
    if kind is None:
        raise DataError(f"dataset={path!r}: unknown extension {ext!r}; use .json, .jsonl or "
                        ".parquet")
    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(kind, data_files=path, split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a malformed file
        raise DataError(f"dataset={path!r}: cannot be read as {kind} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]})") from None
    rows = rows.to_list()
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


def _text(row: dict, key: str, where: str) -> str:
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

    def __init__(self, tokenizer: Any, cfg: DataConfig) -> None:
        self.tok, self.cfg = tokenizer, cfg
        if tokenizer.eos_token_id is None:
            raise DataError("tokenizer has no eos_token; set one so responses can end")

    def prompt(self, text: str) -> str:
        if not self.cfg.apply_chat_template:
            return text
        return self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                            add_generation_prompt=True)

    def pair(self, prompt: str, response: str) -> tuple[list[int], list[int], int]:
        """(input_ids, labels, number of tokens cut) for one prompt/response."""
        prompt_ids = self.tok(self.prompt(prompt), add_special_tokens=False)["input_ids"]
        response_ids = self.tok(response, add_special_tokens=False)["input_ids"]
        response_ids = response_ids + [self.tok.eos_token_id]
        return self.cut(prompt_ids + response_ids, [IGNORE] * len(prompt_ids) + response_ids)

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


def _samples(path: str, cfg: DataConfig, stats: Stats, max_samples: int, make):
    """``make(row, where) -> [(ids, labels, cut), ...]`` for each row; a bad row raises, or is
    counted and skipped with ``skip_bad_rows``; the overlong policy then admits each part (a row
    is kept only if all its parts are)."""
    for i, row in enumerate(read_rows(path, max_samples)):
        where = f"{path} row {i}"
        try:
            parts = make(row, where)
        except DataError as e:
            if not cfg.skip_bad_rows:
                raise
            stats.skipped_bad.append(str(e))
            continue
        if all(_admit(stats, cut, labels, cfg, where) for _, labels, cut in parts):
            yield parts


def _finish(out: list[dict], stats: Stats, path: str) -> list[dict]:
    stats.kept = len(out)
    stats.report()
    if not out:
        raise DataError(f"dataset={path!r}: no usable rows after checks; see the counts above")
    return out


def load_sft(path: str, tokenizer: Any, cfg: DataConfig, max_samples: int = -1) -> list[dict]:
    """SFT samples ``{"input_ids", "labels"}`` from prompt/response rows or chat rows (a
    ``messages`` list); rows failing checks raise, or are counted and skipped."""
    stats, tok = Stats(path), Tokenize(tokenizer, cfg)

    def make(row: dict, where: str) -> list[tuple[list[int], list[int], int]]:
        if row.get(cfg.messages_key) is not None:
            messages = check_messages(row[cfg.messages_key], where)
            return [tok.cut(*tokenize_chat(tokenizer, messages, where))]
        prompt, response = (_text(row, key, where) for key in (cfg.input_key, cfg.output_key))
        return [tok.pair(prompt, response)]

    out = [{"input_ids": ids, "labels": labels}
           for (ids, labels, _), in _samples(path, cfg, stats, max_samples, make)]
    return _finish(out, stats, path)


def load_pairs(path: str, tokenizer: Any, cfg: DataConfig, max_samples: int = -1) -> list[dict]:
    """Preference samples ``{"chosen_ids", "chosen_labels", "rejected_ids",
    "rejected_labels"}``."""
    stats, tok = Stats(path), Tokenize(tokenizer, cfg)

    def make(row: dict, where: str) -> list[tuple[list[int], list[int], int]]:
        keys = (cfg.prompt_key, cfg.chosen_key, cfg.rejected_key)
        prompt, chosen, rejected = (_text(row, key, where) for key in keys)
        return [tok.pair(prompt, chosen), tok.pair(prompt, rejected)]

    out = [{"chosen_ids": c_ids, "chosen_labels": c_labels, "rejected_ids": r_ids,
            "rejected_labels": r_labels}
           for (c_ids, c_labels, _), (r_ids, r_labels, _) in _samples(path, cfg, stats,
                                                                      max_samples, make)]
    return _finish(out, stats, path)


def load_prompts(path: str, tokenizer: Any, cfg: DataConfig, max_prompt_len: int,
                 max_samples: int = -1) -> list[dict]:
    """Prompts for online RL ``{"prompt_ids", "prompt", "row"}`` (the row goes to the reward);
    a prompt over ``max_prompt_len`` tokens keeps its end under ``truncate``."""
    stats, tok = Stats(path), Tokenize(tokenizer, cfg)
    kept: list[dict] = []

    def make(row: dict, where: str) -> list[tuple[list[int], list[int], int]]:
        text = tok.prompt(_text(row, cfg.input_key, where))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = max(0, len(ids) - max_prompt_len)
        kept.append({"prompt_ids": ids[cut:], "prompt": text, "row": row})
        return [(ids[cut:], ids[cut:], cut)]

    out = [kept[-1] for _ in _samples(path, cfg, stats, max_samples, make)]
    return _finish(out, stats, path)
