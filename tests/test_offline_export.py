"""``python -m strategy.export``: a DeepSpeed checkpoint written at 2 ranks becomes an HF directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.helpers import gathered_state, make_strategy, run_job
from tests.support.models import tiny_gpt2, tiny_llama, token_batches
from tests.test_save_model import check_shards, reference_model, tiny_tokenizer, train_steps

ROOT = Path(__file__).resolve().parents[1]


def export_process(*args: str) -> subprocess.CompletedProcess:
    """``python -m strategy.export ARGS`` in a fresh process, outside the ranks' environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return run_job([sys.executable, "-m", "strategy.export", *args], 180, cwd=ROOT,
                   env=dict(env, PYTHONPATH=str(ROOT)))


def run_export(*args: str) -> None:
    """The command line ``python -m strategy.export ARGS`` in this process (rank 0 of the pool:
    the export reads files only, no collective); the pickle test runs it in a fresh process."""
    from strategy.export.offline import main

    main(list(args))


def _checkpoint(s, engine, ckpt: Path) -> None:
    s.save_ckpt(engine, str(ckpt), tag="step2", tokenizer=tiny_tokenizer())


def tied_checkpoint_exports(stage: int, root: str) -> None:
    from transformers import AutoModelForCausalLM

    s = make_strategy(stage)
    config = tiny_gpt2()
    model = s.from_pretrained(config)
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=4)))
    train_steps(s, engine)
    ckpt, out = Path(root) / "ckpt", Path(root) / "hf"
    _checkpoint(s, engine, ckpt)
    state = gathered_state(engine)
    s.close()
    if not s.is_rank_0:
        return
    run_export(str(ckpt), str(out), "--max_shard_size", "20KB")
    check_shards(out, 20_000)
    assert (out / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr(), (
        "not tied"
    )
    x = token_batches(1, 2, seed=7)[0]
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, reference_model(config, state)(x).logits)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_offline_export_tied(ranks, tmp_path, stage):
    ranks.run(tied_checkpoint_exports, stage, str(tmp_path))


def lora_checkpoint_exports(root: str) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.test_save_model import _base_state

    s = make_strategy(2, lr=5e-2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(s.from_pretrained(tiny_llama()), lora)
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=4)))
    train_steps(s, engine)
    ckpt = Path(root) / "ckpt"
    _checkpoint(s, engine, ckpt)
    x = token_batches(1, 2, seed=7)[0]
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=x).logits
    state = gathered_state(engine)
    s.close()
    if not s.is_rank_0:
        return
    run_export(str(ckpt), str(Path(root) / "adapter"), "--tag", "step2")
    run_export(str(ckpt), str(Path(root) / "merged"), "--merge_lora", "--dtype", "fp32")
    assert sorted(p.name for p in (Path(root) / "adapter").glob("adapter_*")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = reference_model(tiny_llama(), _base_state(state))
    with torch.no_grad():
        adapter_logits = PeftModel.from_pretrained(base, Path(root) / "adapter").eval()(x).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(Path(root) / "merged").eval()(x).logits
    assert torch.equal(adapter_logits, logits), (adapter_logits - logits).abs().max()
    # fp32: merging reorders one addition per weight, so only float32 rounding separates them
    torch.testing.assert_close(merged_logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_offline_export_lora(ranks, tmp_path):
    ranks.run(lora_checkpoint_exports, str(tmp_path))


def test_cli_errors_name_the_fix(tmp_path):
    from strategy.errors import ConfigError
    from strategy.export.offline import find_tag

    with pytest.raises(
        ConfigError, match="holds no complete checkpoint.*pass the directory save_ckpt wrote"
    ):
        find_tag(tmp_path, None)
    with pytest.raises(ConfigError, match="tag='../../etc' is invalid"):
        find_tag(tmp_path, "../../etc")


# ------------------------------------------------------------ streamed reads of ZeRO 1/2/3 files
LORA_TARGETS, LORA_RANK, LORA_ALPHA = ("q_proj", "v_proj"), 4, 8
# name: (ZeRO stage, bf16, model): each exercises another part of the checkpoint layout
LIVE_CASES = {
    "zero1-frozen": (1, False, "frozen"),  # ZeRO-1 keeps frozen weights only in `module`
    "zero2-bf16": (2, True, "plain"),  # fp32 master weights beside a bf16 model
    "zero3-lora": (3, False, "lora"),  # frozen base in per-rank fragments, adapter in flat groups
}


def _case_model(s, kind: str):
    from peft import LoraConfig, get_peft_model

    model = s.from_pretrained(tiny_llama())
    if kind == "frozen":
        model.model.embed_tokens.weight.requires_grad_(False)
    if kind == "lora":
        lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS))
        model = get_peft_model(model, lora)
    return model


def exported_tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _check_full(ckpt: Path, out: Path, bf16: bool, live: dict[str, torch.Tensor]) -> None:
    """A bf16 run exported as bf16 is the live bf16 model; an fp32 run's export is the live one."""
    from strategy.export import export_checkpoint

    export_checkpoint(ckpt, out, max_shard_size="20KB", dtype="bf16" if bf16 else None)
    got = exported_tensors(out)
    assert sorted(got) == sorted(live)
    for name, value in got.items():
        assert value.dtype == (torch.bfloat16 if bf16 else torch.float32), name
        assert torch.equal(value.float(), live[name]), f"{name} differs from the live weights"


