"""Damaged or mismatched files, each refused with one line naming the file or the setting: ZeRO
checkpoints the offline export cannot read (a rank's file missing, a rank count the files
contradict, no model states, no ZeRO stage), an export whose ``--config_dir`` is missing or of
another model, ``--merge_lora`` where nothing can be merged, EMA weights of another shape or decay,
a resume from a tag without state files or into a loader that cannot record a position, a
``save_dir`` of another storage kind than ``ckpt_path``. Single process, small ``torch.save``'d
dicts; nothing trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from strategy.errors import CheckpointFileError, ConfigError
from tests.support.models import tiny_llama

OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
ZERO3_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
MODEL = "mp_rank_00_model_states.pt"
FIX = "; restore the checkpoint or export another tag"


def _optim(stage: int | None, ranks: int) -> dict:
    state = {"partition_count": ranks}
    if stage is not None:
        state["zero_stage"] = stage
    return {"optimizer_state_dict": state}


def _tag(root: Path, files: dict) -> Path:
    """``root/ckpt/step1``: a complete checkpoint (its state file) holding ``files``, and a 1-layer
    tiny LLaMA's ``config.json`` beside them."""
    tag = root / "ckpt" / "step1"
    tag.mkdir(parents=True)
    (tag / "strategy_state.json").write_text(json.dumps({"world_size": 1, "zero_stage": 0}))
    for name, state in files.items():
        torch.save(state, tag / name)
    tiny_llama(num_hidden_layers=1).save_pretrained(tag)
    return tag


def _export(*args: str) -> str:
    """``python -m strategy.export ARGS`` in this process: the line it exits with."""
    from strategy.export.offline import main

    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    return str(exit_.value.code)


def _zero0_module(config) -> dict:
    """What a ZeRO-0 checkpoint of ``config``'s model holds: every weight (zeros) in ``module``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {"module": {name: torch.zeros(t.shape) for name, t in model.state_dict().items()}}


# ------------------------------------------------------------ damaged ZeRO checkpoints


DAMAGED = {
    "missing-rank": ({OPTIM.format(0): _optim(2, 3), OPTIM.format(2): _optim(2, 3)},
                     "TAG: optimizer files of ranks [0, 2] only (some are missing)" + FIX),
    "rank-count": ({OPTIM.format(0): _optim(2, 3), OPTIM.format(1): _optim(2, 3)},
                   "TAG: written by 3 ranks but 2 optimizer files are there" + FIX),
    "no-model-states": ({OPTIM.format(0): _optim(2, 1)}, f"TAG/{MODEL}: not found" + FIX),
    "zero3-model-states": ({OPTIM.format(0): _optim(3, 2), OPTIM.format(1): _optim(3, 2),
                            ZERO3_MODEL.format(0): {"module": {}}},
                           "TAG: 1 model-state files for 2 ranks" + FIX),
    "no-zero-stage": ({OPTIM.format(0): _optim(None, 1), MODEL: {"module": {}}},
                      f"TAG/{OPTIM.format(0)}: no zero_stage: not a ZeRO optimizer file" + FIX),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_offline_export_refuses_a_damaged_checkpoint(tmp_path, case):
    files, message = DAMAGED[case]
    tag = _tag(tmp_path, files)
    line = _export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert line == "python -m strategy.export: error: " + message.replace("TAG", str(tag))
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------ config_dir and merge_lora


def test_offline_export_without_config_json(tmp_path):
    tag = _tag(tmp_path, {MODEL: _zero0_module(tiny_llama(num_hidden_layers=1))})
    (tag / "config.json").unlink()
    ckpt, out = tmp_path / "ckpt", str(tmp_path / "hf")
    fix = ("; pass --config_dir with the model's config.json (and adapter_config.json for a LoRA "
           "run)")
    missing = tmp_path / "nowhere"
    assert _export(str(ckpt), out, "--config_dir", str(missing)) == (
        f"python -m strategy.export: error: config_dir={str(missing)!r} is invalid: no "
        f"config.json in {missing}" + fix)
    # without --config_dir: both places looked in are named
    line = _export(str(ckpt), out)
    assert line == ("python -m strategy.export: error: config_dir=None is invalid: no config.json "
                    f"in {tag}, {ckpt}" + fix), line
    assert "\n" not in line and not (tmp_path / "hf").exists()


def test_offline_export_with_another_models_config(tmp_path):
    _tag(tmp_path, {MODEL: _zero0_module(tiny_llama(num_hidden_layers=1))})
    other = tmp_path / "two_layers"
    tiny_llama(num_hidden_layers=2).save_pretrained(other)
    layer = "model.layers.1."
    missing = [layer + name for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                         "mlp.gate_proj.weight")]
    line = _export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config_dir", str(other))
    assert line == ("python -m strategy.export: error: config_dir is invalid: the checkpoint does "
                    f"not match config.json (missing {missing}, unexpected [], shapes []); pass "
                    "--config_dir with the training model's config")
    assert not (tmp_path / "hf").exists()


def test_offline_merge_lora_of_a_plain_model(tmp_path):
    _tag(tmp_path, {MODEL: _zero0_module(tiny_llama(num_hidden_layers=1))})
    line = _export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--merge_lora")
    assert line == ("python -m strategy.export: error: merge_lora=True needs a PEFT model: pass "
                    "merge_lora=False for a plain model")
    assert not (tmp_path / "hf").exists()


class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


def test_merge_lora_of_a_dora_adapter():
    """``plan_export`` (``save_model`` and the offline export both plan through it)."""
    from peft import LoraConfig, get_peft_model

    from strategy.export.units import plan_export

    model = get_peft_model(_TwoLinear(), LoraConfig(r=2, target_modules=["a"], use_dora=True))
    with pytest.raises(ConfigError) as err:
        plan_export(model, None, "5GB", merge_lora=True)
    assert str(err.value) == ("merge_lora=True does not support DoRA adapters: save the adapter "
                              "(merge_lora=False)")
    assert plan_export(model, None, "5GB", merge_lora=False).adapter_only  # the adapter alone: fine


# ------------------------------------------------------------ EMA weights


def test_ema_weights_of_another_shape(tmp_path):
    from strategy.ema import EMA

    EMA(nn.Linear(2, 3), 0.9).save(str(tmp_path), 0)
    other = EMA(nn.Linear(2, 4), 0.9)
    with pytest.raises(CheckpointFileError) as err:
        other.load(str(tmp_path), 0)
    assert str(err.value) == (f"{tmp_path}/ema_0.safetensors: EMA weight 'weight' is missing or "
                              "shaped otherwise than (4, 2); resume at the same world size and "
                              "model")


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5])
def test_ema_decay_outside_zero_one(beta):
    from strategy.ema import EMA

    with pytest.raises(ConfigError) as err:
        EMA(nn.Linear(2, 3), beta)
    assert str(err.value) == f"ema_beta={beta!r} is invalid: use a decay in (0, 1), e.g. 0.999"


# ------------------------------------------------------------ resume


class _Engine:
    """What ``load_checkpoint`` asks of a DeepSpeed engine, DeepSpeed's own load a stub."""

    module = nn.Linear(2, 2)
    global_steps, global_samples, micro_steps = 4, 8, 4

    def load_checkpoint(self, load_dir, tag, **kw):
        return f"{load_dir}/{tag}", {}

    def gradient_accumulation_steps(self):
        return 1


