"""CosineAnnealingWarmupLR against its closed form at every step, resume, and create_scheduler by
name."""

from __future__ import annotations

import math

import pytest
import torch

from strategy.optim.scheduler import CosineAnnealingWarmupLR, create_scheduler

BASE = 0.1
# the schedule and the formula below are the same float64 expressions evaluated in a different order
REL = 1e-12


def formula(t: int, total: int, warmup: int, eta_min: float, base: float = BASE) -> float:
    """The anchor's definition, written out independently of the implementation."""
    if t < warmup:
        return base * (t + 1) / warmup
    if t >= total:
        return eta_min
    return (
        eta_min + (base - eta_min) * (1 + math.cos(math.pi * (t - warmup) / (total - warmup))) / 2
    )


def _optimizer(lrs=(BASE,)) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    )


def _run(sched: CosineAnnealingWarmupLR, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """The lr each optimizer step sees: read before the step, then opt.step() and sched.step()."""
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


CASES = [(10, 3, 0.0), (10, 0, 0.01), (5, 5, 0.0), (7, 1, 0.02), (1, 0, 0.0), (12, 4, 0.05)]


@pytest.mark.parametrize("total,warmup,eta_min", CASES)
def test_every_step_matches_formula(total, warmup, eta_min):
    opt = _optimizer()
    sched = CosineAnnealingWarmupLR(opt, total, warmup, eta_min)
    seen = _run(sched, opt, total + 2)  # two steps past the end: stays at eta_min
    want = [formula(t, total, warmup, eta_min) for t in range(total + 2)]
    assert seen == pytest.approx(want, rel=REL, abs=1e-15)
    assert sched.get_last_lr()[0] == pytest.approx(eta_min, abs=1e-15)


def test_peak_at_last_warmup_step_and_first_cosine_step():
    opt = _optimizer()
    seen = _run(CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=4, eta_min=0.0), opt, 10)
    assert seen[3] == pytest.approx(BASE, rel=REL) and seen[4] == pytest.approx(BASE, rel=REL)
    assert max(seen) == pytest.approx(BASE, rel=REL)
    assert seen[0] == pytest.approx(BASE / 4, rel=REL), "warmup starts at base/W, not 0"
    assert all(a < b for a, b in zip(seen[:3], seen[1:4], strict=True)), "warmup must rise"
    assert all(a > b for a, b in zip(seen[4:-1], seen[5:], strict=True)), "cosine phase must fall"


def test_each_group_scales_its_own_base_lr():
    opt = _optimizer((BASE, 3 * BASE))
    sched = CosineAnnealingWarmupLR(opt, 8, 2, eta_min=0.001)
    for t in range(8):
        got = [g["lr"] for g in opt.param_groups]
        assert got == pytest.approx([formula(t, 8, 2, 0.001, b) for b in (BASE, 3 * BASE)], rel=REL)
        opt.step()
        sched.step()


@pytest.mark.parametrize("stop", [1, 3, 6])
def test_resume_from_state_dict_continues_identically(stop):
    total, warmup, eta_min = 9, 3, 0.004
    opt = _optimizer()
    full = _run(CosineAnnealingWarmupLR(opt, total, warmup, eta_min), opt, total)

    opt_a = _optimizer()
    sched_a = CosineAnnealingWarmupLR(opt_a, total, warmup, eta_min)
    head = _run(sched_a, opt_a, stop)
    saved_sched, saved_opt = sched_a.state_dict(), opt_a.state_dict()

    opt_b = _optimizer((0.5,))  # a different lr everywhere: all of it must come from the state
    sched_b = CosineAnnealingWarmupLR(opt_b, 100, 0, 0.0)
    opt_b.load_state_dict(saved_opt)
    sched_b.load_state_dict(saved_sched)
    assert (sched_b.total_steps, sched_b.warmup_steps, sched_b.eta_min) == (total, warmup, eta_min)
    assert head + _run(sched_b, opt_b, total - stop) == pytest.approx(full, rel=REL)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"total_steps": 0}, "total_steps"),
        ({"total_steps": 4, "warmup_steps": 5}, "warmup_steps"),
        ({"total_steps": 4, "eta_min": -1.0}, "eta_min"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        CosineAnnealingWarmupLR(_optimizer(), **kwargs)


def test_create_scheduler_offers_it_by_name():
    opt = _optimizer()
    sched = create_scheduler(
        opt, "cosine_annealing_warmup", num_training_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1
    )
    assert isinstance(sched, CosineAnnealingWarmupLR)
    assert (sched.total_steps, sched.warmup_steps, sched.eta_min) == (
        10,
        2,
        pytest.approx(0.1 * BASE),
    )
    assert _run(sched, opt, 10) == pytest.approx(
        [formula(t, 10, 2, 0.1 * BASE) for t in range(10)], rel=REL
    )


def test_create_scheduler_still_offers_transformers_schedules():
    opt = _optimizer()
    sched = create_scheduler(opt, "linear", num_training_steps=4, num_warmup_steps=0)
    assert not isinstance(sched, CosineAnnealingWarmupLR)
    assert _run(sched, opt, 4) == pytest.approx([BASE * (4 - t) / 4 for t in range(4)], rel=1e-9)
