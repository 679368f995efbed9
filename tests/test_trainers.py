"""2-rank trainer tests on the real engine: learning, hand-checkable metrics, a subclass, LoRA."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Toy reversal data, a char tokenizer and a saved initial model (for DPO's reference)."""
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("toy")
    toy_root(root, n_train=256, n_test=29, model_dir="init")  # 29: divides by neither 2 nor 8
    return root


def _argv(stage: int, toy: str, name: str, dataset: str, **extra) -> list[str]:
    args = {
        "zero_stage": stage,
        "micro_train_batch_size": 8,
        "train_batch_size": 32,
        "micro_eval_batch_size": 8,
        "learning_rate": 2e-3,
        "lr_warmup_ratio": 0.0,
        "max_len": 16,
        "max_epochs": 2,
        "logging_steps": 1,
        "tokenizer": f"{toy}/data/tokenizer",
        "model_config": "configs/tiny_llama.json",
        "dataset": f"{toy}/data/{dataset}_train.jsonl".replace("sft_", ""),
        "eval_dataset": f"{toy}/data/{dataset}_test.jsonl".replace("sft_", ""),
        "save_path": f"{toy}/{stage}/{name}/model",
        "ckpt_path": f"{toy}/{stage}/{name}/ckpt",
        "log_dir": f"{toy}/{stage}/{name}/logs",
        "ds_config_overrides": json.dumps(
            {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else {}
        ),
        **extra,
    }
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items()]


def _losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.history]


def sft_and_rm(stage: int, toy: str) -> dict:
    from transformers import AutoModelForSequenceClassification

    from strategy.trainers import RewardModelTrainer, SFTTrainer
    from strategy.trainers.run import Run

    run = Run.from_args(_argv(stage, toy, "sft", "sft", max_epochs=4, learning_rate=3e-3))
    model = run.model()
    train, held = run.loaders(SFTTrainer.data)
    batch = next(
        iter(train)
    )  # response-only labels: prompt and padding are -100, the rest are the ids
    resp = batch["labels"] != -100
    assert torch.equal(batch["labels"][resp], batch["input_ids"][resp])
    eq = run.tokenizer.convert_tokens_to_ids("=")
    for ids, lab in zip(batch["input_ids"], batch["labels"]):
        split = (ids == eq).nonzero()[0].item() + 1
        assert (lab[:split] == -100).all() and (lab[split:] != -100).sum() == (
            ids[split:] != 0
        ).sum()
    sft = SFTTrainer(
        run.strategy,
        model,
        *run.optimizer_and_scheduler(model, train),
        train,
        held,
        run.train,
        run.tokenizer,
    )
    sft_eval = sft.fit()
    run.strategy.close()

    run = Run.from_args(_argv(stage, toy, "rm", "pairs"))
    model = run.model(AutoModelForSequenceClassification, num_labels=1)
    train, held = run.loaders(RewardModelTrainer.data)
    rm = RewardModelTrainer(
        run.strategy,
        model,
        *run.optimizer_and_scheduler(model, train),
        train,
        held,
        run.train,
        run.tokenizer,
    )
    rm_eval = rm.fit()
    direct = _direct_rm_accuracy(rm, f"{toy}/data/pairs_test.jsonl")
    run.strategy.close()
    return {
        "sft": _losses(sft),
        "sft_eval": sft_eval,
        "rm": _losses(rm),
        "rm_eval": rm_eval,
        "rm_direct": direct,
    }


def _direct_rm_accuracy(trainer, path: str) -> tuple[float, float]:
    """Score every held-out pair one at a time on every rank (all ranks enter ZeRO-3's gathers):
    accuracy and the mean Bradley-Terry loss ``-log sigmoid(chosen - rejected)``."""
    rows = [json.loads(line) for line in open(path)]
    tok, wins, loss = trainer.tokenizer, 0, 0.0
    trainer.model.eval()
    with torch.no_grad():
        for r in rows:
            scores = [
                trainer.model(
                    input_ids=tok(
                        r["prompt"] + text + tok.eos_token,
                        add_special_tokens=False,
                        return_tensors="pt",
                    )["input_ids"]
                )
                .logits[0, 0]
                .item()
                for text in (r["chosen"], r["rejected"])
            ]
            wins += scores[0] > scores[1]
            loss -= torch.nn.functional.logsigmoid(torch.tensor(scores[0] - scores[1])).item()
    return wins / len(rows), loss / len(rows)