def _resume_dir(root: Path, with_files: bool) -> Path:
    tag = root / "ckpt" / "step4"
    tag.mkdir(parents=True)
    (tag / "strategy_state.json").write_text(json.dumps({"world_size": 1, "zero_stage": 2}))
    if with_files:
        torch.save({"module": {}}, tag / MODEL)
    return tag


def test_resume_from_a_tag_without_state_files(tmp_path):
    from strategy.checkpoint.load import load_checkpoint

    tag = _resume_dir(tmp_path, with_files=False)
    with pytest.raises(CheckpointFileError) as err:
        load_checkpoint(_Engine(), str(tmp_path / "ckpt"))
    assert str(err.value) == (f"{tag}: no checkpoint files (*.pt); pick another tag or "
                              "directory")


def test_resume_into_a_foreign_dataloader(tmp_path):
    """A loader whose sampler cannot record a position (not ``setup_dataloader``'s)."""
    from torch.utils.data import DataLoader

    from strategy.checkpoint.load import load_checkpoint

    _resume_dir(tmp_path, with_files=True)
    with pytest.raises(ConfigError) as err:
        load_checkpoint(_Engine(), str(tmp_path / "ckpt"), dataloader=DataLoader(range(8)))
    assert str(err.value) == ("dataloader='SequentialSampler' is invalid: pass the loader from "
                              "strategy.setup_dataloader (its ResumableDistributedSampler "
                              "records the position)")


# ------------------------------------------------------------ checkpoint storage


def test_save_dir_of_another_storage_kind(tmp_path, monkeypatch):
    """On several nodes ``find_storage`` tells a shared directory from node-local disks (a token
    only some nodes see); here it answers per directory as it would there."""
    from strategy.checkpoint import CheckpointConfig, storage

    shared, local = str(tmp_path / "ckpt"), str(tmp_path / "scratch")
    kinds = {shared: "shared", local: "node_local"}
    monkeypatch.setattr(storage, "find_storage", lambda path, setting: kinds[path])
    policy = storage.CheckpointStorage(CheckpointConfig(ckpt_path=shared))
    assert policy.kind() == "shared"
    with pytest.raises(ConfigError) as err:
        policy.kind(local)
    assert str(err.value) == (f"save_dir={local!r} is invalid: it is node_local storage but "
                              f"ckpt_path {shared} is shared (DeepSpeed is configured for that); "
                              "use a directory of the same kind")
    assert policy.kind(shared) == "shared"
