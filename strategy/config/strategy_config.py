"""``StrategyConfig``: ranks, ZeRO, offload, precision, parallelism and batch sizes."""

from __future__ import annotations

from dataclasses import dataclass

from strategy.config.ds_keys import check_overrides
from strategy.config.fields import check_positive, doc
from strategy.errors import fail

GRAD_ACCUM_DTYPES = (None, "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class StrategyConfig:
    """Everything about ranks, ZeRO, offload and precision. Validated on construction; checks that
    need the number of ranks run in ``validate_world`` (from ``setup_distributed``)."""

    seed: int = doc("seed for Python, NumPy and torch on every rank", 42)
    zero_stage: int = doc("ZeRO stage: 0 (DDP), 1 (optimizer), 2 (+gradients), 3 (+parameters)", 2)
    bf16: bool = doc("train in bfloat16 with fp32 master weights", False)
    fp16: bool = doc("train in float16 with dynamic loss scaling", False)
    adam_offload: bool = doc("keep optimizer states on CPU, step with DeepSpeedCPUAdam (ZeRO >= 1)",
                             False)
    offload_ratio: float = doc("share of optimizer states ZeRO-3 offloads "
                               "(offload_optimizer.ratio)", 1.0)
    param_offload: bool = doc("keep parameters on CPU between uses (ZeRO-3 only)", False)
    ref_offload: bool = doc("keep frozen eval engines (DPO/GRPO reference, reward model) off the "
                            "accelerator between uses: ZeRO-3 with parameters offloaded to CPU, "
                            "whatever the training stage", False,
                            trainers=("dpo", "kto", "grpo", "ppo"))
    ds_enable_sleep: bool = doc("between policy updates, keep the trained engines' Adam states, "
                                "fp32 master weights and gradients in CPU memory, back for each "
                                "update's backward: the device's memory free for the rollout "
                                "(OpenRLHF's --ds.enable_sleep; ZeRO 1-3; with --adam_offload "
                                "they live on CPU already)", False, trainers=("grpo", "ppo"))
    micro_train_batch_size: int = doc("samples per rank per forward/backward", 8)
    train_batch_size: int = doc("global samples per optimizer step (micro x accumulation x "
                                "data-parallel ranks)", 128)
    micro_eval_batch_size: int = doc("samples per rank per eval forward", 8)
    max_norm: float = doc("gradient clipping norm; 0 disables clipping", 1.0)
    gradient_checkpointing: bool = doc("recompute activations in backward to save memory", False)
    zpg: int = doc("ZeRO++ hierarchical partition size (hpZ); 1 disables", 1)
    grad_accum_dtype: str | None = doc("dtype gradients accumulate in: fp32, bf16 or fp16 "
                                       "(default: DeepSpeed's)", None)
    overlap_comm: bool = doc("overlap gradient reduction with backward", False)
    timeout_minutes: float = doc("a collective waiting longer than this fails "
                                 "(a hung or lost rank)", 30.0)
    sequence_parallel_size: int = doc("ranks that split each sequence (DeepSpeed Ulysses); 1 off",
                                      1)
    tensor_parallel_size: int = doc("ranks that split each weight (DeepSpeed AutoTP, ZeRO 0-2); "
                                    "1 off", 1)
    ds_config_overrides: dict = doc("dict deep-merged last into the DeepSpeed config", {})
    param_dtype: str | None = doc("OpenRLHF's precision flag: bf16, fp16 or fp32 (sets --bf16 / "
                                  "--fp16; default: those flags, fp32 when neither)", None)
    ds_tensor_parallel_size: int = doc("OpenRLHF's name for --tensor_parallel_size", 1)
    ring_attn_size: int = doc("OpenRLHF's ring attention: not supported (refused above 1); "
                              "--sequence_parallel_size splits sequences with Ulysses", 1)

    def __post_init__(self) -> None:
        self._take_openrlhf_names()
        self._check_precision_and_sizes()
        self._check_offload()
        self._check_parallel()
        if self.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            fail("grad_accum_dtype", self.grad_accum_dtype, "use fp32, bf16 or fp16")
        if not isinstance(self.ds_config_overrides, dict):
            fail("ds_config_overrides", self.ds_config_overrides,
                 "use a mapping, e.g. {steps_per_print: 10}")
        check_overrides(self.ds_config_overrides)

    def _take_openrlhf_names(self) -> None:
        """OpenRLHF's spellings, folded into ours (the dataclass is frozen, hence setattr)."""
        if self.ring_attn_size != 1:
            fail("ring_attn_size", self.ring_attn_size, "ring attention is not supported; split "
                 "sequences with DeepSpeed Ulysses: --sequence_parallel_size N")
        if self.ds_tensor_parallel_size != 1:
            if self.tensor_parallel_size not in (1, self.ds_tensor_parallel_size):
                fail("ds_tensor_parallel_size", self.ds_tensor_parallel_size, "it names "
                     "--tensor_parallel_size, which is set otherwise; pass one of them")
            object.__setattr__(self, "tensor_parallel_size", self.ds_tensor_parallel_size)
        if self.param_dtype is None:
            return
        if self.param_dtype not in ("bf16", "fp16", "fp32"):
            fail("param_dtype", self.param_dtype, "use bf16, fp16 or fp32")
        wanted = {"bf16": self.param_dtype == "bf16", "fp16": self.param_dtype == "fp16"}
        for name, value in wanted.items():
            if getattr(self, name) and not value:
                fail("param_dtype", self.param_dtype, f"--{name} says otherwise; pass one of them")
            object.__setattr__(self, name, value)

    def _check_parallel(self) -> None:
        check_positive(self, "sequence_parallel_size", "tensor_parallel_size")
        if self.sequence_parallel_size > 1 and self.tensor_parallel_size > 1:
            fail("tensor_parallel_size", self.tensor_parallel_size, "tensor and sequence "
                 "parallelism together are not supported (DeepSpeed drops Ulysses' groups under "
                 "AutoTP); use one of them")
        if self.tensor_parallel_size > 1 and self.zero_stage == 3:
            fail("tensor_parallel_size", self.tensor_parallel_size, "AutoTP trains with ZeRO 0-2 "
                 "here; set --zero_stage 1 or 2, or tensor_parallel_size 1")

    def _check_precision_and_sizes(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            fail("zero_stage", self.zero_stage, "use 0, 1, 2 or 3")
        if self.bf16 and self.fp16:
            fail("fp16", self.fp16, "bf16 and fp16 are exclusive; set only one of --bf16/--fp16")
        check_positive(self, "micro_train_batch_size", "train_batch_size", "micro_eval_batch_size",
                       "zpg")
        if self.train_batch_size % self.micro_train_batch_size:
            fail("train_batch_size", self.train_batch_size,
                 f"must be a multiple of micro_train_batch_size={self.micro_train_batch_size}")
        if self.timeout_minutes <= 0:
            fail("timeout_minutes", self.timeout_minutes,
                 "use a positive number of minutes, e.g. 30")
        if self.max_norm < 0:
            fail("max_norm", self.max_norm, "use 0 (no clipping) or a positive norm")

    def _check_offload(self) -> None:
        if self.adam_offload and self.zero_stage == 0:
            fail("adam_offload", True, "optimizer offload needs ZeRO; set --zero_stage 1, 2 or 3")
        if not 0 < self.offload_ratio <= 1:
            fail("offload_ratio", self.offload_ratio,
                 "use a fraction in (0, 1]; 1.0 offloads every optimizer state")
        if self.offload_ratio < 1 and (self.zero_stage != 3 or not self.adam_offload):
            fail("offload_ratio", self.offload_ratio, "partial offload runs only with ZeRO-3 and "
                 "optimizer offload; set --zero_stage 3 --adam_offload, or offload_ratio 1.0")
        if self.ds_enable_sleep and (self.zero_stage == 0 or self.param_offload):
            fail("ds_enable_sleep", True, "DeepSpeed moves a ZeRO optimizer's states, with the "
                 "parameters on the device: set --zero_stage 1, 2 or 3 without --param_offload")
        if self.param_offload and self.zero_stage != 3:
            fail("param_offload", True,
                 f"parameter offload needs ZeRO-3, got zero_stage={self.zero_stage}")

    # ------------------------------------------------------------ rank arithmetic
    @property
    def partitions_parameters(self) -> bool:
        """Whether the trained weights are partitioned across ranks (ZeRO-3): every forward call
        gathers them, and a rank's module alone cannot generate without its peers."""
        return self.zero_stage == 3

    @property
    def model_parallel_size(self) -> int:
        """Ranks that share one batch: a sequence- or tensor-parallel group."""
        return self.sequence_parallel_size * self.tensor_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that see different data: the world over the model-parallel group size.

        Args:
            world_size: the number of ranks.

        Returns:
            The number of data-parallel ranks.
        """
        return world_size // self.model_parallel_size

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank of a global rank; model-parallel groups are contiguous ranks
        (DeepSpeed's Ulysses and AutoTP layouts).

        Args:
            rank: the global rank.

        Returns:
            The index of its model-parallel group.
        """
        return rank // self.model_parallel_size

    def validate_world(self, world_size: int) -> None:
        """Checks that need the number of ranks (known from the launcher's env before init).

        Args:
            world_size: the number of ranks.

        Raises:
            ConfigError: the parallel sizes do not divide the world, or the batch size does not
                divide by micro batch x data-parallel ranks.
        """
        group = self.model_parallel_size
        if world_size % group:
            sequence = self.sequence_parallel_size > 1
            name = "sequence_parallel_size" if sequence else "tensor_parallel_size"
            fail(name, getattr(self, name), f"the world size {world_size} does not divide by it; "
                 "use a divisor of the number of ranks")
        dp = self.data_parallel_size(world_size)
        per_step = self.micro_train_batch_size * dp
        if self.train_batch_size % per_step:
            fail("train_batch_size", self.train_batch_size,
                 f"must be a multiple of micro_train_batch_size x data-parallel ranks = "
                 f"{self.micro_train_batch_size} x {dp} = {per_step}")

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches each rank runs per optimizer step.

        Args:
            world_size: the number of ranks.

        Returns:
            ``train_batch_size`` over micro batch x data-parallel ranks.
        """
        per_micro_step = self.micro_train_batch_size * self.data_parallel_size(world_size)
        return self.train_batch_size // per_micro_step
