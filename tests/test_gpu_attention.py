"""GPU only: flash attention 2 takes its varlen path on packed rows (position ids, no mask);
sdpa per sample and flex attention (whose backward exists on CUDA only) train packed rows as the
samples alone; Ulysses sequence parallelism runs over flash attention. Skipped on CPU-only
machines (CI)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from strategy.trainers.data import packing
from tests.support.models import tiny_llama

pytestmark = pytest.mark.gpu
needs_flash = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                                 reason="flash_attn is not installed")


@needs_flash
def test_flash_attention_varlen_packing_equals_separate_forwards():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flash_attention_2",
                                             dtype=torch.bfloat16).cuda().eval()
    samples = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))}
               for n in (7, 19, 3, 30)]
    rows = packing.pack(samples, max_len=64)
    batch = packing.collate_packed(0)(rows)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"].cuda(),
                       position_ids=batch["position_ids"].cuda(), use_cache=False).logits
        start = 0
        for sample in samples:
            length = len(sample["input_ids"])
            alone = model(input_ids=torch.tensor([sample["input_ids"]]).cuda(),
                          use_cache=False).logits[0]
            torch.testing.assert_close(packed[0, start:start + length].float(), alone.float(),
                                       rtol=2e-2, atol=2e-2)  # bf16 kernels, different tiling
            start += length


@pytest.mark.parametrize("attention", ["sdpa_varlen", "flex_attention"])
def test_packed_forward_and_backward_on_cuda_equal_separate_forwards(attention):
    from transformers import AutoModelForCausalLM

    import strategy  # noqa: F401  (registers sdpa_varlen)

    torch.manual_seed(0)
    config = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).cuda()
    samples = [list(range(5, 5 + n)) for n in (7, 19, 3, 30, 3)]
    rows = packing.pack([{"input_ids": s, "labels": s} for s in samples], max_len=64)
    batch = packing.collate_packed(0)(rows)
    packed = model(input_ids=batch["input_ids"].cuda(),
                   position_ids=batch["position_ids"].cuda(), use_cache=False).logits
    width = sum(len(s) for s in samples)
    packed[0, :width].square().mean().backward()  # the samples' positions (not the padding)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = torch.cat([model(input_ids=torch.tensor([s]).cuda(), use_cache=False).logits[0]
                       for s in samples])
    torch.testing.assert_close(packed[0, :width], alone, rtol=1e-4, atol=1e-4)
    alone.square().mean().backward()
    for want, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, want, rtol=1e-3, atol=1e-5)


def sp_flash(root: str) -> list[float]:
    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig
    from tests.support.models import token_batches

    config = StrategyConfig(zero_stage=2, bf16=True, sequence_parallel_size=2,
                            micro_train_batch_size=2, train_batch_size=2)
    with DeepSpeedStrategy(config, OptimConfig(learning_rate=1e-3)) as strategy:
        strategy.setup_distributed()
        model = strategy.from_pretrained(tiny_llama(), attn_implementation="flash_attention_2")
        engine = strategy.prepare((model, strategy.create_optimizer(model), None))
        losses = []
        for ids in token_batches(3, 2, seq=64):
            batch = strategy.shard_sequence({"input_ids": ids.cuda(), "labels": ids.cuda()})
            out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         labels=batch["shift_labels"], shift_labels=batch["shift_labels"])
            strategy.backward(out.loss, engine)
            strategy.optimizer_step(engine)
            losses.append(strategy.sequence_sum(out.loss.detach()).item())
    return losses


@needs_flash
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Ulysses needs 2 GPUs")
def test_sequence_parallel_runs_over_flash_attention(ranks, tmp_path):
    losses = ranks.run(sp_flash, str(tmp_path))
    assert losses[0] == losses[1] and all(torch.isfinite(torch.tensor(losses[0])))
    assert losses[0][-1] < losses[0][0] * 2  # trains without blowing up
