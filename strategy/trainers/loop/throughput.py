"""Throughput, memory and MFU for the logs: tokens and samples per second over all ranks, step
time, peak memory (accelerator max allocated, or process peak RSS on CPU), and model FLOPs
utilization when the model's FLOPs per token and the accelerator's peak are known."""

from __future__ import annotations

import resource
import time
from typing import Iterable, Iterator

import torch
from deepspeed.accelerator import get_accelerator

from strategy.internals import full_numel

# dense bf16 peak TFLOPS per device, by accelerator name (fp32 runs need --peak_tflops)
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def known_peak_tflops() -> float | None:
    """The accelerator's dense bf16 peak, when its name is in the table (never on CPU)."""
    if get_accelerator().device_name() != "cuda":
        return None
    name = torch.cuda.get_device_name()  # DeepSpeed's accelerator API has no device model name
    return next((peak for key, peak in KNOWN_PEAK_TFLOPS.items() if key in name), None)


def peak_memory_bytes() -> int:
    """This process's peak: accelerator max allocated, or peak RSS on CPU."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return int(accelerator.max_memory_allocated())


def flops_per_token(model, seq_len: float) -> float:
    """Training FLOPs per token: 6 x parameters (forward + backward) plus attention scores,
    12 x layers x hidden x sequence length (PaLM's estimate)."""
    module = getattr(model, "module", model)
    params = sum(full_numel(p) for p in module.parameters())
    config = getattr(module, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return 6.0 * params + 12.0 * layers * hidden * seq_len


class StepMeter:
    """Counts each step's tokens and samples and times it; reports over the logging window."""

    def __init__(self, model, strategy, peak_tflops: float | None = None) -> None:
        self.model, self.strategy = model, strategy
        self.peak_tflops = peak_tflops or known_peak_tflops()
        self.tokens = self.samples = 0  # this step, this rank
        self.window = {"tokens": 0.0, "samples": 0.0, "seconds": 0.0, "steps": 0}
        self._start = time.perf_counter()
        self._fetched_at: float | None = None

    def start(self) -> None:
        """A step begins: timed from when ``timed`` asked for its data, else from now."""
        self._start = self._fetched_at or time.perf_counter()
        self._fetched_at = None
        self.tokens = self.samples = 0

    def timed(self, steps: Iterable) -> Iterator:
        """``steps`` as they come, the time each takes to produce (loading its data, an on-policy
        rollout) counted in that step's time: a rollout is part of the step, not outside it."""
        it = iter(steps)
        while True:
            self._fetched_at = time.perf_counter()
            try:
                step = next(it)
            except StopIteration:
                self._fetched_at = None
                return
            yield step

    def count(self, batch: dict) -> None:
        """Tokens (non-padding where a mask says so) and samples of one micro-batch."""
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if "token_count" in batch:  # packed rows say how many of their tokens are real
            self.tokens += int(batch["token_count"])
        elif mask is not None and mask.dim() == ids.dim():
            self.tokens += int(mask.sum())
        else:
            self.tokens += ids.numel()
        self.samples += int(ids.shape[0])

    def local(self) -> dict:
        return {"tokens": self.tokens, "samples": self.samples}

    def finish(self, totals: dict) -> None:
        """The step's totals over all ranks (reduced with its metrics); closes its timing."""
        replicas = self.strategy.world_size / self.strategy.data_parallel_size
        self.window["tokens"] += totals.get("tokens", 0.0) / replicas
        self.window["samples"] += totals.get("samples", 0.0) / replicas
        self.window["seconds"] += time.perf_counter() - self._start
        self.window["steps"] += 1

    def report(self) -> dict:
        """Figures over the steps since the last report (collective: peak memory is the max over
        ranks)."""
        window, seconds = self.window, max(self.window["seconds"], 1e-9)
        out = {"tokens_per_s": window["tokens"] / seconds,
               "samples_per_s": window["samples"] / seconds,
               "step_time": seconds / max(window["steps"], 1),
               "peak_mem_gb": self.strategy.all_reduce(peak_memory_bytes(), op="max") / 1e9}
        if self.peak_tflops:
            seq_len = window["tokens"] / max(window["samples"], 1)
            achieved = out["tokens_per_s"] * flops_per_token(self.model, seq_len)
            out["mfu"] = achieved / (self.peak_tflops * 1e12 * self.strategy.world_size)
        self.window = {"tokens": 0.0, "samples": 0.0, "seconds": 0.0, "steps": 0}
        return out

    @staticmethod
    def postfix(metrics: dict) -> dict:
        """What the progress bar shows."""
        shown = {"loss": f"{metrics['loss']:.4f}", "lr": f"{metrics['lr']:.2e}",
                 "tok/s": f"{metrics['tokens_per_s']:.0f}",
                 "mem": f"{metrics['peak_mem_gb']:.2f}GB"}
        if "mfu" in metrics:
            shown["mfu"] = f"{metrics['mfu']:.1%}"
        return shown
