"""EMA weights at 2 ranks on the real engine: equal to their closed form after k steps (ZeRO-2 and
ZeRO-3, where each rank holds only its partition of the average), restored exactly from a
checkpoint, and exported as a normal HF directory."""

from __future__ import annotations

import os

import pytest
import torch

BETA = 0.8
STEPS = 5


def _steps(strategy, engine, ema, steps: int, seed: int) -> list[dict]:
    """``steps`` optimizer steps; the full weights after each one."""
    from tests.support.helpers import gathered_state
    from tests.support.models import token_batches

    seen = []
    batches = token_batches(steps * strategy.accumulation_steps, 2, seed=seed + strategy.rank)
    for i, x in enumerate(batches):
        strategy.backward(engine(input_ids=x, labels=x).loss, engine)
        strategy.optimizer_step(engine)
        if (i + 1) % strategy.accumulation_steps == 0:
            ema.update()
            seen.append(gathered_state(engine))
    return seen


def closed_form(start: dict, seen: list[dict], beta: float) -> dict:
    """beta^k * w_0 + sum_i (1 - beta) * beta^(k - i) * w_i."""
    k = len(seen)
    out = {name: beta**k * w for name, w in start.items()}
    for i, weights in enumerate(seen, start=1):
        for name, w in weights.items():
            out[name] = out[name] + (1 - beta) * beta ** (k - i) * w
    return out


def ema_run(stage: int, root: str) -> dict:
    from safetensors.torch import load_file

    from tests.support.helpers import gathered_state, make_strategy
    from tests.support.models import tiny_llama

    strategy = make_strategy(stage, total=4, l2=0.0)
    strategy.checkpoint = type(strategy.checkpoint)(ckpt_path=f"{root}/ckpt")

    def build(seed_model: int):
        torch.manual_seed(seed_model)
        model = strategy.from_pretrained(tiny_llama())
        opt = strategy.create_optimizer(model)
        engine = strategy.prepare((model, opt, strategy.create_scheduler(opt,
                                                                         num_training_steps=20)))
        return engine, strategy.create_ema(engine, BETA)

    engine, ema = build(0)
    start = gathered_state(engine)
    if stage == 3:  # each rank holds a partition of the average, not the whole
        whole = sum(t.numel() for t in start.values())
        assert sum(t.numel() for t in ema.shadow.values()) < 0.6 * whole
    seen = _steps(strategy, engine, ema, STEPS, seed=0)
    want = closed_form(start, seen, BETA)
    with ema.swapped_in():
        got = gathered_state(engine)
    assert want and got.keys() == want.keys(), "every weight has its closed-form average"
    assert any(not torch.equal(got[n], seen[-1][n]) for n in got), "the average was swapped in"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    after_swap = gathered_state(engine)  # the weights came back
    for name, w in seen[-1].items():
        assert torch.equal(after_swap[name], w), name

    strategy.save_ckpt(engine, tag="k5", ema=ema)
    strategy.save_model(engine, None, f"{root}/ema_export", ema=ema)
    exported = load_file(f"{root}/ema_export/model.safetensors")
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor.float(), want[name], rtol=1e-5, atol=1e-6, msg=name)
    more = _steps(strategy, engine, ema, 2, seed=100)
    with ema.swapped_in():
        continued = gathered_state(engine)

    engine2, ema2 = build(1)  # other weights, other average: all must come from the checkpoint
    strategy.load_ckpt(engine2, ema=ema2)
    with ema2.swapped_in():
        restored = gathered_state(engine2)
    for name in want:
        assert torch.equal(restored[name], got[name]), name
    more2 = _steps(strategy, engine2, ema2, 2, seed=100)
    with ema2.swapped_in():
        continued2 = gathered_state(engine2)
    for name in continued:
        assert torch.equal(continued2[name], continued[name]), name
        assert torch.equal(more2[-1][name], more[-1][name]), name

    from strategy.errors import CheckpointFileError

    strategy.barrier()
    if strategy.rank == 0:  # rank 1's part of the average goes missing
        os.remove(f"{root}/ckpt/k5/ema_1.safetensors")
    strategy.barrier()
    try:
        strategy.load_ckpt(engine2, ema=ema2)
        raise AssertionError("a checkpoint without rank 1's EMA weights loaded")
    except CheckpointFileError as exc:  # on every rank alike, naming the rank and the file
        message = str(exc)
    assert message.startswith("loading EMA weights failed on rank 1: "), message
    assert "ema_1.safetensors: no EMA weights for rank 1" in message and "\n" not in message
    strategy.close()
    return {"ok": True}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_ema_closed_form_checkpoint_and_export(ranks, tmp_path, stage):
    out = ranks.run(ema_run, stage, str(tmp_path))
    assert out == [{"ok": True}, {"ok": True}]