def _check_lora(ckpt: Path, root: Path, live: dict[str, torch.Tensor]) -> None:
    """The adapter is the live adapter; merged, every untouched weight is the live frozen base and
    every LoRA target its base plus B @ A x scaling."""
    from strategy.export import export_checkpoint
    from tests.test_save_model import _base_state

    export_checkpoint(ckpt, root / "adapter")
    adapter = exported_tensors(root / "adapter")
    expected = {k.replace(".default.", "."): v for k, v in live.items() if "lora_" in k}
    assert sorted(adapter) == sorted(expected)
    for name, value in adapter.items():
        assert torch.equal(value, expected[name]), f"{name} differs from the live adapter"
    export_checkpoint(ckpt, root / "merged", max_shard_size="20KB", merge_lora=True)
    merged, base = exported_tensors(root / "merged"), _base_state(live)
    assert sorted(merged) == sorted(base)
    for name, value in merged.items():
        if name.endswith(tuple(f"{t}.weight" for t in LORA_TARGETS)):
            prefix = "base_model.model." + name.removesuffix("weight")
            delta = live[prefix + "lora_B.default.weight"] @ live[prefix + "lora_A.default.weight"]
            scaled = delta * (LORA_ALPHA / LORA_RANK)
            torch.testing.assert_close(value, base[name] + scaled, rtol=0, atol=1e-6)
        else:
            assert torch.equal(value, base[name]), f"{name} differs from the live frozen base"


def offline_exports_match_live_weights(root: str) -> None:
    for name, (stage, bf16, kind) in LIVE_CASES.items():
        s = make_strategy(stage, bf16=bf16)
        model = _case_model(s, kind)
        optimizer = s.create_optimizer(model)
        engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=4)))
        train_steps(s, engine)
        ckpt = Path(root) / name
        _checkpoint(s, engine, ckpt)
        live = gathered_state(engine)
        s.close()
        if not s.is_rank_0:
            continue
        if kind == "lora":
            _check_lora(ckpt, Path(root) / f"{name}-hf", live)
        else:
            _check_full(ckpt, Path(root) / f"{name}-hf", bf16, live)


@pytest.mark.slow
def test_offline_exports_match_live_weights(ranks, tmp_path):
    ranks.run(offline_exports_match_live_weights, str(tmp_path), timeout=600)


class _Payload:
    """Unpickling it runs ``open(marker, "w")``: the marker file appears."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow
def test_offline_export_refuses_a_pickle_payload(ranks, tmp_path):
    import shutil

    from strategy.checkpoint.safe_load import load_torch_file
    from tests.test_disk_faults import save_for_corruption

    files = [Path(f) for f in ranks.run(save_for_corruption, str(tmp_path / "ckpt"))[0]]
    tag = files[0].parent.name
    for kind in ("optim_states", "model_states"):
        ckpt, marker, out = tmp_path / kind, tmp_path / f"{kind}.marker", tmp_path / f"{kind}-hf"
        shutil.copytree(tmp_path / "ckpt", ckpt)
        victim = ckpt / tag / [f.name for f in files if kind in f.name][-1]
        state = load_torch_file(victim)
        state["payload"] = _Payload(str(marker))
        torch.save(state, victim)
        if kind == "optim_states":  # a fresh process: what a person sees is that one line
            proc = export_process(str(ckpt), str(out))
            assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            last = proc.stderr.strip().splitlines()[-1]
        else:
            with pytest.raises(SystemExit) as stopped:
                run_export(str(ckpt), str(out))
            last = str(stopped.value.code)
        assert last.startswith(f"python -m strategy.export: error: {victim}: refused to unpickle ")
        assert "GLOBAL io.open" in last, last
        assert not marker.exists(), "the payload ran"
        assert not out.exists()
        torch.load(victim, weights_only=False)  # the payload is live: an unsafe load runs it
        assert marker.exists()


def test_reader_refuses_layouts_it_cannot_read(tmp_path):
    from strategy.errors import CheckpointFileError
    from strategy.export.zero_reader import ZeroCheckpoint

    layouts = {
        "layer_01-model_states.pt": "pipeline-parallel or MoE",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt": "tensor-parallel",
        "zero/lm_head.weight/fp32.pt": "universal",
    }
    for name, kind in layouts.items():
        tag = tmp_path / kind.replace(" ", "_") / "step1"
        (tag / name).parent.mkdir(parents=True)
        torch.save({"module": {}}, tag / name)
        torch.save({"module": {}, "param_shapes": None}, tag / "mp_rank_00_model_states.pt")
        with pytest.raises(CheckpointFileError, match=f"{kind}.* checkpoint, which this export"):
            ZeroCheckpoint(tag)


def test_released_pages_read_back_and_other_memory_is_untouched(tmp_path):
    from strategy.export.memory import MappedPages

    torch.save({"w": torch.arange(3 * 2**20, dtype=torch.float32)}, tmp_path / "w.pt")
    mapped = torch.load(tmp_path / "w.pt", mmap=True, weights_only=True)["w"]
    pages = MappedPages()
    pages.track(tmp_path / "w.pt")
    assert pages.ranges, "the file is not mapped"
    before = mapped.clone()
    pages.release(mapped)
    assert torch.equal(mapped, before), "a released page did not read back from the file"
    anonymous = before.clone()
    pages.release(anonymous)  # outside every mapping: must be left alone
    assert torch.equal(anonymous, before)
