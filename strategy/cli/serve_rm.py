"""A reward model served on OpenRLHF's reward-server protocol (its ``openrlhf.cli.serve_rm``,
serve_remote_rm.sh's flags): ``POST /get_reward {"query": [...], "prompts": [...], "labels":
[...]}`` answered by ``{"rewards": [...], "scores": [...], "extra_logs": {}}``, for
``--remote_rm_url http://HOST:PORT/get_reward`` (ours or OpenRLHF's trainers).

python -m strategy.cli.serve_rm --reward.model_name_or_path RM_DIR --port 5000 \
    --ds.param_dtype bf16 --data.max_len 8192 --batch_size 16 [--reward.normalize_enable]

Each query is scored as our reward models train and as ``--reward_pretrain`` scores in a run:
tokenized without added special tokens, its end kept when longer than ``--max_len`` (OpenRLHF
keeps the start), scored at its last token. ``--normalize_reward``: (score - mean) / std with
the ``mean`` and ``std`` the model's config.json holds (OpenRLHF's reward models save them).
The server listens on 127.0.0.1 unless ``--host`` says otherwise, one request scored at a time;
SIGTERM or Ctrl-C ends it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from strategy.config import parse_configs, print_settings_and_exit
from strategy.config.fields import check_positive, doc
from strategy.dist import first_line
from strategy.errors import ConfigError, fail
from strategy.model import saved_reward_scale

OPENRLHF = {  # serve_rm's OpenRLHF 0.11 flags (and its 0.10 names): ours
    "--reward.model_name_or_path": "--reward_pretrain", "--reward.normalize_enable":
    "--normalize_reward", "--ds.value_head_prefix": "--value_head_prefix", "--data.max_len":
    "--max_len", "--ds.param_dtype": "--param_dtype", "--ds.attn_implementation":
    "--attn_implementation", "--data.disable_fast_tokenizer": "--disable_fast_tokenizer",
}
PATH = "/get_reward"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ServeRMConfig:
    """serve_rm's settings. Validated on construction."""

    reward_pretrain: str = doc("the reward model's directory (AutoModelForSequenceClassification, "
                               "1 label, as strategy rm saves it)")
    normalize_reward: bool = doc("(score - mean) / std, with the mean and std the model's "
                                 "config.json holds (OpenRLHF's --reward.normalize_enable)", False)
    value_head_prefix: str = doc("the score head's name (only 'score', the sequence "
                                 "classifier's, here)", "score")
    max_len: int = doc("longest query in tokens; a longer one keeps its end", 2048)
    host: str = doc("address to listen on (0.0.0.0: every interface)", "127.0.0.1")
    port: int = doc("port to listen on", 5000)
    param_dtype: str = doc("the model's dtype: bf16, fp16 or fp32", "bf16")
    attn_implementation: str = doc("attention kernel: sdpa, eager or flash_attention_2 (where "
                                   "flash-attn is installed)", "sdpa")
    batch_size: int | None = doc("queries per forward (None: a request's all at once)", None)
    disable_fast_tokenizer: bool = doc("the slow (Python) tokenizer", False)

    def __post_init__(self) -> None:
        check_positive(self, "max_len", "port")
        if self.batch_size is not None:
            check_positive(self, "batch_size")
        if self.value_head_prefix != "score":
            fail("value_head_prefix", self.value_head_prefix, "a sequence classifier's head is "
                 "'score' here; drop the flag")
        if self.param_dtype not in DTYPES:
            fail("param_dtype", self.param_dtype, "use bf16, fp16 or fp32")


def translated(argv: list[str]) -> list[str]:
    """OpenRLHF's flag names as ours (``--name=value`` too)."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        out.append(OPENRLHF.get(name, name) + eq + value)
    return out


class Scorer:
    """The reward model and its tokenizer; ``__call__`` scores queries (one call at a time)."""

    def __init__(self, config: ServeRMConfig) -> None:
        hf_logging.disable_progress_bar()  # its start is one line
        self.config, self.lock = config, threading.Lock()
        saved = self._loaded(AutoConfig.from_pretrained)  # checked before the weights load
        self.mean, self.std = (saved_reward_scale(config.reward_pretrain, saved)
                               if config.normalize_reward else (0.0, 1.0))
        self.tokenizer = self._loaded(AutoTokenizer.from_pretrained,
                                      use_fast=not config.disable_fast_tokenizer)
        self.model = self._loaded(AutoModelForSequenceClassification.from_pretrained,
                                  num_labels=1, dtype=DTYPES[config.param_dtype],
                                  attn_implementation=config.attn_implementation).eval()

    def _loaded(self, load: Any, **kwargs: Any) -> Any:
        """``load(reward_pretrain, **kwargs)``; a path or Hub id that does not load is one line."""
        try:
            return load(self.config.reward_pretrain, **kwargs)
        except (OSError, ValueError) as exc:
            fail("reward_pretrain", self.config.reward_pretrain,
                 f"cannot load it ({first_line(exc)}); pass a reward model's directory")

    def ids(self, query: str) -> list[int]:
        return self.tokenizer(query, add_special_tokens=False)["input_ids"][-self.config.max_len:]

    @torch.no_grad()
    def __call__(self, queries: list[str]) -> list[float]:
        from strategy.trainers.algorithms.rewards import ids_scores  # deferred: the trainers'
        # import takes seconds, after the flags are checked

        size = self.config.batch_size or max(len(queries), 1)
        out: list[float] = []
        with self.lock:
            for start in range(0, len(queries), size):
                ids = [self.ids(q) for q in queries[start:start + size]]
                out += ids_scores(self.model, ids, self.tokenizer.pad_token_id)
        return [(score - self.mean) / self.std for score in out]


def handler(scorer: Scorer) -> type:
    """The request handler: POST /get_reward, JSON in and out; a bad request is a 400 naming
    what was wrong."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path != PATH:
                return self._answer(404, {"error": f"POST {PATH}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries = body["query"]
                if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                    raise ValueError("'query' must be a list of strings")
            except (ValueError, KeyError, TypeError) as exc:
                return self._answer(400, {"error": f"{type(exc).__name__}: {exc}"})
            rewards = scorer(queries) if queries else []
            self._answer(200, {"rewards": rewards, "scores": rewards, "extra_logs": {}})

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - its signature
            pass  # one line per request would drown the start line

    return Handler


def _stop(signum: int, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C; a bad flag or model is one line, exit 2."""
    argv = translated(list(sys.argv[1:] if argv is None else argv))
    try:
        (config,), namespace = parse_configs([ServeRMConfig], argv)
        if namespace.print_config:
            print_settings_and_exit([config], namespace)
        scorer = Scorer(config)
        server = ThreadingHTTPServer((config.host, config.port), handler(scorer))
    except (ConfigError, OSError) as error:
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(2) from None
    signal.signal(signal.SIGTERM, _stop)
    print(f"serving {config.reward_pretrain} on http://{config.host}:"
          f"{server.server_address[1]}{PATH}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
