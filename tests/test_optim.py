"""HybridAdam against torch's Adam/AdamW, its NVMe state files, the optimizer factory and its
configs."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

from strategy import ConfigError, OptimConfig, StrategyConfig
from strategy.config.ds_config import build_ds_config
from strategy.optim.hybrid_adam import HybridAdam
from strategy.optim.nvme_offload import StateFiles, plan_offload

STEPS = 5
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8
# fp32: DeepSpeed's SIMD kernel and torch evaluate the same formula in a different order (bias
# correction folded into the step size, fused multiply-adds), so they agree to float32 rounding.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# bf16: both sides do fp32 math on the same bf16 values and round the result to bf16; a value that
# lands within float32 noise of a rounding boundary may round the other way: at most one bf16 ulp.
BF16_TOL = dict(rtol=2**-7, atol=1e-6)
FP16_TOL = dict(rtol=2**-10, atol=1e-6)  # the same, for fp16's 10-bit mantissa
# odd sizes leave tails past the 8/4/1-wide SIMD loops; two groups with their own weight decay
SHAPES = [(37,), (16, 33), (1000,), (3, 5, 7)]


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    return [
        {"params": params[:2], "weight_decay": weight_decay},
        {"params": params[2:], "weight_decay": 0.0},
    ]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, grad in zip(params, grads, strict=True):
        if grad.dtype != p.dtype and hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # torch >= 2.10 refuses a gradient of another dtype unless told
        p.grad = grad.clone()


def _reference(
    params: list[torch.Tensor],
    adamw_mode: bool,
    weight_decay: float,
    steps: int,
    grad_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """torch.optim.AdamW (decoupled decay) or Adam (L2 in the gradient) on fp32 copies; for
    bf16/fp16 parameters every step's result is rounded back to the parameter dtype, as the CPU
    kernel does."""
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls(_groups(ref, weight_decay), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    for k in range(steps):
        _set_grads(ref, [g.float() for g in _grads(k, grad_dtype)])
        opt.step()
        with torch.no_grad():
            for r, p in zip(ref, params, strict=True):
                r.copy_(r.to(p.dtype).float())
    return [r.detach().to(params[0].dtype) for r in ref]


def _run(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range, grad_dtype: torch.dtype
) -> None:
    for k in steps:
        _set_grads(params, _grads(k, grad_dtype))
        opt.step()


def _close(got: list[torch.Tensor], want: list[torch.Tensor], tol: dict) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.detach(), b, **tol, msg=lambda m, i=i: f"param {i}: {m}")


# ---------------------------------------------------------------- math vs torch


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["wd0", "wd0.1"])
def test_cpu_path_matches_torch(dtype, adamw_mode, weight_decay):
    params = _params(dtype)
    want = _reference(params, adamw_mode, weight_decay, STEPS, dtype)
    opt = HybridAdam(
        _groups(params, weight_decay), lr=LR, betas=BETAS, eps=EPS, adamw_mode=adamw_mode
    )
    _run(opt, params, range(STEPS), dtype)
    _close(
        params,
        want,
        {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL, torch.float16: FP16_TOL}[dtype],
    )
    start = _params(dtype)
    moved = max(
        (p.detach().float() - q.float()).abs().max().item()
        for p, q in zip(params, start, strict=True)
    )
    assert moved > LR, (
        f"parameters barely moved ({moved:.2e}): the test would not see a wrong update"
    )
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in params), (
        "CPU moments must be fp32"
    )


@pytest.mark.parametrize(
    "grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16_grad", "fp16_grad"]
)
def test_low_precision_grads_of_fp32_params(grad_dtype):
    params = _params(torch.float32)
    want = _reference(params, True, 0.1, STEPS, grad_dtype)
    opt = HybridAdam(_groups(params, 0.1), lr=LR, betas=BETAS, eps=EPS)
    _run(opt, params, range(STEPS), grad_dtype)
    _close(params, want, FP32_TOL)


def test_without_bias_correction_matches_formula():
    p = torch.nn.Parameter(torch.randn(101, generator=torch.Generator().manual_seed(3)))
    x, m, v = p.detach().clone(), torch.zeros(101), torch.zeros(101)
    opt = HybridAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1, bias_correction=False)
    for k in range(STEPS):
        grad = torch.randn(101, generator=torch.Generator().manual_seed(k))
        p.grad = grad.clone()
        opt.step()
        x = x * (1 - LR * 0.1)
        m = BETAS[0] * m + (1 - BETAS[0]) * grad
        v = BETAS[1] * v + (1 - BETAS[1]) * grad * grad
        x = x - LR * m / (v.sqrt() + EPS)
    torch.testing.assert_close(p.detach(), x, **FP32_TOL)


def test_fused_multi_tensor_path_matches_torch(monkeypatch):
    """The accelerator path runs DeepSpeed's multi-tensor kernel; its CPU build lets it run here
    too."""
    params = _params(torch.float32)
    want = _reference(params, True, 0.1, STEPS, torch.float32)
    opt = HybridAdam(_groups(params, 0.1), lr=LR, betas=BETAS, eps=EPS)
    fused = {id(p) for p in params[1:3]}  # one tensor of each group takes the fused path
    monkeypatch.setattr(opt, "_is_cpu", lambda p: id(p) not in fused)
    calls = []
    kernel = opt._fused_kernel()
    monkeypatch.setattr(opt, "_fused_op", lambda *a: calls.append(len(a[1][0])) or kernel(*a))
    _run(opt, params, range(STEPS), torch.float32)
    _close(params, want, FP32_TOL)
    assert calls == [1, 1] * STEPS, f"expected one fused call per group per step, got {calls}"


def test_non_contiguous_param_is_updated_in_place():
    base = torch.randn(8, 5, generator=torch.Generator().manual_seed(5))
    p, ref = torch.nn.Parameter(base.clone().t()), torch.nn.Parameter(base.clone().t())
    assert not p.is_contiguous()
    opt, ref_opt = (
        HybridAdam([p], lr=LR, weight_decay=0.1),
        torch.optim.AdamW([ref], lr=LR, weight_decay=0.1),
    )
    for k in range(STEPS):
        grad = torch.randn(5, 8, generator=torch.Generator().manual_seed(k))
        p.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), **FP32_TOL)
    assert not torch.equal(p.detach(), base.t()), "the update was lost in a contiguous copy"


def test_skips_params_without_grad():
    params = _params(torch.float32)
    before = params[0].detach().clone()
    opt = HybridAdam(params, lr=LR)
    _set_grads(params, _grads(0, torch.float32))
    params[0].grad = None
    opt.step()
    assert torch.equal(params[0].detach(), before) and params[0] not in opt.state


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"nvme_offload_fraction": 1.5}, "nvme_offload_fraction"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        HybridAdam(_params(torch.float32), **kwargs)


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_dict_round_trip_mid_run_continues_identically(dtype):
    params = _params(dtype)
    # default betas: with them DeepSpeed's cached beta^t product and pow(beta, t) differ in the last
    # bit
    opt = HybridAdam(_groups(params, 0.1), lr=LR, eps=EPS)
    _run(opt, params, range(3), dtype)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = HybridAdam(
        _groups(resumed, 0.5), lr=1.0, betas=(0.5, 0.5), eps=1.0
    )  # all overwritten by the load
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert all(opt2.state[p]["exp_avg_sq"].dtype == torch.float32 for p in resumed), (
        "load kept fp32 moments"
    )
    _run(opt, params, range(3, 7), dtype)
    _run(opt2, resumed, range(3, 7), dtype)
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b), "a resumed run must continue bit for bit"


# ---------------------------------------------------------------- NVMe state files


def test_plan_honours_fraction_by_element_count():
    params = [torch.empty(n) for n in (100, 300, 50, 400, 150)]  # 1000 elements
    chosen = plan_offload(params, 0.5)
    assert (
        sum(p.numel() for p in chosen) == 450 <= 500
    )  # 100 + 300 + 50; 400 and 150 would overshoot
    assert plan_offload(params, 1.0) == params and plan_offload(params, 0.0) == []


@pytest.mark.parametrize("use_aio", [False, True], ids=["file", "async_io"])
def test_nvme_fraction_same_numbers_and_real_files(tmp_path, use_aio):
    params = [
        torch.nn.Parameter(torch.randn(512, generator=torch.Generator().manual_seed(i)))
        for i in range(4)
    ]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = [
        [torch.randn(512, generator=torch.Generator().manual_seed(100 * k + i)) for i in range(4)]
        for k in range(STEPS)
    ]
    opt = HybridAdam(
        params, lr=LR, weight_decay=0.1, nvme_offload_fraction=0.5, nvme_offload_dir=str(tmp_path)
    )
    opt.state_files.close()
    opt.state_files = StateFiles(str(tmp_path), use_aio=use_aio)
    if use_aio and opt.state_files.backend != "async_io":
        pytest.skip(
            "DeepSpeed's async_io op does not build or cannot O_DIRECT here (needs libaio-dev)"
        )
    ref = HybridAdam(plain, lr=LR, weight_decay=0.1)
    for k in range(STEPS):
        for ps, o in ((params, opt), (plain, ref)):
            _set_grads(ps, grads[k])
            o.step()
        for p, q in zip(params, plain, strict=True):
            assert torch.equal(p, q), f"step {k}: offloaded states changed the numbers"
    offloaded = [p for p in params if p in opt.state_files]
    assert len(offloaded) == 2, "half of 4 equal tensors by element count"
    for p in params:
        on_file = p in opt.state_files
        assert ("exp_avg" in opt.state[p]) != on_file, (
            "offloaded moments must leave memory between steps"
        )
        for key in ("exp_avg", "exp_avg_sq"):
            path = opt.state_files.path(p, key) if on_file else None
            assert not on_file or os.path.getsize(path) == 512 * 4, (
                f"{path}: expected 512 fp32 values"
            )
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    for i in range(4):
        assert torch.equal(sd["state"][i]["exp_avg_sq"], ref_sd["state"][i]["exp_avg_sq"])
    assert "exp_avg" not in opt.state[offloaded[0]], "state_dict must not pull the live state back"
    directory = opt.state_files.dir
    del opt
    assert not os.path.exists(directory), "the state directory must be removed with the optimizer"


def test_nvme_round_trip_through_state_dict(tmp_path):
    params = _params(torch.float32)
    opt = HybridAdam(params, lr=LR, nvme_offload_fraction=0.6, nvme_offload_dir=str(tmp_path))
    _run(opt, params, range(2), torch.float32)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = HybridAdam(resumed, lr=LR, nvme_offload_fraction=0.6, nvme_offload_dir=str(tmp_path))
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    _run(opt, params, range(2, 5), torch.float32)
    _run(opt2, resumed, range(2, 5), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed, strict=True))
    assert sum(p.numel() for p in params if p in opt2.state_files) <= 0.6 * sum(
        p.numel() for p in params
    )


# ---------------------------------------------------------------- accelerator


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_cpu_and_accelerator_params(dtype):
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().device_name()
    params = _params(dtype)
    want = _reference(params, True, 0.1, STEPS, dtype)
    mixed = [
        torch.nn.Parameter(p.detach().clone().to(device if i % 2 else "cpu"))
        for i, p in enumerate(params)
    ]
    opt = HybridAdam(_groups(mixed, 0.1), lr=LR, betas=BETAS, eps=EPS)
    for k in range(STEPS):
        for p, g in zip(mixed, _grads(k, dtype), strict=True):
            p.grad = g.to(p.device)
        opt.step()
    assert {p.device.type for p in mixed} == {"cpu", torch.device(device).type}
    # bf16 on the accelerator keeps bf16 moments (one dtype per fused call): looser than one ulp
    tol = FP32_TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    _close([p.detach().cpu() for p in mixed], want, tol)


# ---------------------------------------------------------------- factory and configs


@pytest.mark.parametrize(
    "name,offload,cls",
    [
        ("fused_adam", False, "FusedAdam"),
        ("fused_adam", True, "DeepSpeedCPUAdam"),
        ("cpu_adam", True, "DeepSpeedCPUAdam"),
        ("hybrid_adam", False, "HybridAdam"),
        ("hybrid_adam", True, "HybridAdam"),
    ],
)
def test_build_optimizer_picks_by_name(name, offload, cls):
    from strategy.optim import build_optimizer

    groups = [{"params": _params(torch.float32)[:2], "weight_decay": 0.1, "names": ["a", "b"]}]
    opt = build_optimizer(groups, offload=offload, lr=LR, betas=BETAS, eps=EPS, name=name)
    assert type(opt).__name__ == cls
    assert opt.param_groups[0]["weight_decay"] == 0.1 and "names" not in opt.param_groups[0]


def test_optimizer_name_is_validated():
    with pytest.raises(ConfigError, match="^optimizer='adam8bit'"):
        OptimConfig(optimizer="adam8bit")


@pytest.mark.parametrize(
    "kw",
    [
        dict(zero_stage=2, adam_offload=True),
        dict(zero_stage=3, adam_offload=False),
        dict(zero_stage=3, adam_offload=True, offload_ratio=0.0),
    ],
)
def test_offload_ratio_refused_where_deepspeed_lacks_it(kw):
    with pytest.raises(ConfigError, match="^offload_ratio="):
        StrategyConfig(**{"offload_ratio": 0.5, **kw})


def test_offload_ratio_and_client_optimizer_in_ds_config():
    cfg = StrategyConfig(
        zero_stage=3,
        adam_offload=True,
        offload_ratio=0.3,
        micro_train_batch_size=1,
        train_batch_size=2,
    )
    zero = build_ds_config(cfg, 2)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.3}
    assert build_ds_config(cfg, 2)["zero_force_ds_cpu_optimizer"] is False
    plain = StrategyConfig(zero_stage=2, micro_train_batch_size=1, train_batch_size=2)
    assert "ratio" not in build_ds_config(plain, 2)["zero_optimization"]["offload_optimizer"]
    assert "zero_force_ds_cpu_optimizer" not in build_ds_config(plain, 2)


def test_offload_ratio_refused_with_hybrid_adam():
    from strategy import DeepSpeedStrategy

    cfg = StrategyConfig(zero_stage=3, adam_offload=True, offload_ratio=0.5)
    strategy = DeepSpeedStrategy(cfg, OptimConfig(optimizer="hybrid_adam"))
    with pytest.raises(ConfigError, match="^offload_ratio=0.5.*DeepSpeedCPUAdam"):
        strategy.create_optimizer(torch.nn.Linear(4, 4))


# ---------------------------------------------------------------- inside DeepSpeed (2 ranks)


def train_zero2_offload(name: str, steps: int = 4, stage: int = 2) -> dict[str, list[float]]:
    """Train tiny LLaMA with ZeRO-``stage`` + optimizer offload with the named optimizer; losses per
    step."""
    from tests.support.helpers import make_strategy
    from tests.support.models import tiny_llama, token_batches

    s = make_strategy(stage, offload=True, optimizer=name)
    model = s.from_pretrained(tiny_llama())
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=steps)))
    assert type(engine.optimizer.optimizer).__name__ == {"hybrid_adam": "HybridAdam"}.get(
        name, "DeepSpeedCPUAdam"
    )
    micro, world = 2, s.world_size
    batch = token_batches(1, micro * s.accumulation_steps * world)[
        0
    ]  # fixed data: the loss must fall
    losses, local = [], []
    for _ in range(steps):
        step = []
        for a in range(s.accumulation_steps):
            x = batch[(a * world + s.rank) * micro :][:micro]
            loss = engine(input_ids=x, labels=x).loss
            s.backward(loss, engine)
            s.optimizer_step(engine)
            step.append(loss.item())
        local += step  # this rank's own micro-batch losses, before any reduction
        losses.append(s.all_reduce(sum(step) / len(step)))
    states = [
        t
        for st in engine.optimizer.optimizer.state.values()
        for t in st.values()
        if torch.is_tensor(t)
    ]
    assert states and all(t.device.type == "cpu" for t in states), (
        "offloaded moments must live on the CPU"
    )
    s.close()
    return {"mean": losses, "local": local}


def hybrid_vs_cpu_adam(stage: int) -> dict:
    return {name: train_zero2_offload(name, stage=stage) for name in ("cpu_adam", "hybrid_adam")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_adam_in_offload_matches_cpu_adam(ranks, stage):
    out = ranks.run(hybrid_vs_cpu_adam, stage, timeout=300)
    ref, got = out[0]["cpu_adam"]["mean"], out[0]["hybrid_adam"]["mean"]
    assert out[0]["hybrid_adam"]["mean"] == out[1]["hybrid_adam"]["mean"], "ranks disagree"
    assert got[-1] < got[0], f"HybridAdam did not train: {got}"
    for rank in out:  # each rank's own losses, not only their average
        mine, theirs = rank["hybrid_adam"]["local"], rank["cpu_adam"]["local"]
        assert mine == pytest.approx(theirs, rel=1e-6), (mine, theirs)
    # both step the same fp32 CPU partitions (ZeRO-3: sub-group partitions) with the same DeepSpeed
    # CPU
    # Adam kernel; only the float rounding of a different call order could separate them
    assert got == pytest.approx(ref, rel=1e-6), (got, ref)
    print(
        f"ZeRO-{stage} losses HybridAdam {got} DeepSpeedCPUAdam {ref}; max relative gap "
        f"{max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)):.2e}"
    )


@pytest.mark.slow
def test_hybrid_adam_zero2_offload_checkpoint_resumes_exactly(ranks, tmp_path):
    from tests.test_checkpoint import STEPS as CKPT_STEPS
    from tests.test_checkpoint import train

    ckpt, kw = str(tmp_path / "ckpt"), dict(offload=True, optimizer="hybrid_adam")
    full = ranks.run(train, 2, ckpt, **kw)
    first = ranks.run(train, 2, ckpt, stop_at=CKPT_STEPS // 2, **kw)
    second = ranks.run(train, 2, ckpt, resume=True, init_seed=123, **kw)
    for f, a, b in zip(full, first, second, strict=True):
        assert f["optimizer"] == b["optimizer"] == "HybridAdam"
        assert b["resume"].global_step == CKPT_STEPS // 2
        assert {**a["losses"], **b["losses"]} == f["losses"], (
            a["losses"],
            b["losses"],
            f["losses"],
        )
        for i, (want, got) in enumerate(zip(f["master"], b["master"], strict=True)):
            assert torch.equal(want, got), f"fp32 partition {i} differs after resume"
        for name, value in f["weights"].items():
            assert torch.equal(value, b["weights"][name]), f"{name} differs after resume"
    assert f["losses"][CKPT_STEPS] < f["losses"][1], "loss did not fall"


def partial_offload_run(ratio: float, steps: int = 3) -> dict:
    """ZeRO-3 + DeepSpeedCPUAdam with ``offload_ratio``; which devices the fp32 sub-groups landed
    on."""
    from tests.support.helpers import make_strategy
    from tests.support.models import tiny_llama, token_batches

    s = make_strategy(3, offload=True, offload_ratio=ratio, micro=2, total=2)
    s.config.ds_config_overrides["zero_optimization"]["sub_group_size"] = (
        4096  # several sub-groups to split
    )
    model = s.from_pretrained(tiny_llama())
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=steps)))
    x = token_batches(1, 2)[0]
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=x, labels=x).loss
        s.backward(loss, engine)
        s.optimizer_step(engine)
        losses.append(loss.item())
    devices = sorted({t.device.type for t in engine.optimizer.fp32_partitioned_groups_flat})
    s.close()
    return {"losses": losses, "devices": devices}


@pytest.mark.gpu
@pytest.mark.slow
def test_offload_ratio_really_splits_optimizer_states(ranks):
    from deepspeed.accelerator import get_accelerator

    accel = torch.device(get_accelerator().device_name()).type
    part = ranks.run(partial_offload_run, 0.5, world_size=1)[0]
    full = ranks.run(partial_offload_run, 1.0, world_size=1)[0]
    assert full["devices"] == ["cpu"], full
    assert part["devices"] == sorted(["cpu", accel]), (
        f"ratio 0.5 kept no sub-group on the accelerator: {part}"
    )
    assert part["losses"][-1] < part["losses"][0], part
    # the accelerator's sub-groups step with torch AdamW, the others with CPU Adam: float rounding
    # only
    assert part["losses"] == pytest.approx(full["losses"], rel=1e-4)


def sleep_run(stage: int, sleep: bool, steps: int = 3) -> dict:
    """ZeRO ``stage`` at one rank: ``steps`` steps, each after ``strategy.sleep`` (as before a
    rollout; a no-op without ``ds_enable_sleep``); the accelerator memory it freed each time."""
    from deepspeed.accelerator import get_accelerator

    from tests.support.helpers import make_strategy
    from tests.support.models import tiny_llama, token_batches

    s = make_strategy(stage, micro=2, total=2, ds_enable_sleep=sleep)
    model = s.from_pretrained(tiny_llama())
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=steps)))
    x, accel = token_batches(1, 2)[0].to(engine.device), get_accelerator()
    out = {"losses": [], "freed": [], "asleep": [], "params": params}
    for _ in range(steps):
        before = accel.memory_allocated()
        s.sleep(engine)
        out["freed"].append(before - accel.memory_allocated())
        out["asleep"].append(s.asleep(engine))
        loss = engine(input_ids=x, labels=x).loss
        s.backward(loss, engine)
        s.optimizer_step(engine)
        out["losses"].append(loss.item())
    s.close()
    return out


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_sleep_frees_the_training_states_device_memory(ranks, stage):
    """``--ds_enable_sleep``'s ``strategy.sleep`` on a GPU: once Adam's states exist (after the
    first step), each sleep frees at least their two fp32 moments' bytes of device memory, the
    next backward brings them back, and the losses are those of the run that never sleeps."""
    slept = ranks.run(sleep_run, stage, True, world_size=1)[0]
    awake = ranks.run(sleep_run, stage, False, world_size=1)[0]
    assert slept["losses"] == awake["losses"]
    assert all(slept["asleep"]) and not any(awake["asleep"])
    assert min(slept["freed"][1:]) >= 8 * slept["params"], slept  # exp_avg + exp_avg_sq, fp32
    assert max(awake["freed"]) <= 0, awake
