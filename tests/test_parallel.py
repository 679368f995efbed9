"""Sequence parallelism (DeepSpeed Ulysses) and tensor parallelism (AutoTP) at 2 CPU ranks against
the same run without them: the same step losses, grad norms and exported weights; an exact
resume; the tiled logits loss equal to the plain one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

# fp32 and sdpa: sp=2 all-to-alls and a different reduction order change float rounding only
RTOL = 1e-5


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("parallel")
    toy_root(root, n_train=96, n_test=13, model_dir="init")
    return root


def _argv(root, name: str, sp: int, dataset: str, tp: int = 1, **extra) -> list[str]:
    dp = 2 // (sp * tp)
    args = {"zero_stage": 2, "sequence_parallel_size": sp, "tensor_parallel_size": tp,
            "micro_train_batch_size": 4 // dp,
            "train_batch_size": 4, "micro_eval_batch_size": 4, "learning_rate": 1e-3,
            "lr_warmup_ratio": 0.0, "max_len": 16, "max_steps": 4, "max_epochs": 5,
            "logging_steps": 1, "pretrain": f"{root}/init",
            "dataset": f"{root}/data/{dataset}_train.jsonl".replace("sft_", ""),
            "eval_dataset": f"{root}/data/{dataset}_test.jsonl".replace("sft_", ""),
            "save_path": f"{root}/{name}/model", "ckpt_path": f"{root}/{name}/ckpt",
            "log_dir": f"{root}/{name}/logs", **extra}
    flags = {True: "--{}", False: "--no-{}"}
    return [flags[v].format(k) if isinstance(v, bool) else f"--{k}={v}" for k, v in args.items()]


def train(root: str, name: str, sp: int, kind: str, tp: int = 1, **extra) -> dict:
    from strategy.parallel.tensor import is_tensor_parallel_param
    from strategy.trainers import DPOConfig, DPOTrainer, SFTTrainer
    from strategy.trainers.run import Run

    dataset = "sft" if kind == "sft" else "pairs"
    trainer_cls = SFTTrainer if kind == "sft" else DPOTrainer
    with Run.from_args(_argv(root, name, sp, dataset, tp, **extra), trainer=trainer_cls) as run:
        model = run.model()
        attention = model.config._attn_implementation
        if kind == "sft":
            trainer = run.trainer(SFTTrainer, model)
        else:
            reference = run.strategy.from_pretrained(f"{root}/init")
            trainer = run.trainer(DPOTrainer, model, ref_model=reference,
                                  dpo=run.config(DPOConfig))
        final = trainer.fit()
        split = [n for n, p in trainer.model.named_parameters() if is_tensor_parallel_param(p)]
    return {"history": trainer.history, "final": final, "split": split, "attention": attention}


def _exported(path) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


def _assert_same_run(a: dict, b: dict, root, names: tuple[str, str]) -> None:
    assert all(row["grad_norm"] > 0 for row in a["history"]), "both sides must train"
    for key in ("loss", "grad_norm"):
        want = [row[key] for row in a["history"]]
        got = [row[key] for row in b["history"]]
        assert got == pytest.approx(want, rel=RTOL), (key, got, want)
    assert b["final"]["loss"] == pytest.approx(a["final"]["loss"], rel=RTOL)
    first, second = _exported(f"{root}/{names[0]}/model"), _exported(f"{root}/{names[1]}/model")
    assert first.keys() == second.keys()
    for name, value in first.items():  # per tensor: Adam turns a rounding-level gradient
        gap = (second[name] - value).norm() / value.norm()  # gap on a near-zero entry into a
        assert gap <= RTOL, (name, float(gap))  # larger one on that entry alone


@pytest.mark.slow
@pytest.mark.parametrize("stage,packed", [(2, False), (3, True)], ids=["zero2", "zero3-packed"])
def test_sft_with_sequence_parallel_matches_without(ranks, toy, stage, packed):
    """sp=2 against sp=1: right-padded rows at ZeRO-2; packed rows (about 4 samples a row) at
    ZeRO-3, where both sides run sdpa per sample (``sdpa_varlen``, chosen for packing) and sp=2
    finds the samples over the sequence DeepSpeed gathers."""
    extra = {"zero_stage": stage}
    if stage == 3:
        extra["ds_config_overrides"] = json.dumps(
            {"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    if packed:
        extra.update(packing_samples=True, max_len=40)
    name = f"sft{stage}{'-packed' * packed}"
    plain = ranks.run(train, str(toy), f"{name}-sp1", 1, "sft", **extra)[0]
    split = ranks.run(train, str(toy), f"{name}-sp2", 2, "sft", **extra)
    same = [[(row["loss"], row["grad_norm"]) for row in out["history"]] for out in split]
    assert same[0] == same[1], "the two slices must log the same steps"
    assert plain["attention"] == split[0]["attention"] == ("sdpa_varlen" if packed else "sdpa")
    _assert_same_run(plain, split[0], toy, (f"{name}-sp1", f"{name}-sp2"))


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_dpo_with_nll_under_sequence_parallel_matches_without(ranks, toy, packed):
    """Packed pairs: each slice sums its targets into their samples by the sample index shifted
    and sliced with the labels."""
    extra = {"nll_loss_coef": 0.5, "beta": 0.2}
    if packed:
        extra.update(packing_samples=True, max_len=24)
    name = f"dpo{'-packed' * packed}"
    plain = ranks.run(train, str(toy), f"{name}-sp1", 1, "dpo", **extra)[0]
    split = ranks.run(train, str(toy), f"{name}-sp2", 2, "dpo", **extra)[0]
    assert plain["history"][0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    _assert_same_run(plain, split, toy, (f"{name}-sp1", f"{name}-sp2"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sequence", "tensor"])
def test_model_parallel_run_resumes_exactly_and_only_at_its_size(ranks, toy, kind):
    sizes = {"sp": 2, "tp": 1} if kind == "sequence" else {"sp": 1, "tp": 2}
    name = f"{kind}-resume"
    full = ranks.run(train, str(toy), name, sizes["sp"], "sft", tp=sizes["tp"], save_steps=2)[0]
    ckpt = toy / name / "ckpt"
    shutil.rmtree(ckpt / "global_step4")
    (ckpt / "latest").write_text("global_step2")
    resumed = ranks.run(train, str(toy), name, sizes["sp"], "sft", tp=sizes["tp"], save_steps=2,
                        load_checkpoint=True)[0]
    want = {row["step"]: row["loss"] for row in full["history"][2:]}
    assert {row["step"]: row["loss"] for row in resumed["history"]} == want  # bit-identical
    refused = ranks.run(refused_resume, str(toy), name)
    for message in refused:  # every rank, before any process group or engine
        assert message.startswith(f"{kind}_parallel_size=1 is invalid: "), message
        assert message.endswith(f"saved at {kind}_parallel_size=2; resume with the same size")
    assert (ckpt / "global_step2").is_dir() and (ckpt / "global_step4").is_dir()  # nothing lost


def refused_resume(root: str, name: str) -> str:
    import deepspeed

    from strategy.errors import ConfigError
    from strategy.trainers.run import Run

    def reached(*args, **kwargs):
        raise AssertionError("init_distributed was reached")

    original, deepspeed.init_distributed = deepspeed.init_distributed, reached
    try:
        Run.from_args(_argv(root, name, 1, "sft", 1, save_steps=2, load_checkpoint=True))
    except ConfigError as exc:
        return str(exc)
    finally:
        deepspeed.init_distributed = original
    return "no error"


TILED = [(2, 1, 1), (3, 1, 1), (3, 2, 1), (3, 1, 2), (3, 1, 2, True)]
# (ZeRO stage, sequence-parallel size, accumulation steps[, small parameters kept whole])


@pytest.mark.slow
@pytest.mark.parametrize("case", TILED, ids=["zero{}-sp{}-acc{}".format(*c) + "-persist" * (
    len(c) > 3) for c in TILED])
def test_tiled_logits_loss_equals_the_plain_loss(ranks, toy, case):
    """The same losses, grad norms and weights with the logits of 3 tokens at a time (every rank
    running as many chunks as the longest, for ZeRO-3's gathers) or all at once; with gradient
    accumulation too, where ZeRO-3 counts micro-steps in the engine's forward, which the tiled
    loss calls around (it once kept only the last micro-batch's gradients)."""
    stage, sp, accumulation = case[:3]
    extra = {"zero_stage": stage, "micro_train_batch_size": 4 // (2 // sp) // accumulation}
    if stage == 3 and len(case) == 3:  # every parameter partitioned: a gather per chunk
        extra["ds_config_overrides"] = json.dumps(
            {"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    names = (f"tile-off-{stage}-{sp}-{accumulation}{len(case)}",
             f"tile-on-{stage}-{sp}-{accumulation}{len(case)}")
    plain = ranks.run(train, str(toy), names[0], sp, "sft", tiled_logits_loss=False, **extra)[0]
    tiled = ranks.run(train, str(toy), names[1], sp, "sft", tiled_logits_loss=True,
                      logits_chunk_size=3, **extra)[0]
    _assert_same_run(plain, tiled, toy, names)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_sft_with_tensor_parallel_matches_without(ranks, toy, stage):
    """tp=2 (one batch, half of every projection per rank) against tp=1 (two data-parallel
    ranks): the same losses and grad norms (ZeRO-0's measured by us, 1/2's by DeepSpeed), and
    exports that hold the same whole weights."""
    names = (f"tp1-zero{stage}", f"tp2-zero{stage}")
    plain = ranks.run(train, str(toy), names[0], 1, "sft", tp=1, zero_stage=stage)[0]
    split = ranks.run(train, str(toy), names[1], 1, "sft", tp=2, zero_stage=stage)
    same = [[(row["loss"], row["grad_norm"]) for row in out["history"]] for out in split]
    assert same[0] == same[1], "the two slices must log the same steps"
    assert not plain["split"]
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "lm_head"}  # the output layer: split by column, its logits gathered whole
    assert {name.split(".")[-2] for name in split[0]["split"]} == projections
    _assert_same_run(plain, split[0], toy, names)
