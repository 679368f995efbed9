"""Resume checkpoints: exact resume at ZeRO 0-3, retention, tag safety, crash safety (kill test) and
resume on another world size, on the real DeepSpeed engine."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import time

import pytest
import torch

from tests.support.forked import Forked, forked
from tests.support.helpers import gathered_state, kill_group, make_strategy
from tests.support.models import VOCAB, tiny_gpt2, tiny_llama

STEPS = 8  # optimizer steps of the uninterrupted run; the interrupted one stops after STEPS // 2
# 5 steps of 8 samples per epoch: the stop (step 4) is mid-epoch and the run crosses an epoch
SAMPLES = 40
# World-size change: the same global batches, but gradients are summed over ranks in another order
# and
# the per-rank micro-batch losses averaged by another accumulation split, so fp32 rounding differs.
# Measured gaps: 3e-8 to 8e-8 relative. 1e-5 leaves room for that rounding yet catches subtle
# errors:
# losing the no-decay parameter group's weight_decay=0 (DeepSpeed's ZeRO-3 universal load copies
# group
# 0's settings to every group) moved the loss by 3.6e-5.
WORLD_CHANGE_RTOL = 1e-5


class IndexedTokens(torch.utils.data.Dataset):
    """Fixed random token rows that also report their index, so tests can see what each rank got."""

    def __init__(self, n: int = SAMPLES, seq: int = 16) -> None:
        self.x = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "idx": i}


@contextlib.contextmanager
def only_weights_only_loads():
    """Fails any ``torch.load`` that is not ``weights_only`` inside the block: DeepSpeed's own
    loads must all go through the scoped safe load, never reach torch's with pickles allowed."""
    original = torch.load

    def guarded(*args, **kwargs):
        assert kwargs.get("weights_only") is True, f"torch.load{args[:1]} without weights_only"
        return original(*args, **kwargs)

    torch.load = guarded
    try:
        yield
    finally:
        torch.load = original


def train(
    stage: int,
    ckpt_dir: str,
    family: str = "gpt2",
    stop_at: int | None = None,
    resume: bool = False,
    init_seed: int = 0,
    tag: str | None = None,
    bf16: bool = False,
    offload: bool = False,
    optimizer: str | None = None,
) -> dict:
    """Train up to STEPS optimizer steps like a trainer would, optionally resuming first / saving at
    ``stop_at``."""
    s = make_strategy(
        stage, bf16=bf16, offload=offload, micro=2, total=8, optimizer=optimizer or "fused_adam"
    )
    torch.manual_seed(
        init_seed
    )  # a resumed run starts from other weights: only the checkpoint can fix that
    model = s.from_pretrained(tiny_gpt2() if family == "gpt2" else tiny_llama())
    opt = s.create_optimizer(model)
    engine = s.prepare((model, opt, s.create_scheduler(opt, num_training_steps=STEPS)))
    engine.train()  # GPT-2's dropout draws from the RNG: an exact resume needs its state restored
    loader = s.setup_dataloader(IndexedTokens())
    state, rs = {}, None
    if resume:
        with only_weights_only_loads():
            loaded = s.load_ckpt(engine, ckpt_dir, dataloader=loader)
        path, state = loaded
        assert path is not None, f"nothing to resume in {ckpt_dir}"
        rs = loaded.resume
    epoch, consumed = (rs.epoch, rs.epoch_consumed) if rs else (0, 0)
    losses, seen, lrs = {}, {}, {}
    while engine.global_steps < STEPS:
        loader.sampler.set_epoch(epoch, consumed)
        consumed = 0
        for batch in loader:
            x, step = (
                batch["input_ids"],
                engine.global_steps + 1,
            )  # the optimizer step this micro-batch feeds
            loss = engine(input_ids=x, labels=x).loss
            s.backward(loss, engine)
            s.optimizer_step(engine)
            losses.setdefault(step, []).append(loss.item())
            seen.setdefault(step, []).extend(batch["idx"].tolist())
            lrs[step] = engine.get_lr()[0]
            if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
                if step == stop_at:
                    s.save_ckpt(
                        engine,
                        ckpt_dir,
                        tag=tag,
                        client_state={"note": f"stopped at {step}", "step": step},
                    )
                    return _finish(s, engine, losses, seen, lrs, state, rs)
                if step >= STEPS:
                    break
        epoch += 1
    return _finish(s, engine, losses, seen, lrs, state, rs)


