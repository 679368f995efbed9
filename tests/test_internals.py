"""Every private or undocumented DeepSpeed/torch/transformers access in ``strategy.internals``,
exercised on the real libraries: an upgrade that moves one of them fails here, not deep inside a
training run."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from strategy import internals
from strategy.internals import deepspeed_files as files
from tests.support.helpers import make_strategy
from tests.support.models import tiny_llama


def _saved_files(engine, directory: str) -> dict:
    """DeepSpeed's own save of ``engine``: each file's name and top-level keys (optimizer files:
    their optimizer state's keys)."""
    import torch.distributed as torch_dist

    engine.save_checkpoint(directory, "t", save_latest=False)
    torch_dist.barrier()
    out = {}
    for name in sorted(os.listdir(os.path.join(directory, "t"))):
        state = torch.load(os.path.join(directory, "t", name), weights_only=False)
        state = state.get(files.OPTIMIZER_STATE_DICT, state)
        out[name] = set(state)
    return out


def _ulysses_fits_a_batch() -> tuple:
    import torch.distributed as torch_dist

    ulysses = internals.new_ulysses(lambda *a, **k: None, 2, 4, 8, 2, 1, torch_dist.group.WORLD)
    internals.fit_ulysses_to_batch(ulysses, 3)
    return (ulysses.batch_size, ulysses.core_attn_implementation,
            *(getattr(ulysses, n)[1] for n in ("required_query_shape",
                                              "required_key_value_shape",
                                              "required_context_shape")))


def engine_internals(tmp: str) -> dict:
    """One 2-rank body for the accesses that need an engine: ZeRO-0 fp32 and ZeRO-3."""
    out = {}
    s0 = make_strategy(0, micro=2, total=8)  # 2 micro-steps per optimizer step
    model = s0.from_pretrained(tiny_llama())
    engine = s0.prepare((model, s0.create_optimizer(model), None))
    out["zero0_measures_norm"] = internals.engine_measures_grad_norm(engine)
    x = torch.randint(0, 96, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    out["counters_after_one_micro"] = internals.engine_counters(engine)
    out["skipped"] = internals.skipped_steps(engine)
    with internals.universal_checkpoint_loading(engine):
        out["universal_inside"] = engine.load_universal_checkpoint()
    out["universal_after"] = engine.load_universal_checkpoint()
    store = internals.default_store()
    store.set(f"internals_probe/{s0.rank}", "x")
    out["store"] = store.get(f"internals_probe/{1 - s0.rank}").decode()
    out["ulysses"] = _ulysses_fits_a_batch()
    out["zero0_files"] = _saved_files(engine, os.path.join(tmp, "zero0"))
    s0.close()

    s3 = make_strategy(3)
    model = s3.from_pretrained(tiny_llama())
    engine = s3.prepare((model, s3.create_optimizer(model), None))
    out["zero3_measures_norm"] = internals.engine_measures_grad_norm(engine)
    weight = engine.module.model.embed_tokens.weight
    out["zero3"] = (internals.is_zero3_param(weight), internals.full_shape(weight),
                    internals.full_numel(weight), internals.local_partition(weight).numel(),
                    tuple(weight.shape))
    out["zero3_files"] = _saved_files(engine, os.path.join(tmp, "zero3"))
    s3.close()
    return out


def _check_file_layout(zero0: dict, zero3: dict) -> None:
    """The names and keys ``export.zero_reader`` reads, as DeepSpeed writes them."""
    assert set(zero0) == {files.MODEL_STATES_FILE}, zero0
    assert {files.MODULE, files.PARAM_SHAPES, files.BUFFER_NAMES, files.SHARED_PARAMS,
            files.MP_WORLD_SIZE} <= zero0[files.MODEL_STATES_FILE]
    optim = {n: files.optim_file_ranks(n) for n in zero3 if files.optim_file_ranks(n)}
    model = {n: files.zero3_model_file_ranks(n) for n in zero3 if files.zero3_model_file_ranks(n)}
    assert sorted(optim.values()) == sorted(model.values()) == [(0, 0), (1, 0)], zero3
    assert set(zero3) == set(optim) | set(model)
    for name in optim:
        assert {files.ZERO_STAGE, files.PARTITION_COUNT, files.FP32_FLAT_GROUPS} <= zero3[name]
    for name in model:
        assert {files.MODULE, files.PARAM_SHAPES, files.BUFFER_NAMES} <= zero3[name]
    assert not any(files.is_pipeline_or_moe_file(n) for n in (*zero0, *zero3))
    assert files.optim_file_ranks("bf16_zero_pp_rank_3_mp_rank_01_optim_states.pt") == (3, 1)
    assert files.optim_file_ranks(files.MODEL_STATES_FILE) is None


def test_engine_internals(ranks, tmp_path):
    out = ranks.run(engine_internals, str(tmp_path))
    for got in out:
        assert got["zero0_measures_norm"] is False and got["zero3_measures_norm"] is True
        assert got["counters_after_one_micro"] == (0, 0, 1)  # 1 of 2 micro-steps: no step yet
        assert got["skipped"] == 0
        assert (got["universal_inside"], got["universal_after"]) == (True, False)
        assert got["store"] == "x"
        flag, shape, numel, local, empty = got["zero3"]
        assert flag and shape == (96, 32) and numel == 96 * 32 and empty == (0,)
        assert local == numel // 2, "each of 2 ranks holds half of the embedding"
        assert got["ulysses"] == (3, "sdpa", 3, 3, 3)
    _check_file_layout(out[0]["zero0_files"], out[0]["zero3_files"])


def test_universal_args_match_deepspeeds_parser(monkeypatch):
    from deepspeed.checkpoint import ds_to_universal

    monkeypatch.setattr(sys, "argv", ["x", "--input_folder", "a", "--output_folder", "b"])
    expected = vars(ds_to_universal.parse_arguments())
    assert set(vars(internals.universal_args("a", "b"))) == set(expected)


def test_zero3_helpers_on_plain_tensors():
    plain = nn.Parameter(torch.zeros(3, 4))
    assert not internals.is_zero3_param(plain)
    assert internals.full_shape(plain) == (3, 4) and internals.full_numel(plain) == 12
    assert internals.local_partition(plain).data_ptr() == plain.data_ptr()


def test_torch_internals():
    assert isinstance(nn.BatchNorm1d(3), internals.norm_base_classes())
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("dropped", torch.zeros(1), persistent=False)
    assert internals.non_persistent_buffers(module) == {"dropped"}
    assert "dropped" not in module.state_dict()


def test_deepspeed_config_keys_and_zero_schema():
    keys = internals.deepspeed_config_keys()
    assert {"train_batch_size", "zero_optimization", "gradient_clipping", "bf16"} <= keys
    good = {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert internals.zero_config_error(good) is None
    field, message = internals.zero_config_error({"stage3_param_persitence_threshold": 0})
    assert field == "stage3_param_persitence_threshold" and message


def test_shm_buffer_name_matches_deepspeeds_source():
    import deepspeed

    source = Path(deepspeed.__file__).parent / "ops" / "csrc" / "cpu" / "comm" / "shm.cpp"
    text = source.read_text()
    assert '#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"' in text
    assert 'snprintf(shm_name, NAME_BUF_SIZE, "%s_%d", shm_name_prefix, rank)' in text
    path = internals.shm_allreduce_buffer_path(3)
    assert path.startswith(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_")
    assert path.endswith("_3")


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_weights_only_load_refuses_a_pickle_payload(tmp_path):
    """DeepSpeed's checkpoint engine loads through the scoped ``weights_only`` load; ``torch.load``
    itself stays as it was."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    marker, path = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"module": {"w": torch.zeros(1)}, "x": _Payload(str(marker))}, path)
    torch.save({"scaler": LossScaler(1.0)}, tmp_path / "ok.pt")

    def refused(file, reason):
        return RuntimeError(f"refused {file}: {reason}")

    original = torch.load
    with internals.weights_only_torch_load(refused):
        assert torch.load is original, "the patch must not reach torch.load itself"
        with pytest.raises(RuntimeError, match="refused"):
            TorchCheckpointEngine().load(str(path))
        assert not marker.exists(), "the payload ran"
        # DeepSpeed's own classes are allowed
        assert isinstance(TorchCheckpointEngine().load(str(tmp_path / "ok.pt"))["scaler"],
                          LossScaler)
    import deepspeed.checkpoint.ds_to_universal as converter

    assert converter.torch is torch, "the block must put every module's torch back"


# what calls torch.load in DeepSpeed 0.19.8 but never on our paths: inference, NVMe swapping,
# checkpoint engines we do not configure, zero.Init from a file, zero_to_fp32 (export has its own
# reader), and usage examples inside docstrings
_LOADS_OFF_OUR_PATHS = {
    "deepspeed.inference.engine",
    "deepspeed.inference.v2.model_implementations.inference_policy_base",
    "deepspeed.module_inject.replace_module",
    "deepspeed.nvme.torch_fastio_engine",
    "deepspeed.nvme.torch_io",
    "deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine",
    "deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine",
    "deepspeed.runtime.fp16.fused_optimizer",
    "deepspeed.runtime.fp16.unfused_optimizer",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.utils.zero_to_fp32",
}


def test_scoped_load_covers_every_deepspeed_caller_on_our_paths():
    """Every DeepSpeed module that calls ``torch.load`` is either patched or known to be off our
    load and conversion paths: an upgrade adding a caller fails here."""
    import deepspeed

    root = Path(deepspeed.__file__).parent
    callers = {".".join(p.relative_to(root.parent).with_suffix("").parts)
               for p in root.rglob("*.py") if "torch.load(" in p.read_text(errors="ignore")}
    assert callers == set(files.TORCH_LOAD_CALLERS) | _LOADS_OFF_OUR_PATHS, callers


def test_attn_implementation_on_a_config():
    from transformers import LlamaConfig

    config = LlamaConfig()
    internals.set_attn_implementation(config, "eager")
    assert internals.attn_implementation(config) == "eager"
    assert config._attn_implementation == "eager"


def test_adam_kernels():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    first = internals.new_cpu_adam_id()
    assert internals.new_cpu_adam_id() == first + 1
    optimizer = DeepSpeedCPUAdam([nn.Parameter(torch.zeros(2))])
    assert optimizer.opt_id == first + 2, "DeepSpeedCPUAdam no longer counts ids where we do"
    op = internals.cpu_adam_op()
    assert all(hasattr(op, name) for name in ("create_adam", "adam_update", "destroy_adam"))
    param, grad = torch.ones(4), torch.full((4,), 0.5)
    exp_avg, exp_avg_sq = torch.zeros(4), torch.zeros(4)
    flag = torch.zeros(1, dtype=torch.int)
    internals.multi_tensor_adam(2048)(flag, [[grad], [param], [exp_avg], [exp_avg_sq]], 0.1, 0.9,
                                      0.999, 1e-8, 1, 1, 1, 0.0)
    reference = nn.Parameter(torch.ones(4))
    reference.grad = torch.full((4,), 0.5)
    torch.optim.AdamW([reference], lr=0.1, weight_decay=0.0).step()
    torch.testing.assert_close(param, reference.detach())


@pytest.mark.parametrize("kind", ["fused_adam", "cpu_adam"])
def test_restarted_adam_powers_make_a_reloaded_optimizer_continue_bit_for_bit(kind):
    """DeepSpeed's C++ CPU Adam keeps beta^t as a running product; a reloaded optimizer starts
    from pow(beta, t). With the restart before every step, both paths give the same bits."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    def make(param):
        if kind == "fused_adam":
            return FusedAdam([param], lr=1e-2, betas=(0.9, 0.95))
        return DeepSpeedCPUAdam([param], lr=1e-2, betas=(0.9, 0.95))

    def step(optimizer, param, k, restart):
        param.grad = torch.sin(torch.arange(64.0) * (k + 1))
        if restart:
            internals.restart_adam_powers(optimizer)
        optimizer.step()

    gaps = {}
    for restart in (False, True):
        torch.manual_seed(0)
        param = nn.Parameter(torch.randn(64))
        optimizer = make(param)
        for k in range(12):
            step(optimizer, param, k, restart)
            if k == 5:
                saved, weights = copy.deepcopy(optimizer.state_dict()), param.detach().clone()
        resumed = nn.Parameter(weights)
        other = make(resumed)
        other.load_state_dict(saved)
        for k in range(6, 12):
            step(other, resumed, k, restart)
        gaps[restart] = (param - resumed).abs().max().item()
    assert gaps[True] == 0.0, gaps
    assert gaps[False] > 0.0, "the running product no longer differs: the restart may be moot"


def test_zero_optimizers_count_micro_steps_where_begin_submodule_forward_calls():
    """``begin_submodule_forward`` calls ``clear_backward_seen_flag``: ZeRO-3 advances its
    micro-step there (engine.forward calls it first thing), or gradients stop accumulating."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    assert "micro_step_id += 1" in inspect.getsource(
        DeepSpeedZeroOptimizer_Stage3.clear_backward_seen_flag)
    forward = DeepSpeedEngine.forward.__closure__[0].cell_contents  # under its nvtx wrapper
    assert forward.__name__ == "forward"
    assert "clear_backward_seen_flag()" in inspect.getsource(forward)

    class Counting:
        calls = 0

        def clear_backward_seen_flag(self):
            self.calls += 1

    engine = type("Engine", (), {"optimizer": Counting()})()
    internals.begin_submodule_forward(engine)
    internals.begin_submodule_forward(nn.Linear(1, 1))  # no optimizer: nothing to do
    assert engine.optimizer.calls == 1


def test_py_cpuinfo_is_asked_once_per_machine(monkeypatch):
    """``cache_cpu_info``: DeepSpeed's op builders (``cpu_arch``, ``simd_width``) get py-cpuinfo's
    answer without asking it again (5 asks per rank before, each a Python subprocess); the
    answer travels to started processes in ``STRATEGY_CPU_INFO`` with its host's name, and
    another host's answer is not used. py-cpuinfo's own call is stood in for by a counter (the
    real one: ~1 s of CPU)."""
    import json
    import socket

    import cpuinfo
    from deepspeed.ops.op_builder import FusedAdamBuilder

    from strategy.internals import cache_cpu_info
    from strategy.internals.deepspeed import CPU_INFO_VAR

    asked = []
    answer = {"arch": "X86_64", "flags": ["avx2", "avx512f"], "brand_raw": "test"}

    def ask():
        asked.append(1)
        return dict(answer)

    monkeypatch.setattr(cpuinfo, "get_cpu_info", ask)
    monkeypatch.delenv(CPU_INFO_VAR, raising=False)
    cache_cpu_info()
    builder = FusedAdamBuilder()
    assert builder.cpu_arch() == "-march=native" and builder.simd_width() == "-D__AVX512__"
    assert cpuinfo.get_cpu_info() == answer and len(asked) == 1  # 3 answers, 1 ask
    host, saved = json.loads(__import__("os").environ[CPU_INFO_VAR])
    assert host == socket.gethostname() and saved == answer
    monkeypatch.setenv(CPU_INFO_VAR, json.dumps(["another-node", {"arch": "PPC_64", "flags": []}]))
    assert cpuinfo.get_cpu_info() == answer and len(asked) == 2  # not another node's
    monkeypatch.setenv(CPU_INFO_VAR, json.dumps([socket.gethostname(), {"arch": "riscv64"}]))
    assert builder.cpu_arch() == "-march=rv64gc" and len(asked) == 2  # a started process's
