"""Real checkpoints' token conventions at 2 ranks (issue 20): a tokenizer with no pad token (so
pad == eos), left padding, a BOS the chat template adds and an end-of-turn token that is not EOS;
a reward-model checkpoint with no ``pad_token_id``; a policy whose ``generation_config`` sets
``repetition_penalty`` and ``min_p``. The RM, DPO, chat-SFT and GRPO paths each run on them."""

from __future__ import annotations

import json

import datasets
import pytest
import torch


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from strategy.demos.toy_task import make
    from strategy.trainers.run import hf_config
    from tests.support.tokenizers import checkpoint_like_tokenizer

    root = tmp_path_factory.mktemp("conventions")
    make(str(root / "data"), n_train=70, n_test=11)  # neither divides by the batch sizes
    tok = checkpoint_like_tokenizer(str(root / "tok"))
    assert tok.pad_token is None and tok.padding_side == "left"
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama.json", tok))
    policy.save_pretrained(root / "init")
    policy.generation_config.update(repetition_penalty=1.3, min_p=0.05, do_sample=True)
    policy.save_pretrained(root / "noisy")  # same weights, a generation_config of its own
    torch.manual_seed(1)
    scorer = AutoModelForSequenceClassification.from_config(
        hf_config("configs/tiny_llama.json", tok, num_labels=1))
    assert scorer.config.pad_token_id is None  # as many RM checkpoints ship
    scorer.save_pretrained(root / "rm_init")
    for name in ("init", "noisy", "rm_init"):
        tok.save_pretrained(root / name)
    (root / "prefs" / "data").mkdir(parents=True)  # TRL's conversational pairs, Hub repo layout
    for split in ("train", "test"):
        rows = [json.loads(line) for line in open(root / "data" / f"pairs_{split}.jsonl")]
        turns = [{"chosen": [{"role": "user", "content": r["prompt"]},
                             {"role": "assistant", "content": r["chosen"]}],
                  "rejected": [{"role": "user", "content": r["prompt"]},
                               {"role": "assistant", "content": r["rejected"]}]} for r in rows]
        datasets.Dataset.from_list(turns).to_parquet(
            str(root / "prefs" / "data" / f"{split}-00000-of-00001.parquet"))
    return root


def _argv(root, name: str, data: str, **extra) -> list[str]:
    args = {"zero_stage": 2, "micro_train_batch_size": 4, "train_batch_size": 16,
            "micro_eval_batch_size": 4, "learning_rate": 1e-3, "lr_warmup_ratio": 0.0,
            "max_len": 24, "max_steps": 3, "max_epochs": 5, "logging_steps": 1,
            "dataset": f"{root}/data/{data}_train.jsonl".replace("sft_", ""),
            "eval_dataset": f"{root}/data/{data}_test.jsonl".replace("sft_", ""),
            "save_path": f"{root}/{name}/model", "ckpt_path": f"{root}/{name}/ckpt",
            "log_dir": f"{root}/{name}/logs", **extra}
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items()]


def _pairs(tokenizer, rows: list[dict], cfg) -> tuple[dict, dict, dict]:
    """The same pairs right-padded, left-padded and packed."""
    from strategy.trainers.data import collate_pairs
    from strategy.trainers.data.files import Tokenize
    from strategy.trainers.data.packing import collate_packed_pairs, pack_pairs

    tok = Tokenize(tokenizer, cfg)
    samples = []
    for row in rows:
        (c_ids, c_labels, _), (r_ids, r_labels, _) = (tok.pair(row["prompt"], row["chosen"]),
                                                      tok.pair(row["prompt"], row["rejected"]))
        samples.append({"chosen_ids": c_ids, "chosen_labels": c_labels, "rejected_ids": r_ids,
                        "rejected_labels": r_labels})
    right = collate_pairs(tokenizer.pad_token_id)(samples)
    width = right["input_ids"].shape[1]
    lengths = right["attention_mask"].sum(-1)
    left = {"input_ids": torch.stack([row.roll(width - int(n)) for row, n in
                                      zip(right["input_ids"], lengths)]),
            "attention_mask": torch.stack([m.roll(width - int(n)) for m, n in
                                           zip(right["attention_mask"], lengths)])}
    packed = collate_packed_pairs(tokenizer.pad_token_id)(pack_pairs(samples, cfg.max_len))
    return right, left, packed


