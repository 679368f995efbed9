"""The shard writer and the atomic directory, single process; and a save killed part way."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest
import torch

from strategy.atomic_fs import atomic_directory
from strategy.export.shards import ShardWriter, TensorSpec, parse_size, plan_shards
from tests.support.forked import run_forked


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5kb") == 1500
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("5 bananas")


def test_plan_is_greedy_and_isolates_oversized_tensors():
    specs = [
        TensorSpec(n, (s,), torch.float32)
        for n, s in [("a", 10), ("b", 10), ("big", 100), ("c", 5)]
    ]
    plan = plan_shards(specs, max_shard_bytes=80)
    assert [[s.name for s in shard] for shard in plan.shards] == [["a", "b"], ["big"], ["c"]]
    assert plan.filenames() == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_writer_matches_safetensors_reader(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "w": torch.randn(3, 5),
        "h": torch.randn(7, dtype=torch.bfloat16).to(torch.float16),
        "b": torch.randn(4, 2).to(torch.bfloat16),
        "ids": torch.arange(6).reshape(2, 3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False]),
        "t": torch.randn(4, 6).t(),
    }  # not contiguous
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    plan = plan_shards(specs, 40)
    writer = ShardWriter(tmp_path, plan)
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    loaded = {}
    for name in plan.filenames():
        loaded.update(load_file(tmp_path / name))
    assert loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    assert (tmp_path / "model.safetensors.index.json").is_file()


def test_writer_converts_dtype_and_rejects_out_of_order(tmp_path):
    from safetensors.torch import load_file

    plan = plan_shards(
        [TensorSpec("a", (2,), torch.bfloat16), TensorSpec("b", (2,), torch.float32)], 10**6
    )
    writer = ShardWriter(tmp_path, plan)
    with pytest.raises(RuntimeError, match="out of plan order"):
        writer.write("b", torch.ones(2))
    writer.write("a", torch.tensor([1.0, 1 / 3]))
    writer.write("b", torch.ones(2))
    writer.close()
    out = load_file(tmp_path / "model.safetensors")
    assert out["a"].dtype == torch.bfloat16 and out["a"][1] == torch.tensor(1 / 3).to(
        torch.bfloat16
    )
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_atomic_directory_keeps_earlier_export_on_error(tmp_path):
    final = tmp_path / "out"
    with atomic_directory(final) as d:
        (d / "f").write_text("old")
    with pytest.raises(KeyError):
        with atomic_directory(final) as d:
            (d / "f").write_text("new")
            raise KeyError("boom")
    assert (final / "f").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with atomic_directory(final) as d:
        (d / "g").write_text("new")
    assert [p.name for p in final.iterdir()] == ["g"], "the earlier export is replaced as a whole"


# ------------------------------------------------------------------ a save killed part way
def _save_then_die(point: str, n: int, out: str) -> None:
    """In a forked child: save the export, SIGKILLed at ``point`` (after ``n`` tensors for
    ``write``)."""
    from transformers import AutoModelForCausalLM

    import strategy.atomic_fs as afs
    import strategy.export.save as ex
    import strategy.export.shards as sh
    from tests.support.models import tiny_llama

    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(tiny_llama())

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "write":
        orig, count = sh.ShardWriter.write, [0]

        def write(self, name, t):
            count[0] += 1
            if count[0] > n:
                die()
            orig(self, name, t)

        sh.ShardWriter.write = write
    elif point == "metadata":
        ex.write_export_metadata = die
    elif point == "publish":
        afs.publish_dir = die
    ex.save_model(model, None, out, max_shard_size="20KB")
    print("save finished")


def _kill_save(point: str, n: int, out: Path) -> None:
    child = run_forked(_save_then_die, point, n, str(out), timeout=120,
                       env={"RANK": "0", "WORLD_SIZE": "1"})
    assert child.returncode == -signal.SIGKILL, (
        f"child was not killed ({child.returncode}): {child.text()[-2000:]}"
    )


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _save(seed: int, out: Path):
    from transformers import AutoModelForCausalLM

    from strategy.export import save_model
    from tests.support.models import tiny_llama

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama()).eval()
    save_model(model, None, out, max_shard_size="20KB")
    return model


@pytest.mark.slow
def test_killed_save_leaves_previous_export(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "export"
    _kill_save("write", 3, out)  # the very first save dies: nothing may appear at output_dir
    assert not out.exists()
    model = _save(1, out)
    before = _digest(out)
    for point, n in [("write", 0), ("write", 1), ("write", 12), ("metadata", 0), ("publish", 0)]:
        _kill_save(point, n, out)
        assert _digest(out) == before, f"killed at {point}:{n}, the earlier export changed"
        assert any(p.name.startswith(".export.tmp-") for p in tmp_path.iterdir()), (
            "no partial sibling?"
        )
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(
            AutoModelForCausalLM.from_pretrained(out).eval()(x).logits, model(x).logits
        )
    newer = _save(3, out)  # the next save succeeds and removes the leftovers
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    with torch.no_grad():
        assert torch.equal(
            AutoModelForCausalLM.from_pretrained(out).eval()(x).logits, newer(x).logits
        )
