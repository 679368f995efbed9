"""Damaged files and a full disk: clear errors naming the file, and nothing saved before is lost."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from tests.support.helpers import make_strategy
from tests.support.models import tiny_llama


@pytest.fixture()
def sharded(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(
        tmp_path / "m", max_shard_size="20KB"
    )
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
    with pytest.raises(
        ValueError, match=rf"{victim}: \d+ bytes but its header needs \d+ \(truncated"
    ):
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
    with pytest.raises(
        ValueError,
        match=rf"model.safetensors.index.json names missing shard\(s\) \['{shards[0]}'\]",
    ):
        _load(path)


def _mount_small_disk(mnt, size: int) -> bool:
    """A filesystem of ``size`` bytes at ``mnt``: a tmpfs, or where tmpfs cannot be mounted, an
    ext4 image on a loop device (a real block-backed filesystem that fills up)."""
    tmpfs = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)]
    if subprocess.run(tmpfs, capture_output=True).returncode == 0:
        return True
    image = f"{mnt}.img"
    made = subprocess.run(["mkfs.ext4", "-q", "-F", image, str(max(size // 1024, 512))],
                          capture_output=True).returncode == 0
    return made and subprocess.run(["mount", "-o", "loop", image, str(mnt)]).returncode == 0


def _digests(root) -> dict[str, str]:
    """What an export or checkpoint holds, file by file (contents, not sizes)."""
    import hashlib

    return {os.path.relpath(os.path.join(d, f), root):
            hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(root) for f in files}


@pytest.fixture()
def small_disk(tmp_path):
    """A 600 KB filesystem: room for one tiny export, not for a second beside it."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if not _mount_small_disk(mnt, 600 * 1024):
        pytest.skip("cannot mount a tmpfs or a loop device here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def save_model_on_full_disk(out: str, stage: int) -> str:
    from transformers import AutoModelForCausalLM

    s = make_strategy(stage)
    model = s.from_pretrained(tiny_llama(hidden_size=64, intermediate_size=128))
    engine = s.prepare((model, s.create_optimizer(model), None))
    s.save_model(engine, None, out)  # fits: ~0.4 MB of fp32 weights
    before = _digests(out) if s.is_rank_0 else {}
    big = s.from_pretrained(tiny_llama(hidden_size=64, intermediate_size=256))
    big_engine = s.prepare((big, s.create_optimizer(big), None))
    with pytest.raises(RuntimeError) as err:
        s.save_model(big_engine, None, out)  # the copy beside the old one runs out of space
    s.close()  # drop the ZeRO-3 construction hook before a rank-0-only reload
    if s.is_rank_0:
        assert _digests(out) == before, "the previous export changed"
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        assert reloaded.config.intermediate_size == 128
        assert [
            p for p in os.listdir(os.path.dirname(out)) if p != os.path.basename(out)
        ] == []  # no leftovers
    return str(err.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_save_model_on_full_disk_keeps_previous_export(ranks, small_disk, stage):
    messages = ranks.run(save_model_on_full_disk, str(small_disk / "model"), stage, timeout=120)
    assert messages[0] == messages[1] and "No space left on device" in messages[0], messages
    assert str(small_disk / "model") in messages[0] and "\n" not in messages[0], messages


def _trained_engine(stage: int):
    s = make_strategy(stage)
    model = s.from_pretrained(tiny_llama())
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, s.create_scheduler(optimizer, num_training_steps=10)))
    x = torch.randint(0, 96, (2, 8))
    for _ in range(s.accumulation_steps):
        s.backward(engine(input_ids=x, labels=x).loss, engine)
        s.optimizer_step(engine)
    return s, engine


def checkpoint_size(save_dir: str, stage: int) -> int:
    s, engine = _trained_engine(stage)
    path = s.save_ckpt(engine, save_dir)
    s.close()
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def save_ckpt_on_full_disk(save_dir: str, stage: int) -> str:
    s, engine = _trained_engine(stage)
    first = s.save_ckpt(engine, save_dir, tag="first")
    before = _digests(first)
    with pytest.raises(RuntimeError) as err:
        s.save_ckpt(engine, save_dir, tag="second")
    assert _digests(first) == before, "the earlier checkpoint's files changed"
    loaded = s.load_ckpt(engine, save_dir)  # the earlier checkpoint still loads
    assert loaded.path == first and loaded.resume.tag == "first"
    s.close()
    return str(err.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_save_ckpt_on_full_disk_keeps_previous(ranks, tmp_path, stage):
    size = ranks.run(checkpoint_size, str(tmp_path / "probe"), stage)[0]
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if not _mount_small_disk(mnt, int(size * 1.5)):
        pytest.skip("cannot mount a tmpfs or a loop device here (needs root)")
    try:
        messages = ranks.run(save_ckpt_on_full_disk, str(mnt / "ckpt"), stage, timeout=120)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
    assert messages[0] == messages[1] and "saving checkpoint 'second'" in messages[0], messages
    free = int(re.search(r"; (-?\d+) bytes free\)", messages[0]).group(1))
    assert 0 <= free < size, messages  # the error says how little room was left


def corrupt_checkpoint(save_dir: str, victim: str) -> str:
    s, engine = _trained_engine(2)
    with pytest.raises(RuntimeError) as err:
        s.load_ckpt(engine, save_dir)
    s.close()
    return str(err.value)


def save_for_corruption(save_dir: str) -> list[str]:
    s, engine = _trained_engine(2)
    path = s.save_ckpt(engine, save_dir)
    s.close()
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".pt"))


def test_damaged_checkpoint_file_is_named_on_every_rank(ranks, tmp_path):
    files = ranks.run(save_for_corruption, str(tmp_path / "ckpt"))[0]
    victim = files[-1]
    data = open(victim, "rb").read()
    with open(victim, "wb") as fh:
        fh.write(data[: len(data) // 2])
    messages = ranks.run(corrupt_checkpoint, str(tmp_path / "ckpt"), victim)
    assert all(m.startswith(f"{victim}: damaged or truncated checkpoint file") for m in messages), (
        messages
    )


def test_offline_export_of_a_save_ckpt_checkpoint(ranks, tmp_path):
    """save_ckpt stores config.json beside the weights, so the CLI needs nothing else."""
    from transformers import AutoModelForCausalLM

    from strategy.export.offline import main

    ranks.run(save_for_corruption, str(tmp_path / "ckpt"))
    main([str(tmp_path / "ckpt"), str(tmp_path / "hf")])  # the command line, in this process
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.hidden_size == 32
