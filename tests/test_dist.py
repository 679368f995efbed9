"""2-rank tests of the strategy's rank helpers, ZeRO-3 partitioned loading, loaders and engines."""

from __future__ import annotations

import contextlib
import io

import torch

from tests.support.helpers import gathered_state, make_strategy
from tests.support.models import tiny_llama


def rank_helpers() -> None:
    s = make_strategy(stage=0)
    r, w = s.rank, s.world_size
    assert w == 2 and s.is_rank_0 == (r == 0)
    assert s.all_reduce(float(r + 1)) == 1.5
    assert (
        s.all_reduce(r + 1, op="sum") == 3
        and s.all_reduce(r, op="max") == 1
        and s.all_reduce(r, op="min") == 0
    )
    t = torch.tensor([1.0, 2.0]) * (r + 1)
    assert torch.equal(s.all_reduce(t), torch.tensor([1.5, 3.0])) and torch.equal(
        t, torch.tensor([1.0, 2.0]) * (r + 1)
    )
    assert s.all_reduce({"loss": float(r), "acc": {"n": r + 1}}, op="sum") == {
        "loss": 1.0,
        "acc": {"n": 3.0},
    }
    assert s.all_gather(r * 10) == [0, 10]
    assert torch.equal(
        s.all_gather(torch.full((2, 3), float(r))), torch.cat([torch.zeros(2, 3), torch.ones(2, 3)])
    )
    from strategy.trainers.loop import Largest
    from strategy.trainers.loop.metrics import MetricSums

    sums = MetricSums()  # a step's metrics: means, (sum, count) pairs and maxima, two batches
    sums.add({"loss": float(r), "tokens": (3.0 * r, 3), "gap": Largest(0.5 + 2 * r)})
    sums.add({"loss": 1.0, "tokens": (1.0, 1), "gap": Largest(r + 0.25)})
    sums.add({"loss": 9.0, "tokens": (9.0, 9), "gap": Largest(99.0)}, weight=0)  # a filler
    out, _ = sums.reduce(s)
    assert out == {"loss": 0.75, "tokens": 5.0 / 8, "gap": 2.5}  # the max over both ranks
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        s.print("hello", r)
    assert buf.getvalue() == ("hello 0\n" if r == 0 else "")
    s.barrier()
    import sys

    from strategy import dist

    hooked = sys.excepthook is dist._failure_hook  # setup_distributed installs it
    s.close()
    assert hooked and sys.excepthook is not dist._failure_hook, "close() must remove the hook"


def test_rank_helpers(ranks):
    ranks.run(rank_helpers)


def zero3_partitioned_load(saved_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    s = make_strategy(stage=3)
    if s.is_rank_0:
        torch.manual_seed(3)
        AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(saved_dir)
    s.barrier()
    reference = AutoModelForCausalLM.from_pretrained(saved_dir).state_dict()
    model = s.from_pretrained(saved_dir)
    params = list(model.parameters())
    assert all(p.numel() == 0 for p in params), "ZeRO-3 load must leave only empty local views"
    full = sum(p.ds_numel for p in params)
    local = sum(p.ds_tensor.numel() for p in params)
    assert full == sum(v.numel() for v in reference.values())
    assert local <= full / 2 + 2 * len(params), (local, full)  # each rank holds ~half (+ padding)
    engine = s.prepare((model, s.create_optimizer(model), None))
    state = gathered_state(engine)
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    s.close()
    return {"local": local, "full": full}


def test_zero3_partitions_at_construction(ranks, tmp_path):
    out = ranks.run(zero3_partitioned_load, str(tmp_path / "tiny"))
    assert out[0]["full"] == out[1]["full"] and out[0]["local"] + out[1]["local"] >= out[0]["full"]


def loader_and_eval_engine(stage: int) -> None:
    import deepspeed

    s = make_strategy(stage=stage)
    data = list(range(20))
    seen = [
        x.item() for batch in s.setup_dataloader(data, batch_size=2, shuffle=True) for x in batch
    ]
    everyone = s.all_gather(torch.tensor(seen))
    assert len(seen) == 10 and sorted(everyone.tolist()) == data, (
        "ranks must split the data disjointly"
    )

    model = s.from_pretrained(tiny_llama())
    optimizer = s.create_optimizer(model)
    ref = s.from_pretrained(tiny_llama())
    train, evaluator = s.prepare((model, optimizer, None), ref)
    assert isinstance(train, deepspeed.DeepSpeedEngine) and train.optimizer is not None
    assert evaluator.zero_optimization_stage() == (3 if stage == 3 else 0), (
        evaluator.zero_optimization_stage()
    )
    assert not evaluator.module.training
    x = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        assert torch.isfinite(evaluator(input_ids=x).logits).all()
    s.close()


def test_dataloader_and_eval_engine(ranks):
    for stage in (2, 3):
        ranks.run(loader_and_eval_engine, stage)


def test_failure_hook_chains_to_the_previous_hook_and_is_removed(monkeypatch):
    import sys

    from strategy import dist

    calls = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: calls.append(args[0]))
    previous = sys.excepthook
    monkeypatch.setattr(dist.os, "_exit", lambda code: calls.append(("exit", code)))
    dist.install_failure_hook()
    dist.install_failure_hook()  # twice: still one link in the chain
    assert sys.excepthook is dist._failure_hook
    sys.excepthook(ValueError, ValueError("boom"), None)
    assert calls == [ValueError, ("exit", 1)], calls  # the previous hook ran once, then exit
    dist.remove_failure_hook()
    assert sys.excepthook is previous