def _finish(s, engine, losses, seen, lrs, state, resume) -> dict:
    weights, master = gathered_state(engine), _fp32_master(engine)
    optimizer = type(
        getattr(engine.optimizer, "optimizer", engine.optimizer)
    ).__name__  # under a ZeRO wrapper
    s.close()
    return {
        "losses": {k: sum(v) / len(v) for k, v in losses.items()},
        "seen": seen,
        "lrs": lrs,
        "weights": weights,
        "master": master,
        "state": state,
        "resume": resume,
        "rng": (random.random(), torch.rand(1).item()),
        "optimizer": optimizer,
        "dtype": next(engine.module.parameters()).dtype,
    }


def _fp32_master(engine) -> list[torch.Tensor]:
    """This rank's fp32 master partitions (ZeRO-1/2, ZeRO-3 or bf16 ZeRO-0); [] where the model is
    the master."""
    opt = engine.optimizer
    for attr in (
        "single_partition_of_fp32_groups",
        "fp32_partitioned_groups_flat",
        "fp32_groups_flat_partition",
    ):
        if getattr(opt, attr, None):
            return [t.detach().float().clone() for t in getattr(opt, attr)]
    return []


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_exact_resume(ranks, tmp_path, stage):
    ckpt = str(tmp_path / "ckpt")
    full = ranks.run(train, stage, ckpt)
    first = ranks.run(train, stage, ckpt, stop_at=STEPS // 2)
    second = ranks.run(train, stage, ckpt, resume=True, init_seed=123)
    for rank in range(2):
        f, a, b = full[rank], first[rank], second[rank]
        assert b["state"] == {"note": f"stopped at {STEPS // 2}", "step": STEPS // 2}, b["state"]
        assert (b["resume"].global_step, b["resume"].consumed_samples) == (
            STEPS // 2,
            STEPS // 2 * 8,
        )
        assert (b["resume"].epoch, b["resume"].epoch_consumed) == (0, 32)
        resumed = {**a["losses"], **b["losses"]}
        assert resumed == f["losses"], (resumed, f["losses"])  # bit-identical fp32 losses
        assert {**a["seen"], **b["seen"]} == f["seen"], (
            "the data a rank saw after the resume differs"
        )
        assert {**a["lrs"], **b["lrs"]} == f["lrs"]
        for name, value in f["weights"].items():
            assert torch.equal(value, b["weights"][name]), f"{name} differs after resume"
        assert b["rng"] == f["rng"], "RNG streams differ after the resume"
    assert full[0]["seen"][1] != full[1]["seen"][1], "ranks must see different data"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_exact_resume_bf16(ranks, tmp_path, stage):
    """bf16 weights with fp32 master weights: the checkpoint must bring back the fp32 masters (not
    re-derive them from the bf16 weights) for the resumed run to go on bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    full = ranks.run(train, stage, ckpt, bf16=True)
    first = ranks.run(train, stage, ckpt, stop_at=STEPS // 2, bf16=True)
    second = ranks.run(train, stage, ckpt, resume=True, init_seed=123, bf16=True)
    for rank in range(2):
        f, a, b = full[rank], first[rank], second[rank]
        assert (b["resume"].global_step, b["resume"].epoch_consumed) == (STEPS // 2, 32)
        assert {**a["losses"], **b["losses"]} == f["losses"], (
            a["losses"],
            b["losses"],
            f["losses"],
        )
        assert {**a["seen"], **b["seen"]} == f["seen"] and {**a["lrs"], **b["lrs"]} == f["lrs"]
        assert f["dtype"] == b["dtype"] == torch.bfloat16, "the model does not train in bf16"
        assert all(w.dtype == torch.float32 for w in f["master"]) and f["master"], (
            "no fp32 master weights?"
        )
        for i, (want, got) in enumerate(zip(f["master"], b["master"], strict=True)):
            assert torch.equal(want, got), f"fp32 master partition {i} differs after resume"
        for name, value in f["weights"].items():
            assert torch.equal(value, b["weights"][name]), f"bf16 {name} differs after resume"
        assert b["rng"] == f["rng"], "RNG streams differ after the resume"
    assert f["losses"][STEPS] < f["losses"][1], "loss did not fall"


def test_nothing_to_resume_and_refused_calls(ranks, tmp_path):
    out = ranks.run(_load_empty, str(tmp_path / "none"))
    assert out == [(None, {}, None)] * 2


def test_loader_iteration_leaves_global_rng_alone():
    """A mid-epoch resume starts a new loader iterator where the uninterrupted run did not: if
    iter() drew from the global torch RNG, every later dropout mask would shift by one draw."""
    from strategy import DeepSpeedStrategy, StrategyConfig

    loader = DeepSpeedStrategy(
        StrategyConfig(micro_train_batch_size=2, train_batch_size=2)
    ).setup_dataloader(IndexedTokens())
    before = torch.get_rng_state()
    next(iter(loader))
    assert torch.equal(before, torch.get_rng_state())


def _load_empty(ckpt_dir: str):
    s = make_strategy(2)
    model = s.from_pretrained(tiny_llama())
    opt = s.create_optimizer(model)
    engine = s.prepare((model, opt, None))
    loaded = s.load_ckpt(engine, ckpt_dir)
    out = (*loaded, loaded.resume)
    from strategy.errors import ConfigError

    with pytest.raises(
        ConfigError, match="tag='nope'"
    ):  # on every rank, not only on rank 0 (no hang)
        s.load_ckpt(engine, ckpt_dir, tag="nope")
    x = torch.randint(0, VOCAB, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    # the first of 2 accumulation micro-steps: its gradients would not be in a checkpoint
    engine.step()
    with pytest.raises(ConfigError, match="save_ckpt=.*accumulation boundary"):
        s.save_ckpt(engine, ckpt_dir)
    with pytest.raises(ConfigError, match="tag='../up'"):
        s.save_ckpt(engine, ckpt_dir, tag="../up")
    assert not os.path.exists(ckpt_dir), "a refused save must write nothing"
    s.close()
    return out


# ------------------------------------------------------------ tags, retention and crash safety (no
# engine)


@pytest.mark.parametrize(
    "tag",
    [
        "../escape",
        "/abs",
        "a/b",
        "a\\b",
        ".hidden",
        "..",
        "",
        "latest",
        "step1_hf",
        "x" * 201,
        "a b",
    ],
)
def test_tag_cannot_escape_or_collide(tag):
    from strategy.checkpoint import validate_tag
    from strategy.errors import ConfigError

    with pytest.raises(ConfigError, match="tag="):
        validate_tag(tag)


def test_good_tags_pass():
    from strategy.checkpoint import validate_tag

    for tag in ["global_step10", "epoch1.step3", "best-0.5", "run=a+b"]:
        assert validate_tag(tag) == tag


def _entry(name, order, size=1, is_ckpt=True, metric=None):
    from strategy.checkpoint.layout import Entry

    return Entry(name, order, size, [name], is_ckpt, metric)


def test_retention_keeps_newest_max_num():
    from strategy.checkpoint.retention import select_for_deletion

    entries = [_entry(f"s{i}", i) for i in range(5)]
    assert [e.name for e in select_for_deletion(entries, 3, 1e9)] == ["s0", "s1"]
    assert select_for_deletion(entries, 5, 1e9) == []


def test_retention_max_mem_counts_exports_and_protects_newest():
    from strategy.checkpoint.retention import select_for_deletion

    entries = [
        _entry("s0", 0, 10),
        _entry("export_hf", 1, 30, is_ckpt=False),
        _entry("s2", 2, 10),
        _entry("s3", 3, 100),
    ]
    # 150 bytes > 60: drop oldest first (the orphan export counts), never the newest even if it
    # alone exceeds
    assert [e.name for e in select_for_deletion(entries, 10, 60)] == ["s0", "export_hf", "s2"]
    assert [e.name for e in select_for_deletion(entries, 10, 120)] == ["s0", "export_hf"]
    # max_num counts checkpoints only: a surplus of checkpoints does not delete orphan exports
    assert [e.name for e in select_for_deletion(entries, 2, 1e9)] == ["s0"]


def test_retention_keeps_best_k():
    from strategy.checkpoint.retention import select_for_deletion

    entries = [
        _entry("s0", 0, metric=0.5),
        _entry("s1", 1, metric=0.1),
        _entry("s2", 2, metric=0.9),
        _entry("s3", 3, metric=0.7),
    ]
    assert [e.name for e in select_for_deletion(entries, 2, 1e9, keep_best=1)] == [
        "s0",
        "s2",
    ]  # keeps s1 (min)
    assert [
        e.name for e in select_for_deletion(entries, 2, 1e9, keep_best=1, higher_is_better=True)
    ] == ["s0", "s1"]
    # the 2 best (s1, s0) and the newest (s3) are protected even though that leaves 3 > max_num=1
    assert [e.name for e in select_for_deletion(entries, 1, 1e9, keep_best=2)] == ["s2"]


def _fake_ckpt(root, tag, saved_at, size=100):
    import json

    d = root / tag
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x" * size)
    (d / "strategy_state.json").write_text(json.dumps({"tag": tag, "saved_at": saved_at}))
    return d


def test_resolve_tag_ignores_partial_and_broken_pointer(tmp_path):
    from strategy.checkpoint import resolve_tag

    assert resolve_tag(str(tmp_path), None) is None
    _fake_ckpt(tmp_path, "s1", 1)
    _fake_ckpt(tmp_path, "s2", 2)
    (tmp_path / "s3").mkdir()  # a save killed before it was marked complete
    (tmp_path / ".incomplete" / "s4").mkdir(parents=True)
    (tmp_path / "latest").write_text("s3")
    assert (
        resolve_tag(str(tmp_path), None) == "s2"
    )  # latest points at a partial one: newest complete wins
    (tmp_path / "latest").write_text("s1")
    assert (
        resolve_tag(str(tmp_path), None) == "s1"
    )  # an explicit choice of an older complete one is kept
    from strategy.errors import ConfigError

    with pytest.raises(ConfigError, match="tag='s3'.*no complete checkpoint"):
        resolve_tag(str(tmp_path), "s3")


def test_common_tag_over_node_local_copies(tmp_path):
    """Each node's view (the tag ``latest`` names, complete tags): the newest complete on all."""
    from strategy.checkpoint.tags import resolve_common_tag
    from strategy.errors import ConfigError

    both = [("s2", ["s1", "s2"]), ("s2", ["s1", "s2"])]
    assert resolve_common_tag(both, "d", None) == "s2"
    killed = [("s3", ["s1", "s2", "s3"]), ("s2", ["s1", "s2"])]  # node 1 died saving s3
    assert resolve_common_tag(killed, "d", None) == "s2"
    assert resolve_common_tag([(None, ["s1"]), (None, [])], "d", None) is None
    assert resolve_common_tag(killed, "d", "s1") == "s1"
    with pytest.raises(ConfigError, match=r"tag='s3' is invalid: d holds no checkpoint of that "
                       r"name complete on every node; use one of \['s1', 's2'\]"):
        resolve_common_tag(killed, "d", "s3")


def test_publish_replaces_a_resaved_tag_whole(tmp_path):
    from strategy.checkpoint import resolve_tag
    from strategy.checkpoint.save import publish as _publish

    _fake_ckpt(tmp_path, "s1", 1, size=10)
    staged = tmp_path / ".incomplete" / "s1"
    staged.mkdir(parents=True)
    (staged / "mp_rank_00_model_states.pt").write_bytes(b"new")
    (tmp_path / ".incomplete" / "zero_to_fp32.py").write_text("# DeepSpeed's script")
    _publish(str(tmp_path), str(staged), "s1", {"tag": "s1", "saved_at": 2})
    assert (tmp_path / "s1" / "mp_rank_00_model_states.pt").read_bytes() == b"new"
    assert (tmp_path / "zero_to_fp32.py").is_file() and not staged.exists()
    assert resolve_tag(str(tmp_path), None) == "s1" and (tmp_path / "latest").read_text() == "s1"


def test_scan_groups_hf_exports_with_their_checkpoint(tmp_path):
    from strategy.checkpoint import Retention
    from strategy.checkpoint.layout import scan
    from strategy.checkpoint.retention import apply_retention

    _fake_ckpt(tmp_path, "s1", 1)
    _fake_ckpt(tmp_path, "s2", 2)
    (tmp_path / "s1_hf").mkdir()
    (tmp_path / "s1_hf" / "model.safetensors").write_bytes(b"y" * 1000)
    (tmp_path / "other").mkdir()  # not ours: never counted or deleted
    (tmp_path / "other" / "data.bin").write_bytes(b"z" * 10**4)
    entries = {e.name: e for e in scan(str(tmp_path))}
    assert set(entries) == {"s1", "s2"} and entries["s1"].size > 1000
    assert apply_retention(str(tmp_path), Retention(max_num=1, max_mem=1.0)) == ["s1"]
    assert sorted(os.listdir(tmp_path)) == [".incomplete", "other", "s2"]


# ------------------------------------------------------------ kill test: real processes, SIGKILL
# mid-save

WORKER = os.path.join(os.path.dirname(__file__), "scripts", "ckpt_worker.py")
# where a save can die, in order, and whether the save in flight is the one a restart must load
MARKERS = [("before_files", False), ("mid_shard", False), ("shards_done", False),
           ("mid_publish", False), ("published", True)]


def _start_worker(ckpt_dir: str, max_saves: int | None = None,
                  pause_at: str | None = None) -> Forked:
    """The worker's ``main`` in a forked child of this process (its own session, one rank)."""
    import importlib.util

    from strategy.dist import free_port

    spec = importlib.util.spec_from_file_location("ckpt_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PAUSE_AT": pause_at or ""}
    return forked(worker.main, ckpt_dir, max_saves or 10**9, env=env)


def _read_until(proc: Forked, prefix: str, log: list[str], timeout: float = 240) -> list:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = proc.lines.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            kill_group(proc)
            raise AssertionError(f"no {prefix!r} within {timeout}s (worker killed):\n"
                                 + "".join(log[-40:])) from None
        if line is None:
            raise AssertionError(f"worker exited ({proc.wait()}) before {prefix!r}:\n"
                                 + "".join(log[-40:]))
        log.append(line)
        if line.startswith(prefix):
            return line.split()[1:]


@pytest.mark.slow
def test_killed_save_leaves_last_complete_checkpoint(tmp_path):
    """SIGKILL the saving process at each point a save passes through (the worker stops at a marker
    it prints from inside the save); each restart must load the last complete checkpoint (the
    worker checks its weights digest and step) and train on."""
    ckpt = str(tmp_path / "ckpt")
    staging = os.path.join(ckpt, ".incomplete")
    expected, log, seen = 0, [], set()
    for marker, in_flight_complete in MARKERS:
        proc = _start_worker(ckpt, pause_at=marker)
        try:
            resumed = int(_read_until(proc, "RESUMED", log)[0])
            assert resumed == expected, f"{marker} kill: resumed {resumed}, not {expected}"
            done = int(_read_until(proc, "SAVED", log)[0])  # a first save completes
            _read_until(proc, "PAUSED", log)  # the second stops inside, at the marker
            in_flight = int([ln for ln in log if ln.startswith(f"MARK {marker}")][-1].split()[2])
            seen.add(marker)
            left_partial = os.path.isdir(staging) and bool(os.listdir(staging))
        finally:
            kill_group(proc)
            proc.wait()
        expected = in_flight if in_flight_complete else done
        if marker != "before_files":
            assert left_partial or marker == "published", f"{marker}: nothing was staged?"
    assert seen == {name for name, _ in MARKERS}, f"markers never reached: {seen}"
    proc = _start_worker(ckpt, max_saves=2)
    try:
        resumed = int(_read_until(proc, "RESUMED", log)[0])
        assert resumed == expected, f"resumed step {resumed}, expected {expected}"
        _read_until(proc, "DONE", log)
        assert proc.wait(timeout=60) == 0
    finally:
        kill_group(proc)
    assert os.listdir(staging) == [], "the partial directory of a killed save was not cleaned"
    kept = sorted(n for n in os.listdir(ckpt) if n.startswith("global_step"))
    assert len(kept) == 2 and f"global_step{resumed + 2}" in kept, kept


# ------------------------------------------------------------ another world size (universal
# checkpoint)


def _global_losses(out: list[dict]) -> dict[int, float]:
    """Per-step loss over all ranks (every rank runs equal micro-batches, so the mean of rank
    means)."""
    return {k: sum(o["losses"][k] for o in out) / len(out) for k in out[0]["losses"]}


def _global_seen(out: list[dict]) -> dict[int, list[int]]:
    return {k: sorted(i for o in out for i in o["seen"][k]) for k in out[0]["seen"]}


WORLD_CASES = [(stage, a, b) for stage in (2, 3) for a, b in ((2, 1), (1, 2))]


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,saved_on,resumed_on", WORLD_CASES, ids=[f"zero{s}-{a}to{b}" for s, a, b in WORLD_CASES]
)
def test_resume_on_another_world_size(ranks, tmp_path, stage, saved_on, resumed_on):
    ckpt = str(tmp_path / "ckpt")
    full = ranks.run(train, stage, ckpt + "-unused", family="llama", world_size=saved_on)
    first = ranks.run(train, stage, ckpt, family="llama", stop_at=STEPS // 2, world_size=saved_on)
    second = ranks.run(
        train, stage, ckpt, family="llama", resume=True, init_seed=123, world_size=resumed_on
    )
    assert os.path.isdir(os.path.join(ckpt, f"global_step{STEPS // 2}", "universal")), (
        "no universal conversion"
    )
    for b in second:
        assert b["state"] == {"note": f"stopped at {STEPS // 2}", "step": STEPS // 2}
        assert (b["resume"].global_step, b["resume"].epoch, b["resume"].epoch_consumed) == (
            STEPS // 2,
            0,
            32,
        )
    # the same global batches, step for step, whatever the number of ranks
    assert {**_global_seen(first), **_global_seen(second)} == _global_seen(full)
    ref, got = _global_losses(full), {**_global_losses(first), **_global_losses(second)}
    gaps = {k: abs(got[k] - ref[k]) / abs(ref[k]) for k in ref}
    print(
        f"zero{stage} {saved_on}->{resumed_on} ranks: "
        f"max relative loss gap {max(gaps.values()):.2e}"
    )
    assert max(gaps.values()) <= WORLD_CHANGE_RTOL, gaps
    assert got[STEPS] < got[1], "loss did not fall"
    assert {**first[0]["lrs"], **second[0]["lrs"]} == pytest.approx(full[0]["lrs"], rel=1e-6)
    for name, value in full[0]["weights"].items():
        torch.testing.assert_close(
            second[0]["weights"][name],
            value,
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )


# ------------------------------------------------------------ retention on real checkpoints


def _retention_body(ckpt_dir: str) -> list:
    from strategy.checkpoint import Retention
    from strategy.checkpoint.layout import dir_size
    from strategy.checkpoint.retention import GIB

    s = make_strategy(2, micro=2, total=4)
    model = s.from_pretrained(tiny_llama())
    opt = s.create_optimizer(model)
    engine = s.prepare((model, opt, None))
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(s.rank))
    listings = []

    def step_save_export(**kw):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        tag = f"global_step{engine.global_steps}"
        s.save_ckpt(engine, ckpt_dir, **kw)
        if s.is_rank_0:  # what a trainer's HF export beside the checkpoint looks like
            engine.module.save_pretrained(os.path.join(ckpt_dir, f"{tag}_hf"))
        s.barrier()
        listings.append(
            sorted(
                n for n in os.listdir(ckpt_dir) if not n.startswith(".") and not n.endswith(".py")
            )
        )

    if s.is_rank_0:  # an HF export of its own (no checkpoint), older than every checkpoint
        engine.module.save_pretrained(os.path.join(ckpt_dir, "export_hf"))
    s.barrier()
    for k in range(4):  # step 2 has the best (lowest) metric
        step_save_export(retention=Retention(max_num=2, keep_best=1), metric=abs(k - 1) + 0.5)
    one = dir_size(os.path.join(ckpt_dir, "global_step4")) + dir_size(
        os.path.join(ckpt_dir, "global_step4_hf")
    )
    # room for about one checkpoint with its export
    step_save_export(retention=Retention(max_num=10, max_mem=1.5 * one / GIB))
    s.close()
    return listings


@pytest.mark.slow
def test_retention_max_num_best_k_and_max_mem(ranks, tmp_path):
    listings = ranks.run(_retention_body, str(tmp_path / "ckpt"))[0]
    base = ["export_hf", "latest"]
    assert listings[1] == sorted(
        base + ["global_step1", "global_step1_hf", "global_step2", "global_step2_hf"]
    )
    # max_num=2 with keep_best=1: the best (step 2) and the newest stay; step 1 goes with its HF
    # export
    assert listings[2] == sorted(
        base + ["global_step2", "global_step2_hf", "global_step3", "global_step3_hf"]
    )
    assert listings[3] == sorted(
        base + ["global_step2", "global_step2_hf", "global_step4", "global_step4_hf"]
    )
    # a tiny max_mem leaves only the newest checkpoint (its export is written after the save)
    assert listings[4] == ["global_step5", "global_step5_hf", "latest"]


# ------------------------------------------------------------ re-saved tags, pickle payloads


class _Payload:
    """Unpickling this would create a file (what a crafted checkpoint could do instead)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _digests(path: str) -> dict[str, str]:
    import hashlib

    return {os.path.relpath(os.path.join(d, f), path):
            hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(path) for f in files}


def resave_and_payload(ckpt_dir: str, marker: str) -> dict:
    import strategy.checkpoint.save as save_module
    from strategy.errors import CheckpointFileError

    s = make_strategy(2, micro=2, total=4)
    model = s.from_pretrained(tiny_llama())
    optimizer = s.create_optimizer(model)
    engine = s.prepare((model, optimizer, None))
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(s.rank))

    def step() -> None:
        s.backward(engine(input_ids=x, labels=x).loss, engine)
        s.optimizer_step(engine)

    step()
    path = s.save_ckpt(engine, ckpt_dir, tag="kept")
    before = _digests(path)
    step()
    publish_dir = save_module.publish_dir

    def dies_before_the_swap(*args):
        raise OSError("injected: the disk went away before the swap")

    save_module.publish_dir = dies_before_the_swap
    try:
        with pytest.raises(OSError, match="injected"):  # on every rank
            s.save_ckpt(engine, ckpt_dir, tag="kept")
    finally:
        save_module.publish_dir = publish_dir
    unchanged = _digests(path) == before
    s.save_ckpt(engine, ckpt_dir, tag="kept")  # now it goes through: replaced whole
    replaced = _digests(path) != before
    if s.is_rank_0:
        states = os.path.join(path, "mp_rank_00_model_states.pt")
        saved = torch.load(states, weights_only=False)
        saved["extra"] = _Payload(marker)
        torch.save(saved, states)
    s.barrier()
    with pytest.raises(CheckpointFileError, match="mp_rank_00_model_states.pt: refused"):
        s.load_ckpt(engine, ckpt_dir)  # every rank refuses, none unpickles
    s.close()
    return {"unchanged": unchanged, "replaced": replaced, "marker": os.path.exists(marker)}


def test_resaved_tag_stays_whole_and_pickle_payload_is_refused(ranks, tmp_path):
    marker = str(tmp_path / "payload-ran")
    out = ranks.run(resave_and_payload, str(tmp_path / "ckpt"), marker)
    assert all(o["unchanged"] for o in out), "a failed re-save touched the earlier checkpoint"
    assert all(o["replaced"] for o in out), "the successful re-save did not replace it"
    assert not os.path.exists(marker) and not any(o["marker"] for o in out), "the payload ran"