@pytest.mark.parametrize("stage", [2, 3])
def test_sft_and_reward_model_learn(ranks, toy, stage):
    out = ranks.run(sft_and_rm, stage, str(toy))[0]
    sft, rm = out["sft"], out["rm"]
    assert sum(sft[-3:]) / 3 < 0.75 * sum(sft[:3]) / 3, f"SFT loss did not fall: {sft}"
    assert sum(rm[-3:]) / 3 < sum(rm[:3]) / 3, f"RM loss did not fall: {rm}"
    assert rm[0] == pytest.approx(math.log(2), abs=0.1)  # untrained rewards are ~equal
    assert out["rm_eval"]["accuracy"] > 0.6
    # the trainer's rank-reduced eval accuracy and loss equal scoring every pair alone
    accuracy, loss = out["rm_direct"]
    assert out["rm_eval"]["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert out["rm_eval"]["loss"] == pytest.approx(loss, rel=1e-5), (out["rm_eval"], loss)
    assert os.path.isfile(toy / str(stage) / "sft" / "logs" / "metrics.jsonl")
    assert os.path.isfile(toy / str(stage) / "rm" / "model" / "config.json")


def dpo_and_lora(stage: int, toy: str) -> dict:
    from strategy.trainers import DPOConfig, DPOTrainer, SFTTrainer
    from strategy.trainers.run import Run

    run = Run.from_args(
        _argv(stage, toy, "dpo", "pairs", pretrain=f"{toy}/init", learning_rate=1e-3),
        trainer=DPOTrainer,
    )
    model, reference = run.model(), run.strategy.from_pretrained(f"{toy}/init")
    train, held = run.loaders(DPOTrainer.data)
    dpo = DPOTrainer(
        run.strategy,
        model,
        reference,
        *run.optimizer_and_scheduler(model, train),
        train,
        held,
        run.train,
        run.tokenizer,
        dpo=run.config(DPOConfig),
    )
    dpo_eval = dpo.fit()
    dpo_direct = _direct_dpo_accuracy(dpo, f"{toy}/data/pairs_test.jsonl")
    run.strategy.close()

    run = Run.from_args(
        _argv(
            stage,
            toy,
            "lora",
            "sft",
            pretrain=f"{toy}/init",
            lora_rank=8,
            target_modules="q_proj,v_proj",
            learning_rate=1e-2,
        )
    )
    model = run.model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    train, held = run.loaders(SFTTrainer.data)
    lora = SFTTrainer(
        run.strategy,
        model,
        *run.optimizer_and_scheduler(model, train),
        train,
        held,
        run.train,
        run.tokenizer,
    )
    lora.fit()
    run.strategy.close()
    return {"dpo": dpo.history, "dpo_eval": dpo_eval, "dpo_direct": dpo_direct,
            "lora": _losses(lora), "trainable": trainable}


def _direct_dpo_accuracy(trainer, path: str) -> tuple[float, float]:
    """Each held-out pair alone on every rank: is the chosen reward above the rejected one, and
    the mean sigmoid DPO loss ``-log sigmoid(beta (margin))``."""
    from strategy.trainers import data
    from strategy.trainers.algorithms.dpo import sequence_logps
    from strategy.trainers.config import DataConfig

    rows = data.load_pairs(path, trainer.tokenizer, DataConfig(max_len=16))
    collate, wins, loss = data.collate_pairs(trainer.tokenizer.pad_token_id), 0, 0.0
    trainer.model.eval()
    with torch.no_grad():
        for row in rows:
            batch = collate([row])
            policy = sequence_logps(trainer.model, batch)
            reference = sequence_logps(trainer.ref_model, batch)
            rewards = policy - reference
            wins += bool(rewards[0] > rewards[1])
            margin = trainer.dpo.beta * (rewards[0] - rewards[1])
            loss -= torch.nn.functional.logsigmoid(margin.float()).item()
    return wins / len(rows), loss / len(rows)


@pytest.mark.parametrize("stage", [2, 3])
def test_dpo_and_lora_sft_learn(ranks, toy, stage):
    out = ranks.run(dpo_and_lora, stage, str(toy))[0]
    first, dpo = out["dpo"][0], [r["loss"] for r in out["dpo"]]
    # step 1: policy == reference, so every logit is 0: loss log 2, zero rewards (exact, fp32)
    assert (
        first["loss"] == pytest.approx(math.log(2), abs=1e-5) and abs(first["reward_margin"]) < 1e-5
    )
    assert sum(dpo[-3:]) / 3 < 0.8 * math.log(2), f"DPO loss did not fall: {dpo}"
    assert out["dpo_eval"]["reward_accuracy"] > 0.6 and out["dpo_eval"]["reward_margin"] > 0
    # 29 held-out pairs over 2 ranks and eval batches of 8: the exact figure, every pair once
    accuracy, loss = out["dpo_direct"]
    assert out["dpo_eval"]["reward_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert out["dpo_eval"]["loss"] == pytest.approx(loss, rel=1e-5), (out["dpo_eval"], loss)
    assert out["trainable"] and all("lora_" in n for n in out["trainable"])
    assert sum(out["lora"][-3:]) < sum(out["lora"][:3]), out["lora"]
    assert os.path.isfile(toy / str(stage) / "lora" / "model" / "adapter_model.safetensors")


def custom_subclass(toy: str) -> dict:
    from tests.support.helpers import load_example

    argv = _argv(2, toy, "custom", "sft", focal_gamma=2.0, max_epochs=1)
    return load_example("custom_trainer")(argv)


def test_focal_loss_formula():
    from tests.support.helpers import load_example_module

    focal = load_example_module("custom_trainer")["focal_token_losses"]
    p = torch.tensor([0.9, 0.5, 0.1])
    by_hand = torch.tensor([-(0.1**2) * math.log(0.9), -(0.5**2) * math.log(0.5),
                            -(0.9**2) * math.log(0.1)])
    assert torch.allclose(focal(p.log(), 2.0), by_hand)
    assert torch.allclose(focal(p.log(), 0.0), -p.log())  # gamma 0: cross-entropy


def test_subclass_overrides_loss_hook(ranks, toy):
    final = ranks.run(custom_subclass, str(toy))[0]
    assert 0 < final["loss"] < final["ce"] and 0 < final["target_prob"] < 1  # eval ran the hook
    rows = [json.loads(line) for line in open(toy / "2" / "custom" / "logs" / "metrics.jsonl")]
    train = [r for r in rows if "train/ce" in r]
    assert train and all(0 < r["train/loss"] < r["train/ce"] for r in train)  # focal < CE
    assert train[-1]["train/ce"] < train[0]["train/ce"]  # and it learns


FIXTURE = os.path.join(os.path.dirname(__file__), "data", "ckpt_v0")


def resume_v0(root: str) -> tuple[list, dict]:
    from strategy.trainers import Run, SFTTrainer

    flags = {"zero_stage": 2, "micro_train_batch_size": 4, "train_batch_size": 8,
             "micro_eval_batch_size": 4, "learning_rate": 3e-3, "lr_warmup_ratio": 0.1,
             "max_len": 16, "max_epochs": 2, "logging_steps": 1, "save_steps": 7,
             "ema_beta": 0.9, "tokenizer": f"{FIXTURE}/tokenizer",
             "model_config": f"{FIXTURE}/model.json", "dataset": f"{FIXTURE}/train.jsonl",
             "eval_dataset": f"{FIXTURE}/test.jsonl", "save_path": f"{root}/model",
             "ckpt_path": f"{root}/ckpt", "log_dir": f"{root}/logs"}
    argv = [f"--{k}={v}" for k, v in flags.items()] + ["--load_checkpoint"]
    with Run.from_args(argv) as run:
        trainer = run.trainer(SFTTrainer, run.model())
        final = trainer.fit()
    return trainer.history, final


def test_checkpoint_written_before_the_trainer_api_resumes(ranks, tmp_path):
    """A checkpoint saved by the code before issue 19 continues that run's steps 8-10."""
    import shutil

    shutil.copytree(f"{FIXTURE}/ckpt", tmp_path / "ckpt")
    expected = json.load(open(f"{FIXTURE}/expected.json"))
    history, final = ranks.run(resume_v0, str(tmp_path))[0]
    assert [row["step"] for row in history] == [8, 9, 10]
    for row in history:
        step = str(row["step"])
        assert row["loss"] == pytest.approx(expected["loss"][step], rel=1e-5), step
        assert row["grad_norm"] == pytest.approx(expected["grad_norm"][step], rel=1e-4), step
    assert final["loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)


def actor_critic(toy: str, name: str, **extra) -> list[dict]:
    """An SFT policy and a value model trained side by side through ``trained_engines``: the
    critic regresses each row's response length from the same batch."""
    from transformers import AutoModelForSequenceClassification

    from strategy.trainers import Run, SFTTrainer
    from strategy.trainers.losses import IGNORE
    from strategy.trainers.run import hf_config

    class ActorCritic(SFTTrainer):
        def __init__(self, *args, critic=None, **kwargs):
            super().__init__(*args, **kwargs)
            optimizer = self.strategy.create_optimizer(critic)
            schedule = self.strategy.create_scheduler(optimizer,
                                                      num_training_steps=self.total_steps())
            self.critic = self.strategy.prepare((critic, optimizer, schedule))

        def trained_engines(self):
            return {**super().trained_engines(), "critic": self.critic}

        def loss_counts(self, batch):
            return {**super().loss_counts(batch), "samples": int(batch["input_ids"].shape[0])}

        def compute_loss(self, batch):
            loss, metrics = super().compute_loss(batch)
            value = self.critic(input_ids=batch["input_ids"],
                                attention_mask=batch["attention_mask"]).logits[:, 0].float()
            target = (batch["labels"] != IGNORE).sum(-1).float() / 4
            critic = self.normalize((value - target).pow(2).sum(), "samples")
            return {"model": loss, "critic": critic}, metrics

    run = Run.from_args(_argv(2, toy, name, "sft", max_steps=4, save_steps=2, **extra))
    with run:
        config = hf_config("configs/tiny_llama.json", run.tokenizer, num_labels=1)
        critic = run.strategy.from_pretrained(config, AutoModelForSequenceClassification)
        trainer = run.trainer(ActorCritic, run.model(), critic=critic)
        trainer.fit()
    return trainer.history


def test_two_trained_engines_step_checkpoint_resume_and_export(ranks, toy):
    import shutil

    full = ranks.run(actor_critic, str(toy), "ac")[0]
    assert [row["step"] for row in full] == [1, 2, 3, 4]
    critic = [row["critic_loss"] for row in full]
    assert all(math.isfinite(c) and c > 0 for c in critic) and len(set(critic)) == 4, critic
    assert full[-1]["loss"] < full[0]["loss"]  # and so did the policy
    out = toy / "2" / "ac"
    assert (out / "model_critic" / "model.safetensors").is_file()  # exported beside the model
    for ckpt in (out / "ckpt", out / "ckpt_critic"):  # both engines checkpointed, same tags
        assert (ckpt / "global_step2").is_dir() and (ckpt / "global_step4").is_dir()
        shutil.rmtree(ckpt / "global_step4")
        (ckpt / "latest").write_text("global_step2")
    resumed = ranks.run(actor_critic, str(toy), "ac", load_checkpoint=True)[0]
    keys = ("step", "loss", "critic_loss", "grad_norm")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys}
                                                         for r in full[2:]]


def moe_sft(toy: str, coef: float) -> list[dict]:
    from strategy.trainers import Run, SFTTrainer

    config = f"{toy}/mixtral.json"
    argv = _argv(2, toy, f"moe{coef}", "sft", model_config=config, max_steps=2,
                 aux_loss_coef=coef, learning_rate=1e-3)
    with Run.from_args(argv, trainer=SFTTrainer) as run:
        trainer = run.trainer(SFTTrainer, run.model())
        trainer.fit()
    return trainer.history


def test_moe_router_loss_is_added_per_micro_batch(ranks, toy):
    """OpenRLHF's --aux_loss_coef on a tiny Mixtral: the step's loss is the response loss plus
    coef x the router's load-balancing loss (the same first step with coef 0 gives the former)."""
    (toy / "mixtral.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}))
    plain = ranks.run(moe_sft, str(toy), 0.0)[0]
    routed = ranks.run(moe_sft, str(toy), 0.5)[0]
    assert "aux_loss" not in plain[0] and routed[0]["aux_loss"] > 0
    assert routed[0]["loss"] == pytest.approx(plain[0]["loss"] + 0.5 * routed[0]["aux_loss"],
                                              rel=1e-5)
