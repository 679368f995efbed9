"""Damaged files and a full disk: clear errors naming the file, and nothing saved before is lost."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from tests.helpers import make_strategy
from tests.models import tiny_llama


@pytest.fixture()
def sharded(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(tmp_path / "m", max_shard_size="20KB")
    shards = sorted(p for p in os.listdir(tmp_path / "m") if p.endswith(".safetensors"))
    assert len(shards) >= 3
    return tmp_path / "m", shards


def _load(path):
    from strategy import DeepSpeedStrategy, StrategyConfig

    return DeepSpeedStrategy(StrategyConfig(zero_stage=0)).from_pretrained(str(path))


def test_truncated_shard_names_the_file(sharded):
    path, shards = sharded
    victim = path / shards[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=rf"{victim}: \d+ bytes but its header needs \d+ \(truncated"):
        _load(path)
    victim.write_bytes(data[:4])
    with pytest.raises(ValueError, match=rf"{victim}: truncated"):
        _load(path)
    victim.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match=rf"{victim}: corrupt safetensors header"):
        _load(path)


def test_missing_shard_names_the_index(sharded):
    path, shards = sharded
    os.remove(path / shards[0])
    with pytest.raises(ValueError, match=rf"model.safetensors.index.json names missing shard\(s\) \['{shards[0]}'\]"):
        _load(path)


@pytest.fixture()
def small_disk(tmp_path):
    """A 600 KB tmpfs: room for one tiny export, not for a second beside it."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def save_model_on_full_disk(out: str, stage: int) -> str:
    from transformers import AutoModelForCausalLM

    s = make_strategy(stage)
    model = s.from_pretrained(tiny_llama(hidden_size=64, intermediate_size=128))
    engine = s.prepare((model, s.create_optimizer(model), None))
    s.save_model(engine, None, out)  # fits: ~0.4 MB of fp32 weights
    before = {f: os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)} if s.is_rank_0 else {}
    big = s.from_pretrained(tiny_llama(hidden_size=64, intermediate_size=256))
    big_engine = s.prepare((big, s.create_optimizer(big), None))
    with pytest.raises(RuntimeError) as err:
        s.save_model(big_engine, None, out)  # the copy beside the old one runs out of space
    s.close()  # drop the ZeRO-3 construction hook before a rank-0-only reload
    if s.is_rank_0:
        after = {f: os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)}
        assert after == before, "the previous export changed"
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        assert reloaded.config.intermediate_size == 128
        assert [p for p in os.listdir(os.path.dirname(out)) if p != os.path.basename(out)] == []  # no leftovers
    return str(err.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_save_model_on_full_disk_keeps_previous_export(ranks, small_disk, stage):
    messages = ranks.run(save_model_on_full_disk, str(small_disk / "model"), stage, timeout=120)
    assert messages[0] == messages[1] and "No space left on device" in messages[0], messages
    assert str(small_disk / "model") in messages[0] and "\n" not in messages[0], messages
