"""Training math on uneven data, on the real engine: one optimizer step's gradient does not depend
on how its samples are split across ranks, micro-batches and accumulation; epochs with leftover
micro-batches keep the loop and DeepSpeed in step and resume exactly; held-out metrics count
every sample once."""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest
import torch

from strategy.trainers.loop.steps import plan_steps
from tests.support.helpers import gathered_state
from tests.support.models import tiny_llama

RESPONSE_LENGTHS = [1, 40, 3, 17, 2, 33, 9, 25]  # 8 samples, very different lengths
SPLITS = [(1, 8, 1), (2, 4, 1), (2, 1, 4), (2, 2, 2)]  # (world, micro, accumulation)


# ------------------------------------------------------------ pure step arithmetic


def _sampled_steps(samples: int, world: int, micro: int, accumulation: int) -> int:
    """What the loop trains on: each rank's shard from the real training sampler, cut into whole
    micro-batches by a DataLoader that drops the partial one, grouped into whole steps; every
    rank must come out the same."""
    from torch.utils.data import DataLoader

    from strategy.sampler import ResumableDistributedSampler

    data = list(range(samples))
    per_rank = set()
    for rank in range(world):
        sampler = ResumableDistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                              seed=0, drop_last=True)
        loader = DataLoader(data, batch_size=micro, sampler=sampler, drop_last=True)
        per_rank.add(sum(1 for _ in loader) // accumulation)
    assert len(per_rank) == 1, f"ranks disagree on steps: {per_rank}"
    return per_rank.pop()


@pytest.mark.parametrize("samples", [1, 7, 29, 45, 97, 128, 1001])
def test_steps_per_epoch_matches_the_real_sampler(samples):
    for world in (1, 2, 3, 8):
        for micro in (1, 2, 3, 5):
            for accumulation in (1, 2, 3, 4):
                plan = plan_steps(samples, micro * accumulation * world, max_epochs=3)
                assert plan.steps_per_epoch == _sampled_steps(samples, world, micro, accumulation)
                assert plan.total_steps == 3 * plan.steps_per_epoch


# ------------------------------------------------------------ gradient equivalence


def _sft_rows(rng: random.Random) -> list[dict]:
    rows = []
    for length in RESPONSE_LENGTHS:
        prompt = [rng.randrange(3, 14) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(3, 14) for _ in range(length)]
        rows.append({"input_ids": prompt + response, "labels": [-100] * len(prompt) + response})
    return rows


def _pair_rows(rng: random.Random) -> list[dict]:
    rows = []
    for length in RESPONSE_LENGTHS:
        prompt = [rng.randrange(3, 14) for _ in range(rng.randint(2, 6))]
        chosen = [rng.randrange(3, 14) for _ in range(length)]
        rejected = [rng.randrange(3, 14) for _ in range(rng.randint(1, 40))]
        rows.append({"chosen_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
                     "rejected_ids": prompt + rejected,
                     "rejected_labels": [-100] * len(prompt) + rejected})
    return rows


def one_step(kind: str, micro: int, accumulation: int | None, weighting: str, root: str,
             packed: bool = False) -> dict:
    """One optimizer step over the same 8 samples with SGD(lr=1): the weights move by exactly
    minus the gradient. ``packed``: the samples packed into rows (``accumulation`` None: one
    step over all of them)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig
    from strategy.attention import attention_for
    from strategy.trainers import (
        DPOTrainer,
        KTOTrainer,
        ORPOTrainer,
        RewardModelTrainer,
        SFTTrainer,
        SimPOTrainer,
        TrainConfig,
    )
    from strategy.trainers import data as ds
    from strategy.trainers.config import DPOConfig, KTOConfig, SimPOConfig
    from strategy.trainers.data import packing, unpaired

    world = int(os.environ.get("WORLD_SIZE", 1))
    rng = random.Random(0)
    rows = _sft_rows(rng) if kind == "sft" else _pair_rows(rng)
    collate = ds.collate_sft(0) if kind == "sft" else ds.collate_pairs(0)
    if kind == "kto":  # 4 pairs as 8 labelled completions, each with its mismatched sequence
        rows = unpaired.with_mismatched(_unpaired(rows[:4]), 64)
        collate = unpaired.collate_kto(0)
    if packed:
        rows = packing.pack(rows, 64) if kind == "sft" else packing.pack_pairs(rows, 48)
        plain = kind == "sft"
        collate = (packing.collate_packed if plain else packing.collate_packed_pairs)(0)
    accumulation = accumulation or len(rows) // (micro * world)
    config = StrategyConfig(zero_stage=2, micro_train_batch_size=micro, max_norm=0.0, seed=3,
                            train_batch_size=micro * accumulation * world)
    strategy = DeepSpeedStrategy(config, OptimConfig(learning_rate=1.0))
    strategy.setup_distributed()
    loader = strategy.setup_dataloader(rows, micro, shuffle=False, collate_fn=collate)
    torch.manual_seed(0)
    cls = AutoModelForSequenceClassification if kind == "rm" else AutoModelForCausalLM
    attention = attention_for("sdpa", packed)  # packed rows: sdpa per sample, as runs load
    model = strategy.from_pretrained(tiny_llama(pad_token_id=0, num_labels=1), cls,
                                     attn_implementation=attention)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    train = TrainConfig(max_steps=1, log_dir=None, save_path=f"{root}/{kind}-{world}-{micro}",
                        loss_weighting=weighting)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    args = (strategy, model, optimizer, None, loader, None, train)
    if kind in ("dpo", "dpo-ipo", "kto"):
        reference = AutoModelForCausalLM.from_config(tiny_llama(pad_token_id=0))
        scale = 1.1 if kind == "kto" else 1.0  # KTO: a reference apart, so the KL point is not 0
        reference.load_state_dict({n: p.clone() * scale for n, p in initial.items()})
    if kind == "sft":
        trainer = SFTTrainer(*args)
    elif kind == "rm":
        trainer = RewardModelTrainer(*args)
    elif kind == "orpo":
        trainer = ORPOTrainer(*args)
    elif kind == "simpo":
        trainer = SimPOTrainer(*args, simpo=SimPOConfig(simpo_nll_coef=0.3))
    elif kind == "kto":
        trainer = KTOTrainer(strategy, model, reference, *args[2:],
                             kto=KTOConfig(kto_beta=0.5, undesirable_weight=1.5))
    else:
        dpo = DPOConfig(beta=0.5, nll_loss_coef=0.7, ipo=kind == "dpo-ipo")
        trainer = DPOTrainer(strategy, model, reference, optimizer, None, loader, None, train,
                             dpo=dpo)
    trainer.fit()
    after = gathered_state(trainer.model)
    strategy.close()
    grads = {n: initial[n] - after[n] for n in initial}
    return {"grads": grads, "loss": trainer.history[0]["loss"],
            "grad_norm": trainer.history[0]["grad_norm"]}


def _unpaired(pairs: list[dict]) -> list[dict]:
    return [{"input_ids": p[f"{side}_ids"], "labels": p[f"{side}_labels"],
             "desirable": side == "chosen"} for p in pairs for side in ("chosen", "rejected")]


def _relative_gap(a: dict, b: dict) -> float:
    num = math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))
    den = math.sqrt(sum(float(b[n].pow(2).sum()) for n in b))
    return num / den


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo", "rm", "dpo-ipo", "orpo", "simpo", "kto"])
def test_step_gradient_is_the_same_however_the_step_is_split(ranks, tmp_path, kind):
    splits = SPLITS if kind in ("sft", "dpo", "rm") else SPLITS[:1] + SPLITS[2:3]
    runs = {(w, m, a): ranks.run(one_step, kind, m, a, "step", str(tmp_path), world_size=w)[0]
            for w, m, a in splits}
    reference = runs[splits[0]]
    assert reference["grad_norm"] > 0
    for split, run in runs.items():
        gap = _relative_gap(run["grads"], reference["grads"])
        print(f"{kind} {split}: gradient gap {gap:.1e}, loss {run['loss']:.6f}")
        assert gap < 1e-5, (split, gap)
        assert run["loss"] == pytest.approx(reference["loss"], rel=1e-5), split
        assert run["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), split
    if kind in ("dpo-ipo", "orpo", "kto"):
        return  # the split is checked; packing and the old weighting once per data kind
    # packed into rows told apart by position ids: the same step, the same gradient
    packed = ranks.run(one_step, kind, 1, None, "step", str(tmp_path), packed=True,
                       world_size=1)[0]
    gap = _relative_gap(packed["grads"], reference["grads"])
    print(f"{kind} packed: gradient gap {gap:.1e}")
    assert gap < 1e-5 and packed["loss"] == pytest.approx(reference["loss"], rel=1e-5), gap
    if kind in ("rm", "simpo"):
        return  # a pair loss over equal-size micro-batches: the old mean of means is the same
    # the old per-micro-batch mean weighs a 1-token micro-batch like a 40-token one
    old = ranks.run(one_step, kind, 1, 4, "micro_batch", str(tmp_path), world_size=2)[0]
    assert _relative_gap(old["grads"], reference["grads"]) > 1e-2


# ------------------------------------------------------------ epochs with leftovers, resume


def _argv(root: str, **extra) -> list[str]:
    args = {"zero_stage": 2, "micro_train_batch_size": 2, "train_batch_size": 12,
            "micro_eval_batch_size": 3, "learning_rate": 1e-3, "lr_warmup_ratio": 0.2,
            "max_len": 24, "max_epochs": 3, "save_steps": 1, "max_ckpt_num": 20,
            "logging_steps": 1, "tokenizer": f"{root}/data/tokenizer",
            "model_config": f"{root}/model.json", "dataset": f"{root}/data/train45.jsonl",
            "eval_dataset": f"{root}/data/test29.jsonl", "save_path": f"{root}/out/model",
            "ckpt_path": f"{root}/out/ckpt", "log_dir": f"{root}/out/logs", **extra}
    flags = {True: "--{}", False: "--no-{}"}
    return [flags[v].format(k) if isinstance(v, bool) else f"--{k}={v}" for k, v in args.items()]


def multi_epoch(root: str, resume: bool) -> dict:
    from strategy.trainers import SFTTrainer
    from strategy.trainers.run import Run

    class Counting(SFTTrainer):  # counts each step's real tokens apart from the meter
        def train_steps(self, epoch, count):
            for step in super().train_steps(epoch, count):
                self.step_tokens.append(sum(int(b["attention_mask"].sum()) for b in step.batches))
                yield step

    with Run.from_args(_argv(root, load_checkpoint=resume, peak_tflops=0.5)) as run:
        trainer = run.trainer(Counting, run.model())
        trainer.step_tokens = []
        final = trainer.fit()
        plan = trainer.step_plan
        state = gathered_state(trainer.model)
    return {"history": trainer.history, "final": final, "state": state,
            "plan": (plan.steps_per_epoch, plan.total_steps), "step_tokens": trainer.step_tokens}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from strategy.demos.toy_task import make

    root = tmp_path_factory.mktemp("math")
    make(str(root / "data"), n_train=45, n_test=29)
    os.rename(root / "data" / "train.jsonl", root / "data" / "train45.jsonl")
    os.rename(root / "data" / "test.jsonl", root / "data" / "test29.jsonl")
    config = json.load(open("configs/tiny_llama.json"))
    config.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, attention_dropout=0.1)
    (root / "model.json").write_text(json.dumps(config))
    return root


@pytest.mark.slow
def test_epochs_with_leftovers_save_every_step_and_resume_exactly(ranks, toy):
    """45 samples, 2 ranks, micro 2, accumulation 3: each rank has 11 micro-batches an epoch, so
    3 steps and 2 leftover micro-batches; 3 epochs, a checkpoint after every step, dropout on."""
    full_ranks = ranks.run(multi_epoch, str(toy), False)
    full = full_ranks[0]
    assert full["plan"] == (3, 9)
    steps = [row["step"] for row in full["history"]]
    assert steps == list(range(1, 10)), steps
    assert [row["epoch"] for row in full["history"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    ckpt = toy / "out" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step")) == [
        f"global_step{k}" for k in range(1, 10)]
    # resume from step 5 (mid-epoch 2): delete the later checkpoints and run again
    for k in range(6, 10):
        shutil.rmtree(ckpt / f"global_step{k}")
    (ckpt / "latest").write_text("global_step5")
    resumed_ranks = ranks.run(multi_epoch, str(toy), True)
    resumed = resumed_ranks[0]
    assert [row["step"] for row in resumed["history"]] == [6, 7, 8, 9]
    want = {row["step"]: row["loss"] for row in full["history"][5:]}
    got = {row["step"]: row["loss"] for row in resumed["history"]}
    assert got == want, (got, want)  # bit-identical losses
    for name, value in full["state"].items():
        assert torch.equal(value, resumed["state"][name]), f"{name} differs after the resume"
    assert resumed["final"] == full["final"]
    counted = [sum(tokens) for tokens in zip(*(r["step_tokens"] for r in full_ranks))] + \
        [sum(tokens) for tokens in zip(*(r["step_tokens"] for r in resumed_ranks))]
    _check_throughput_logs(toy / "out" / "logs" / "metrics.jsonl", counted)


def _check_throughput_logs(path, counted: list[int]) -> None:
    """Every logged step carries its real token count (counted apart, both ranks), 12 samples,
    a peak memory that never falls within a run, and MFU (--peak_tflops)."""
    rows = [json.loads(line) for line in open(path) if '"train/loss"' in line]
    assert len(rows) == 9 + 4 == len(counted), len(rows)  # the full run, then the resumed one
    for row, tokens in zip(rows, counted):
        logged = row["train/tokens_per_s"] * row["train/step_time"]  # a window of one step
        assert logged == pytest.approx(tokens, rel=1e-9), (row, tokens)
        assert row["train/samples_per_s"] * row["train/step_time"] == pytest.approx(12)
        assert 0 < row["train/mfu"] < 1
    for run in (rows[:9], rows[9:]):  # a peak, not the current size
        peaks = [row["train/peak_mem_gb"] for row in run]
        assert peaks == sorted(peaks), peaks


# ------------------------------------------------------------ exact held-out metrics


def held_out(root: str, micro_eval: int) -> dict:
    from strategy.trainers import SFTTrainer
    from strategy.trainers.run import Run

    argv = _argv(root, micro_eval_batch_size=micro_eval, save_steps=-1,
                 log_dir=f"{root}/eval-logs")
    with Run.from_args(argv) as run:
        torch.manual_seed(0)
        trainer = run.trainer(SFTTrainer, run.model())
        metrics = trainer.evaluate()
        state = gathered_state(trainer.model)
    return {"metrics": metrics, "state": state}


def _direct_eval_loss(root, state) -> tuple[float, int]:
    """Sum of every response token's loss over the 29 samples / their count, one at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strategy.trainers import data as ds
    from strategy.trainers.config import DataConfig
    from strategy.trainers.run import hf_config

    tokenizer = AutoTokenizer.from_pretrained(root / "data" / "tokenizer")
    model = AutoModelForCausalLM.from_config(hf_config(str(root / "model.json"), tokenizer)).eval()
    model.load_state_dict(state)
    rows = ds.load_sft(str(root / "data" / "test29.jsonl"), tokenizer, DataConfig(max_len=24))
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            total += model(input_ids=ids, labels=labels, num_items_in_batch=1).loss.item()
            tokens += int((labels[:, 1:] != -100).sum())
    return total / tokens, len(rows)


@pytest.mark.slow
def test_eval_on_29_samples_at_2_ranks_equals_single_process(ranks, toy):
    two = ranks.run(held_out, str(toy), 4)  # 29 = 15 + 14 samples; 4 and 4 batches, uneven
    one = ranks.run(held_out, str(toy), 3, world_size=1)[0]
    direct, count = _direct_eval_loss(toy, one["state"])
    assert count == 29
    assert two[0]["metrics"] == two[1]["metrics"]
    assert two[0]["metrics"]["loss"] == pytest.approx(direct, rel=1e-6, abs=0)
    assert one["metrics"]["loss"] == pytest.approx(direct, rel=1e-6, abs=0)
