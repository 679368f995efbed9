"""OpenRLHF's call forms on the facade, beside its own: argument dispatch (single process), and one
2-rank ZeRO-3 run of a training loop written in each form on the same data, seed and weights that
must give the same losses, learning rates, moving averages, checkpoints and export."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from strategy import CheckpointConfig, DeepSpeedStrategy, OptimConfig, StrategyConfig
from strategy.checkpoint import LoadedCheckpoint, Retention
from strategy.dist import RankFlag
from strategy.engines import unpackable
from strategy.errors import ConfigError
from tests.support.models import VOCAB

LR, WD, BETAS, BETA = 1e-2, 0.1, (0.8, 0.98), 0.8  # OptimConfig's defaults differ
MICRO, TOTAL = 2, 8
ACCUM = TOTAL // MICRO // 2  # at 2 ranks: 2 micro-batches per optimizer step
SAMPLES = 38  # not a multiple of world size x micro batch: each epoch ends with a leftover batch
PER_EPOCH = 4  # optimizer steps per epoch: 19 rows per rank, 9 micro-batches, the 9th dropped
STEPS, WARMUP, STOP = 6, 1, 3  # the resumed runs start from the checkpoint of step STOP


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randint(0, VOCAB, (SAMPLES, 12), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def collate(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(rows)


# ------------------------------------------------------------ single process: dispatch


class FakeEngine:
    """What the stepping methods read of a training engine, off a boundary (no grad-norm work)."""

    def __init__(self) -> None:
        self.client = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        self.optimizer = type("ZeroWrapper", (), {"optimizer": self.client})()
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.client, lambda _: 1.0)
        self.steps, self.losses = 0, []

    def is_gradient_accumulation_boundary(self) -> bool:
        return False

    def step(self) -> None:
        self.steps += 1

    def backward(self, loss) -> None:
        self.losses.append(loss)


def test_is_rank_0_is_a_flag_and_a_call():
    yes, no = RankFlag(True), RankFlag(False)
    assert yes and yes() is True and not no and no() is False
    assert (yes == True, no == False, repr(no), f"{yes}") == (True, True, "False", "True")  # noqa: E712
    s = DeepSpeedStrategy()
    assert s.is_rank_0 and s.is_rank_0() and s.get_rank() == s.rank == 0  # one process: rank 0


def test_optimizer_step_and_backward_forms():
    s, engine = DeepSpeedStrategy(), FakeEngine()
    s.optimizer_step(engine)  # ours
    s.optimizer_step(engine.optimizer, engine, engine.lr_scheduler, name="actor")  # OpenRLHF's
    s.optimizer_step(engine.client, engine, None)  # the optimizer given to prepare is its own too
    assert engine.steps == 3
    s.backward(1.0, engine)
    s.backward(2.0, engine, engine.optimizer)
    assert engine.losses == [1.0, 2.0]
    other = FakeEngine()
    with pytest.raises(ConfigError, match="optimizer=.*prepare returned"):
        s.optimizer_step(other.optimizer, engine, engine.lr_scheduler)
    with pytest.raises(ConfigError, match="scheduler=.*given to prepare"):
        s.optimizer_step(engine.optimizer, engine, other.lr_scheduler)
    with pytest.raises(ConfigError, match="optimizer=.*prepare returned"):
        s.backward(1.0, engine, other.client)
    with pytest.raises(ConfigError, match="model='SGD'.*training engine"):
        s.optimizer_step(engine.client)  # an optimizer alone: no engine to step
    assert engine.steps == 3


def test_save_and_load_ckpt_argument_forms(monkeypatch):
    import strategy.deepspeed_strategy as facade

    calls = []
    monkeypatch.setattr(facade, "save_checkpoint", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(facade, "load_checkpoint",
                        lambda *a, **kw: calls.append((a, kw)) or LoadedCheckpoint(None, {}, None))
    s = DeepSpeedStrategy(checkpoint=CheckpointConfig(max_ckpt_num=7, max_ckpt_mem=9.0,
                                                      keep_best_ckpt=1))
    monkeypatch.setattr(s.storage, "is_node_local", lambda directory=None: False)
    s.save_ckpt("e", "d", "t", 2, 0.5, {"a": 1}, False)  # OpenRLHF's positional form
    s.save_ckpt("e", "d", "t", {"b": 2})  # ours: a dict 4th is the client_state
    s.save_ckpt("e", "d", "t", max_mem=3)
    s.save_ckpt("e", "d", "t", client_state={"c": 3}, retention=Retention(max_num=4))
    got = [(a[3], kw["retention"], kw["save_latest"]) for a, kw in calls]
    assert got == [({"a": 1}, Retention(2, 0.5, 1), False), ({"b": 2}, Retention(7, 9.0, 1), True),
                   (None, Retention(7, 3, 1), True), ({"c": 3}, Retention(max_num=4), True)]
    with pytest.raises(ConfigError, match="client_state="):
        s.save_ckpt("e", "d", "t", {"b": 2}, client_state={"b": 2})
    with pytest.raises(ConfigError, match="retention="):
        s.save_ckpt("e", "d", "t", 2, retention=Retention())
    with pytest.raises(ConfigError, match="max_num=0"):
        s.save_ckpt("e", "d", "t", 0)
    calls.clear()
    s.load_ckpt("e", "d", None, False)  # OpenRLHF's 4th: load_module_strict
    s.load_ckpt("e", "d", load_optimizer_states=False, dataloader="loader")
    (a, kw), (b, kw2) = calls
    assert (kw["load_module_strict"], a[3], a[5]) == (False, True, None)
    assert (kw2["load_module_strict"], b[3], b[5]) == (True, False, "loader")


def test_loaded_checkpoint_unpacks_as_a_pair():
    loaded = LoadedCheckpoint("/c/global_step3", {"step": 3}, "where")
    path, state = loaded
    assert (path, state, loaded.path, loaded.client_state, loaded.resume) == (
        "/c/global_step3", {"step": 3}, "/c/global_step3", {"step": 3}, "where")
    assert loaded == ("/c/global_step3", {"step": 3}) and len(loaded) == 2
    again = pickle.loads(pickle.dumps(loaded))  # results cross processes (the rank pool)
    assert again == loaded and again.resume == "where"


def test_retention_takes_openrlhf_limits():
    config = CheckpointConfig(max_ckpt_num=5, max_ckpt_mem=10.0)
    assert Retention.from_config(config) == Retention(5, 10.0)
    assert Retention.from_config(config, 3, 1000) == Retention(3, 1000)  # GiB, as OpenRLHF's
    with pytest.raises(ConfigError, match="max_mem=0"):
        Retention.from_config(config, max_mem=0)


def test_setup_dataloader_takes_pin_memory_third():
    s = DeepSpeedStrategy(StrategyConfig(micro_train_batch_size=2, train_batch_size=2))
    loader = s.setup_dataloader(Rows(), 3, True, False, collate, False)  # OpenRLHF's order
    assert (loader.batch_size, loader.pin_memory, loader.sampler.shuffle) == (3, True, False)
    assert (loader.collate_fn, loader.drop_last) == (collate, False)
    own = s.setup_dataloader(Rows(), shuffle=False, collate_fn=collate)
    assert (own.batch_size, own.pin_memory, own.drop_last) == (2, False, True)


def test_unpackable_engine_stays_the_same_object():
    class Engine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.optimizer, self.lr_scheduler = "optim", "schedule"

    engine = Engine()
    same = unpackable(engine)
    model, optim, schedule = same
    assert same is engine is model and (optim, schedule) == ("optim", "schedule")
    assert isinstance(engine, Engine) and type(engine).__name__ == "Engine" and bool(engine)
    assert type(unpackable(engine)) is type(engine)  # no subclass of the subclass
    assert type(unpackable(Engine())) is type(engine)  # one subclass per engine class
    assert DeepSpeedStrategy().prepare((None, None, None)) == (None, None, None)


def test_moving_average_on_plain_modules():
    torch.manual_seed(0)
    model, average = nn.Linear(3, 2), nn.Linear(3, 2)
    model.bias.requires_grad_(False)  # only trained weights are averaged
    before = {n: p.detach().clone() for n, p in average.named_parameters()}
    DeepSpeedStrategy().moving_average(model, average, beta=0.75)
    want = 0.75 * before["weight"] + 0.25 * model.weight.detach()
    torch.testing.assert_close(average.weight.detach(), want, rtol=0, atol=1e-7)
    assert torch.equal(average.bias.detach(), before["bias"])
    with pytest.raises(ConfigError, match="beta=1.5"):
        DeepSpeedStrategy().moving_average(model, average, beta=1.5)
    with pytest.raises(ConfigError, match="model_ema="):
        DeepSpeedStrategy().moving_average(model, nn.Linear(3, 2, bias=False))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")
@pytest.mark.parametrize("name", ["fused_adam", "cpu_adam", "hybrid_adam"])
def test_transformers_cosine_with_min_lr_schedules_our_optimizers(name):
    """OpenRLHF's ``get_scheduler(..., scheduler_specific_kwargs={"min_lr": ...})`` reads the
    optimizer's ``defaults["lr"]``: ours have it, and it gives our own schedule's learning rates."""
    from transformers.trainer import get_scheduler

    s = DeepSpeedStrategy(optim=OptimConfig(learning_rate=LR, optimizer=name))
    lrs = []
    for theirs in (True, False):
        optim = s.create_optimizer(nn.Linear(4, 4), lr=LR, betas=BETAS, weight_decay=WD)
        if theirs:
            schedule = get_scheduler("cosine_with_min_lr", optim, num_warmup_steps=WARMUP,
                                     num_training_steps=STEPS,
                                     scheduler_specific_kwargs={"min_lr": LR * 0.1})
        else:
            schedule = s.create_scheduler(optim, "cosine_with_min_lr", num_training_steps=STEPS,
                                          num_warmup_steps=WARMUP, min_lr_ratio=0.1)
        seen = []
        for _ in range(STEPS):
            schedule.step()
            seen.append(schedule.get_last_lr()[0])
        lrs.append(seen)
    assert lrs[0] == lrs[1] and lrs[0][-1] == pytest.approx(LR * 0.1, rel=0.05)


# ------------------------------------------------------------ 2 ranks, ZeRO-3: both forms


def _strategy(tag: str, root: str) -> DeepSpeedStrategy:
    """ZeRO-3 with every parameter partitioned; OpenRLHF's runs pass lr/betas/weight decay to
    create_optimizer, ours set them here (the defaults are other values)."""
    optim = OptimConfig() if tag == "openrlhf" else OptimConfig(
        learning_rate=LR, l2=WD, adam_betas=BETAS, min_lr_ratio=0.1)
    s = DeepSpeedStrategy(
        StrategyConfig(zero_stage=3, micro_train_batch_size=MICRO, train_batch_size=TOTAL,
                       max_norm=1.0, seed=1, ds_config_overrides={
                           "zero_optimization": {"stage3_param_persistence_threshold": 0}}),
        optim, CheckpointConfig(ckpt_path=f"{root}/{tag}_ckpt", max_ckpt_num=2))
    s.setup_distributed()
    return s


def _micro_batches(loader, epoch: int, done: int, consumed: int | None = None):
    """This epoch's micro-batches of the optimizer steps after its first ``done``: the sampler is
    moved past those (``consumed`` global samples: ours) or they are skipped here (OpenRLHF's
    form); the leftover micro-batch at the epoch's end (no whole step) is never reached."""
    loader.sampler.set_epoch(epoch, consumed or 0)
    batches = iter(loader)
    for _ in range(0 if consumed is not None else done * ACCUM):
        next(batches)
    for _ in range((PER_EPOCH - done) * ACCUM):
        yield next(batches)


