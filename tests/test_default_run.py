"""The README's main job end to end: data, 2-rank training (torchrun), fresh-process
reload."""

from __future__ import annotations

import json
import os
import re

import pytest

from strategy.dist import free_port
from tests.support.helpers import run_job


@pytest.mark.slow
def test_default_run_learns_and_reload_agrees(tmp_path):
    out = tmp_path / "default"
    env = {
        **os.environ,
        "OUT": str(out),
        "SKIP_SETUP": "1",
        "MASTER_PORT": str(free_port()),
        "MIN_ACCURACY": "0.5",
    }
    proc = run_job(["bash", "examples/run_default.sh"], 600, env=env)
    tail = proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    acc = float(re.search(r"held-out exact-match accuracy: ([\d.]+)%", proc.stdout).group(1))
    assert acc >= 50.0, tail
    assert re.search(r"agrees with the in-training model on (\d+)/\1 answers", proc.stdout), tail
    rows = [json.loads(line) for line in open(out / "logs" / "metrics.jsonl")]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < 0.1 * losses[0] and all(
        "train/grad_norm" in r and "train/lr" in r for r in rows if "train/loss" in r
    )
    assert (out / "logs" / "loss_curve.png").stat().st_size > 1000
    assert any(
        f.startswith("events.out.tfevents") for f in os.listdir(out / "logs" / "tensorboard")
    )
    assert (out / "model" / "model.safetensors").exists() and (
        out / "model" / "tokenizer.json"
    ).exists()
    print(f"default run: held-out exact match {acc}%")
