"""``OptimConfig``: the optimizer kernel, its hyperparameters and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from strategy.config.fields import doc
from strategy.errors import fail

OPTIMIZERS = ("fused_adam", "cpu_adam", "hybrid_adam")
COSINE_ANNEALING_WARMUP = "cosine_annealing_warmup"


@cache
def schedulers() -> frozenset[str]:
    """The schedule names ``lr_scheduler`` takes (transformers' trainer utilities load peft and
    bitsandbytes, ~1 s: imported when a config is checked, not with the package)."""
    from transformers.trainer_utils import SchedulerType  # heavy: loads peft and bitsandbytes

    return frozenset({s.value for s in SchedulerType} | {COSINE_ANNEALING_WARMUP})


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule; validated on construction."""

    learning_rate: float = doc("peak learning rate", 1e-5)
    lr_scheduler: str = doc("schedule name: cosine_with_min_lr, cosine_annealing_warmup or any "
                            "transformers scheduler", "cosine_with_min_lr")
    lr_warmup_ratio: float = doc("fraction of training steps spent warming up linearly", 0.03)
    min_lr_ratio: float = doc("final lr as a fraction of the peak (cosine_with_min_lr)", 0.1)
    l2: float = doc("decoupled weight decay (not applied to biases and norm weights)", 0.0)
    adam_betas: tuple[float, float] = doc("Adam beta1 beta2", (0.9, 0.95))
    adam_eps: float = doc("Adam epsilon", 1e-8)
    optimizer: str = doc("fused_adam (DeepSpeedCPUAdam with adam_offload), cpu_adam "
                         "(DeepSpeedCPUAdam) or hybrid_adam", "fused_adam")

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            fail("learning_rate", self.learning_rate, "use a positive learning rate, e.g. 1e-5")
        for name in ("lr_warmup_ratio", "min_lr_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                fail(name, getattr(self, name), "use a fraction in [0, 1]")
        if self.l2 < 0:
            fail("l2", self.l2, "use a weight decay >= 0")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            fail("adam_betas", self.adam_betas, "use two values in [0, 1), e.g. 0.9 0.95")
        if self.adam_eps <= 0:
            fail("adam_eps", self.adam_eps, "use a small positive epsilon, e.g. 1e-8")
        if self.optimizer not in OPTIMIZERS:
            fail("optimizer", self.optimizer, f"use one of {', '.join(OPTIMIZERS)}")
        if self.lr_scheduler not in schedulers():
            fail("lr_scheduler", self.lr_scheduler, f"use one of {sorted(schedulers())}")