def reward_model(root: str) -> dict:
    from transformers import AutoModelForSequenceClassification

    from strategy.trainers import RewardModelTrainer, Run

    argv = _argv(root, "rm", "pairs", pretrain=f"{root}/rm_init", tokenizer=f"{root}/tok")
    with Run.from_args(argv) as run:
        model = run.model(AutoModelForSequenceClassification, lora_task="SEQ_CLS",
                          modules_to_save=["score"], num_labels=1)
        trainer = run.trainer(RewardModelTrainer, model)
        final = trainer.fit()
        rows = [json.loads(line) for line in open(f"{root}/data/pairs_test.jsonl")][:3]
        out = {"final": final, "pad": run.tokenizer.pad_token_id, "eos": run.tokenizer.eos_token_id}
        trainer.model.eval()
        with torch.no_grad():
            for name, batch in zip(("right", "left", "packed"),
                                   _pairs(run.tokenizer, rows, run.data)):
                out[name] = torch.cat(trainer.rewards(trainer.to_device(batch))).cpu()
    return out


def test_reward_model_scores_one_position_everywhere(ranks, real):
    """No pad token in the tokenizer or the RM checkpoint: training runs (transformers' pooling
    would refuse a batch), right-padded, left-padded and packed pairs score the same, and the
    export (with its pad_token_id saved) scores the same after a reload, in training's format
    and through GRPO's ModelReward."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from strategy.trainers.algorithms.rewards import ModelReward
    from strategy.trainers.config import DataConfig, ModelConfig
    from strategy.trainers.data.files import Tokenize
    from strategy.trainers.losses import sequence_scores
    from strategy.trainers.run import load_tokenizer

    out = ranks.run(reward_model, str(real))[0]
    assert out["pad"] == out["eos"]  # the fallback every such checkpoint gets
    assert torch.isfinite(torch.tensor(out["final"]["loss"]))
    torch.testing.assert_close(out["left"], out["right"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["packed"], out["right"], rtol=1e-5, atol=1e-5)

    export = real / "rm" / "model"
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    assert model.config.pad_token_id == out["eos"]  # saved with the export
    tokenizer = load_tokenizer(ModelConfig(pretrain=str(export)))
    rows = [json.loads(line) for line in open(real / "data" / "pairs_test.jsonl")][:3]
    right = _pairs(tokenizer, rows, DataConfig(max_len=24))[0]
    with torch.no_grad():
        reloaded = sequence_scores(model, {k: right[k] for k in ("input_ids", "attention_mask")})
        # transformers' pooling: "the last token that is not pad", the one before the EOS
        hf_pooled = model(input_ids=right["input_ids"],
                          attention_mask=right["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(reloaded, out["right"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hf_pooled, reloaded)  # what one position everywhere avoids

    class Engine:  # ModelReward's view of an eval engine
        module, device = model, torch.device("cpu")

    reward = ModelReward(Engine(), AutoTokenizer.from_pretrained(export), max_len=24)
    prompts = [Tokenize(tokenizer, DataConfig()).prompt(r["prompt"]) for r in rows]
    chosen = reward(prompts, [r["chosen"] for r in rows], rows, [True] * len(rows))
    torch.testing.assert_close(torch.tensor(chosen), out["right"][: len(rows)],
                               rtol=1e-5, atol=1e-5)


def preference_and_chat(root: str) -> dict:
    from strategy.trainers import DPOConfig, DPOTrainer, Run, SFTTrainer

    out = {}
    argv = _argv(root, "dpo", "pairs", pretrain=f"{root}/init", tokenizer=f"{root}/tok",
                 dataset=f"{root}/prefs", eval_dataset=f"{root}/prefs")  # its test split
    with Run.from_args(argv, trainer=DPOTrainer) as run:
        reference = run.strategy.from_pretrained(f"{root}/init", frozen=True)
        trainer = run.trainer(DPOTrainer, run.model(), ref_model=reference,
                              dpo=run.config(DPOConfig))
        out["dpo"] = (trainer.fit(), trainer.history)
    argv = _argv(root, "chat", "sft_chat", pretrain=f"{root}/init", tokenizer=f"{root}/tok",
                 max_len=64, save_steps=2, disable_ds_ckpt=True)  # exports only, as OpenRLHF
    argv = [a for a in argv if not a.startswith("--eval_dataset")]
    with Run.from_args(argv) as run:
        trainer = run.trainer(SFTTrainer, run.model())
        batch = next(iter(trainer.train_dataloader))
        out["chat"] = (trainer.fit(), trainer.history, batch["input_ids"], batch["labels"])
    return out


def test_dpo_and_chat_sft_run_on_checkpoint_conventions(ranks, real):
    from transformers import AutoTokenizer

    out = ranks.run(preference_and_chat, str(real))[0]
    final, history = out["dpo"]  # conversational pairs from a Hub-layout folder, 2 splits
    assert [r["step"] for r in history] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in history) and "loss" in final
    _, history, ids, labels = out["chat"]
    assert [r["step"] for r in history] == [1, 2, 3]
    saved = sorted(p.name for p in (real / "chat" / "ckpt").iterdir())
    assert saved == ["global_step2_hf"], saved  # --disable_ds_ckpt: an export, no DeepSpeed state
    assert (real / "chat" / "ckpt" / "global_step2_hf" / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(real / "tok")
    end_of_turn, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    scored = labels[labels != -100]
    assert (scored == end_of_turn).any() and not (scored == eos).any()  # turns end at <|im_end|>
    assert (ids[:, 0] == tok.bos_token_id).all()  # the template's BOS opens each row, once
    assert not (ids[:, 1:] == tok.bos_token_id).any()


def grpo_rollouts(root: str) -> dict:
    from transformers import GenerationConfig

    from strategy.model import base_model
    from strategy.trainers import GRPOConfig, GRPOTrainer, Run
    from strategy.trainers.algorithms.grpo import sampling_rng
    from strategy.trainers.algorithms.rewards import build_rewards

    argv = _argv(root, "grpo", "sft", pretrain=f"{root}/noisy", tokenizer=f"{root}/tok",
                 reward_pretrain=f"{root}/rm_init", group_size=4, max_new_tokens=6,
                 kl_coef=0.1, max_steps=2)
    with Run.from_args(argv, trainer=GRPOTrainer) as run:
        reference = run.strategy.from_pretrained(run.model_cfg.pretrain, frozen=True)
        grpo = run.config(GRPOConfig)
        trainer = run.trainer(GRPOTrainer, run.model(), grpo=grpo, ref_model=reference,
                              reward=build_rewards(run, grpo))
        final = trainer.fit()
        prompts = next(iter(trainer.train_dataloader))
        hf_model = base_model(trainer.model.module)
        draws = {}
        for name in ("noisy", "blank"):
            if name == "blank":
                hf_model.generation_config = GenerationConfig()
            with sampling_rng(7, 0, run.strategy.rank):
                draws[name] = trainer.generate(prompts["prompt_ids"], prompts["prompt_mask"],
                                               sample=True)
    return {"final": final, "history": trainer.history, **draws}


def test_grpo_samples_what_it_scores(ranks, real):
    """A policy checkpoint whose generation_config sets repetition_penalty and min_p draws the
    same rollout (same seed) as one without them; a reward model with no pad token scores it."""
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(real / "noisy").repetition_penalty == 1.3
    for out in ranks.run(grpo_rollouts, str(real)):
        assert torch.equal(out["noisy"], out["blank"])
        assert [r["step"] for r in out["history"]] == [1, 2]
        assert all(torch.isfinite(torch.tensor(r["reward"])) for r in out["history"])