RUN_SCRIPT_PROBE = """
import atexit, os, torch.distributed as d
from strategy.dist import run_script

def main():
    d.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    atexit.register(lambda: print("group at exit:", d.is_initialized()))

run_script(main)
"""


def test_a_launched_script_ends_its_process_group_before_the_interpreter_teardown():
    """Left to the interpreter's teardown, gloo's threads now and then abort a finished rank
    (exit -6): ``run_script``, every trainer's ``__main__``, ends the group first."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RUN_SCRIPT_PROBE], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "group at exit: False" in done.stdout, done.stdout + done.stderr[-2000:]


def test_every_launched_script_runs_through_run_script():
    """The scripts the launchers start (``-m strategy.cli.train_*``, the default job) end their
    group as above; ``train_ppo_ray`` only drives Ray and starts no group."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "strategy"
    scripts = [*sorted((root / "cli").glob("train_*.py")), root / "demos" / "train_default.py"]
    plain = [p.name for p in scripts if p.name != "train_ppo_ray.py"
             and not p.read_text().endswith('if __name__ == "__main__":\n    run_script(main)\n')]
    assert len(scripts) == 11 and not plain, plain


def played_apart(fail_rank: int | None) -> dict:
    """A thread playing ahead (``Played``) whose collectives go over ``strategy.apart``'s group
    while the main thread runs its own on the default one; ``fail_rank`` raises inside a
    ``checked`` on the thread."""
    from strategy.trainers.algorithms.ahead import Played

    s = make_strategy(stage=0)
    apart = s.apart()

    def broke() -> None:
        if s.rank == fail_rank:
            raise ValueError("the environment broke")

    def play() -> float:
        with apart():
            total = sum(s.all_reduce(float(s.rank + i), op="sum") for i in range(50))
            s.checked(broke)
            return total + len(s.all_gather_object(s.rank))

    played = Played(play, 60)
    main = sum(s.all_reduce(float(i * (s.rank + 1)), op="max") for i in range(50))
    try:
        out, error = played.wait(), None
    except Exception as exc:  # noqa: BLE001 - what every rank raises is the result
        out, error = None, f"{type(exc).__name__}: {exc}"
    s.close()
    return {"out": out, "main": main, "error": error}


def test_a_thread_apart_keeps_its_collectives_from_the_main_threads_and_one_error_line(ranks):
    """``strategy.apart``: a thread's 50 all-reduces (sums) and a gather run over a group of
    their own while the main thread runs 50 of its own (maxima) at the same time; each side gets
    its own results. An error on rank 1 inside a ``checked`` on the thread reaches ``Played.wait``
    on every rank as the one line the thread's collective made (not wrapped again)."""
    for out in ranks.run(played_apart, None):
        assert out == {"out": sum(2 * i + 1 for i in range(50)) + 2,
                       "main": sum(2 * i for i in range(50)), "error": None}
    for out in ranks.run(played_apart, 1):
        assert out["error"] == "RankFailedError: rank 1: ValueError: the environment broke", out