def _record(out: dict, step: int, loss: torch.Tensor, reduced: float) -> None:
    """This rank's micro-batch loss and the mean over ranks, under the step it feeds."""
    out["local"].setdefault(step, []).append(loss.item())
    out["losses"].setdefault(step, []).append(reduced)


def openrlhf_run(root: str, resume: bool = False) -> dict:
    """The loop as an OpenRLHF trainer writes it."""
    import deepspeed
    from transformers.trainer import get_scheduler

    from tests.support.helpers import gathered_state
    from tests.support.models import tiny_llama
    from tests.test_save_model import tiny_tokenizer

    strategy = _strategy("openrlhf", root)
    ckpt = f"{root}/openrlhf_ckpt"
    torch.manual_seed(123 if resume else 0)  # a resumed run's weights come from the checkpoint
    model = strategy.from_pretrained(tiny_llama())
    torch.manual_seed(0)
    ema_model = strategy.from_pretrained(tiny_llama(), frozen=True)
    optim = strategy.create_optimizer(model, lr=LR, betas=BETAS, weight_decay=WD)
    scheduler = get_scheduler("cosine_with_min_lr", optim, num_warmup_steps=WARMUP,
                              num_training_steps=STEPS,
                              scheduler_specific_kwargs={"min_lr": LR * 0.1})
    created = scheduler
    model, optim, scheduler = strategy.prepare((model, optim, scheduler), is_rlhf=False)
    ema_model = strategy.prepare(ema_model, is_rlhf=False)
    assert isinstance(model, deepspeed.DeepSpeedEngine) and optim is model.optimizer
    assert scheduler is created is model.lr_scheduler
    for engine in (model, ema_model):  # ZeRO-3 keeps no weight whole outside a forward
        assert all(p.numel() == 0 < p.ds_numel for p in engine.parameters())
    loader = strategy.setup_dataloader(Rows(), MICRO, True, True, collate)  # pin_memory 3rd
    torch.manual_seed(1)
    step, out = 0, {"losses": {}, "local": {}, "lrs": {}}
    if resume:
        path, states = strategy.load_ckpt(model, ckpt, load_module_strict=True)
        out["loaded"] = (os.path.basename(path), states)
        step = states["consumed_samples"] // TOTAL
    for epoch in range(step // PER_EPOCH, STEPS // PER_EPOCH + 1):
        done = step - epoch * PER_EPOCH if epoch == step // PER_EPOCH else 0
        for i, x in enumerate(_micro_batches(loader, epoch, done)):
            loss = model(input_ids=x, labels=x).loss
            strategy.backward(loss, model, optim)
            strategy.optimizer_step(optim, model, scheduler, name="model")
            strategy.moving_average(model, ema_model, BETA, device="cpu")
            logs = strategy.all_reduce({"loss": loss.item()}, op="mean")
            _record(out, step + 1, loss, logs["loss"])
            if (i + 1) % ACCUM:
                continue
            step += 1
            out["lrs"][step] = scheduler.get_last_lr()[0]
            client_states = {"consumed_samples": step * TOTAL}
            if not resume and step in (STOP - 1, STOP):
                strategy.save_ckpt(model, ckpt, f"global_step{step}", 2, 1000, client_states)
            if not resume and step == STOP + 1:  # newer, but ``latest`` keeps naming STOP
                strategy.save_ckpt(model, ckpt, "extra", max_num=2, max_mem=1000,
                                   client_state=client_states, save_latest=False)
            if step == STEPS:
                break
    if strategy.is_rank_0():
        out["ckpt_files"] = sorted(os.listdir(ckpt))
        with open(f"{ckpt}/latest") as fh:
            out["latest"] = fh.read()
    out["ranks"] = strategy.all_gather(torch.tensor([float(strategy.get_rank())])).tolist()
    export = f"{root}/openrlhf_hf{'_resumed' if resume else ''}"
    strategy.save_model(model=model, tokenizer=tiny_tokenizer(), output_dir=export)
    out["weights"], out["ema"] = gathered_state(model), gathered_state(ema_model)
    strategy.close()
    out["export"] = _reloaded(export)
    return out


def own_run(root: str, resume: bool = False) -> dict:
    """The same loop in the facade's own forms."""
    from tests.support.helpers import gathered_state
    from tests.support.models import tiny_llama

    s = _strategy("own", root)
    torch.manual_seed(123 if resume else 0)
    model = s.from_pretrained(tiny_llama())
    opt = s.create_optimizer(model)
    engine = s.prepare((model, opt, s.create_scheduler(opt, "cosine_with_min_lr",
                                                       num_training_steps=STEPS,
                                                       num_warmup_steps=WARMUP)))
    ema = s.create_ema(engine, BETA)
    loader = s.setup_dataloader(Rows(), collate_fn=collate)
    torch.manual_seed(1)
    step, first, consumed, out = 0, 0, 0, {"losses": {}, "local": {}, "lrs": {}}
    if resume:
        loaded = s.load_ckpt(engine, dataloader=loader)
        out["loaded"] = (os.path.basename(loaded.path), loaded.client_state)
        step, first, consumed = (loaded.resume.global_step, loaded.resume.epoch,
                                 loaded.resume.epoch_consumed)
        out["resume"] = (first, consumed)
    for epoch in range(first, STEPS // PER_EPOCH + 1):
        for i, x in enumerate(_micro_batches(loader, epoch, consumed // TOTAL, consumed)):
            loss = engine(input_ids=x, labels=x).loss
            s.backward(loss, engine)
            s.optimizer_step(engine)
            _record(out, step + 1, loss, s.all_reduce(loss.item()))
            if (i + 1) % s.accumulation_steps:
                continue
            step += 1
            ema.update()
            out["lrs"][step] = engine.get_lr()[0]
            if not resume and step in (STOP - 1, STOP):
                s.save_ckpt(engine, None, f"global_step{step}", {"consumed_samples": step * TOTAL},
                            retention=Retention(max_num=2))
            if step == STEPS:
                break
        consumed = 0
    out["weights"] = gathered_state(engine)
    with ema.swapped_in():
        out["ema"] = gathered_state(engine)
    s.close()
    return out


def _reloaded(export: str) -> dict:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    assert PreTrainedTokenizerFast.from_pretrained(export)("t1 t2")["input_ids"] == [1, 2]
    loaded = AutoModelForCausalLM.from_pretrained(export)
    return {name: p.detach().float().clone() for name, p in loaded.named_parameters()}


def both_forms(root: str) -> dict:
    return {"openrlhf": openrlhf_run(root), "own": own_run(root),
            "openrlhf_resumed": openrlhf_run(root, resume=True),
            "own_resumed": own_run(root, resume=True)}


def _near(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for step, values in want.items():
        assert got[step] == pytest.approx(values, abs=1e-6, rel=0), step


def _close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=f"{what} {name}")


@pytest.mark.slow
def test_openrlhf_loop_matches_our_loop_at_zero3(ranks, tmp_path):
    results = ranks.run(both_forms, str(tmp_path))
    for out in results:
        theirs, ours = out["openrlhf"], out["own"]
        assert sorted(theirs["local"]) == list(range(1, STEPS + 1))
        assert all(len(v) == ACCUM for v in theirs["local"].values())
        assert theirs["local"] == ours["local"], "per-step losses differ between the forms"
        _near(theirs["losses"], ours["losses"])  # the mean over ranks
        assert theirs["lrs"] == ours["lrs"] and theirs["lrs"][STEPS] < theirs["lrs"][WARMUP]
        _close(theirs["weights"], ours["weights"], "weights")
        _close(theirs["ema"], ours["ema"], "moving average")
        assert any(not torch.equal(theirs["ema"][n], w) for n, w in theirs["weights"].items())
        _close(theirs["export"], theirs["weights"], "export")
        assert theirs["ranks"] == [0.0, 1.0]
        for resumed, full in ((out["openrlhf_resumed"], theirs), (out["own_resumed"], ours)):
            assert resumed["loaded"] == (f"global_step{STOP}", {"consumed_samples": STOP * TOTAL})
            assert sorted(resumed["local"]) == list(range(STOP + 1, STEPS + 1))
            assert resumed["local"] == {k: full["local"][k] for k in resumed["local"]}
            assert resumed["lrs"] == {k: full["lrs"][k] for k in resumed["lrs"]}
            _close(resumed["weights"], full["weights"], "resumed weights")
        assert out["own_resumed"]["resume"] == (0, STOP * TOTAL)
        _close(out["openrlhf_resumed"]["export"], theirs["weights"], "resumed export")
    # rank 0 wrote the checkpoints: max_num=2 kept two; save_latest=False left latest at STOP
    files = [f for f in results[0]["openrlhf"]["ckpt_files"] if not f.startswith(".")]
    assert [f for f in files if not f.endswith(".py")] == ["extra", f"global_step{STOP}", "latest"]
    assert results[0]["openrlhf"]["latest"] == f"global_step{STOP}"
    assert "ckpt_files" not in results[1]["openrlhf"]
