"""PPO with a critic: the value loss by hand and against OpenRLHF's, the critic read at the
positions the policy's log-probs are; at 2 ranks under ZeRO-3 both engines train, the first
rollout's returns and advantages equal OpenRLHF's reward shaping + GAE + whitening on the same
inputs (both ranks' tokens together), and a mid-run resume gives bit-identical policy and critic
exports; bad settings are refused before any process group."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.support import peer_rl

REWARD = "strategy.demos.toy_task:reversal_reward"


# ------------------------------------------------------------ pure math


def test_value_loss_by_hand_and_against_openrlhf():
    from strategy.trainers.losses import value_token_losses

    values = torch.tensor([[1.0, 0.2, 3.0], [0.0, -1.0, 5.0]])
    old = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    losses, metrics = value_token_losses(values, old, returns, mask, clip=0.5)
    # row 0: clipped values 0.5, 0.2, 0.5 -> max(1.5^2, 1^2) = 2.25 (the clip is larger); 0.04;
    #        max(0.5^2, 2^2) = 4
    # row 1: clipped 0.0, -0.5 -> max(1, 1) = 1; max(1.5^2, 2^2) = 4; the last token is padding
    want = 0.5 * torch.tensor([[2.25, 0.04, 4.0], [1.0, 4.0, 0.0]])
    torch.testing.assert_close(losses, want)
    assert metrics["values"] == (pytest.approx(3.2), 5)
    assert metrics["value_clip_fraction"] == (1.0, 5)  # row 0 token 0: the clipped loss is larger
    for clip in (0.5, None):
        ours, _ = value_token_losses(values, old, returns, mask, clip=clip)
        theirs = peer_rl.value_loss(values, old, returns, mask, clip_eps=clip)
        torch.testing.assert_close(ours.sum() / mask.sum(), theirs)  # token mean == OpenRLHF's


def test_critic_values_sit_where_the_policy_log_probs_do(tmp_path):
    """``token_values`` reads the state before each completion token, the position whose logits
    ``token_logps`` scores (OpenRLHF's ``values[:, :-1]``)."""
    from transformers import AutoModelForTokenClassification

    from strategy.trainers.losses import IGNORE, token_logps, token_values
    from strategy.trainers.run import hf_config
    from tests.support.helpers import toy_root

    tok = toy_root(tmp_path, n_train=4, n_test=2, model_dir="init")
    config = hf_config("configs/tiny_llama.json", tok, num_labels=1)
    config.classifier_dropout = 0.0  # as Run.critic builds it
    critic = AutoModelForTokenClassification.from_config(config)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 0], [5, 9, 10, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
             "labels": torch.tensor([[IGNORE, IGNORE, 7, 8, IGNORE],
                                     [IGNORE, 9, 10, IGNORE, IGNORE]])}
    values, mask = token_values(critic, batch)
    full = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert mask.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert values[0, 1].item() == full[0, 1, 0].item()  # the state before token 7 (position 2)
    assert values[1, 0].item() == full[1, 0, 0].item() and values[0, 0].item() == 0.0
    policy = type("Policy", (), {"__call__": lambda self, **kw: type("Out", (), {
        "logits": torch.randn(2, 5, 11)})()})()
    assert torch.equal(token_logps(policy, batch)[1], mask)


# ------------------------------------------------------------ at 2 ranks


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("ppo")
    toy_root(root, n_train=45, n_test=11, model_dir="init")  # 2 rollouts of 16 per epoch
    shutil.copytree(root / "init", root / "init_scaled")  # a critic start that holds a scale
    config = json.loads((root / "init_scaled" / "config.json").read_text())
    (root / "init_scaled" / "config.json").write_text(json.dumps({**config, "mean": 0.5,
                                                                   "std": 4.0}))
    return root


def _argv(root, name: str, **extra) -> list[str]:
    args = {"zero_stage": 3, "micro_train_batch_size": 4, "train_batch_size": 16,
            "micro_eval_batch_size": 4, "reward_fn": REWARD, "max_new_tokens": 8,
            "max_len": 24, "learning_rate": 1e-3, "critic_learning_rate": 2e-3,
            "lr_warmup_ratio": 0.0, "kl_coef": 0.05, "gamma": 0.9, "lambd": 0.8,
            "value_clip": 0.2, "max_epochs": 2, "max_steps": 4, "save_steps": 2,
            "logging_steps": 1, "seed": 3,
            "save_value_network": True, "pretrain": f"{root}/init",
            "dataset": f"{root}/data/train.jsonl", "eval_dataset": f"{root}/data/test.jsonl",
            "save_path": f"{root}/{name}/model", "ckpt_path": f"{root}/{name}/ckpt",
            "log_dir": f"{root}/{name}/logs", **extra}
    flags = {True: "--{}", False: "--no-{}"}
    return [flags[v].format(k) if isinstance(v, bool) else f"--{k}={v}" for k, v in args.items()]


def ppo_run(root: str, name: str, **extra) -> dict:
    from strategy.trainers import PPOConfig, PPOTrainer
    from strategy.trainers.algorithms.ppo import build_critic
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.run import Run

    class Recording(PPOTrainer):
        """Keeps the first rollout's experience (a public hook, then its result)."""

        seen: list = []

        def advantages(self, batches):
            super().advantages(batches)
            if not self.seen:
                keys = ("rewards", "old_logp", "ref_logp", "old_values", "labels", "returns",
                        "advantages")
                self.seen.extend({k: b[k].tolist() for k in keys} for b in batches)

    with Run.from_args(_argv(root, name, **extra), trainer=PPOTrainer) as run:
        reference = run.strategy.from_pretrained(run.model_cfg.pretrain, frozen=True)
        ppo = run.config(PPOConfig)
        trainer = run.trainer(Recording, run.model(), grpo=ppo, ref_model=reference,
                              reward=build_rewards(run, ppo), critic=build_critic(run, ppo))
        final = trainer.fit()
    return {"history": trainer.history, "final": final, "experience": Recording.seen}


def _openrlhf_experience(ranks_seen: list[list[dict]], kl_coef: float, gamma: float,
                         lambd: float) -> tuple[list, list]:
    """OpenRLHF's ``compute_reward`` (k1 KL), ``get_advantages_and_returns`` and whitening over
    every micro-batch of every rank, from the rollout's recorded inputs."""
    advantages, returns, masks = [], [], []
    for seen in ranks_seen:
        for b in seen:
            mask = (torch.tensor(b["labels"])[:, 1:] != -100).float()
            kl = peer_rl.compute_approx_kl(torch.tensor(b["old_logp"]),
                                           torch.tensor(b["ref_logp"]), "k1") * mask
            rewards = peer_rl.compute_reward(torch.tensor(b["rewards"]), kl_coef, kl, mask)
            adv, ret = peer_rl.get_advantages_and_returns(torch.tensor(b["old_values"]),
                                                          rewards, mask, gamma, lambd)
            advantages.append(adv)
            returns.append(ret)
            masks.append(mask)
    return [a * m for a, m in zip(peer_rl.whiten(advantages, masks), masks)], returns


@pytest.mark.slow
def test_ppo_zero3_trains_both_engines_matches_openrlhf_and_resumes_exactly(ranks, toy):
    from safetensors.torch import load_file

    full = ranks.run(ppo_run, str(toy), "full")
    history = full[0]["history"]
    assert [row["step"] for row in history] == [1, 2, 3, 4]
    first = history[0]
    assert first["ratio"] == 1.0 and first["value_clip_fraction"] == 0.0  # old == new at first
    critic = [row["critic_loss"] for row in history]
    assert all(c > 0 for c in critic) and len(set(critic)) == 4, critic

    # the first rollout's experience against OpenRLHF's arithmetic on the same inputs
    want_adv, want_ret = _openrlhf_experience([out["experience"] for out in full], 0.05, 0.9, 0.8)
    got = [b for out in full for b in out["experience"]]
    assert len(got) == len(want_adv) == 4  # 2 micro-batches per rank
    for b, adv, ret in zip(got, want_adv, want_ret):
        torch.testing.assert_close(torch.tensor(b["returns"]), ret)
        torch.testing.assert_close(torch.tensor(b["advantages"]), adv, rtol=1e-5, atol=1e-5)
    assert any(r != 0 for b in got for r in b["rewards"])  # the reward reached the advantages

    # both engines moved: the exports differ from where they started
    start = load_file(toy / "init" / "model.safetensors")
    policy = load_file(toy / "full" / "model" / "model.safetensors")
    value = load_file(toy / "full" / "model_critic" / "model.safetensors")
    assert not torch.equal(policy["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert not torch.equal(value["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert set(value) - {k.replace("lm_head", "score") for k in start} <= {"score.weight"}

    for ckpt in ("ckpt", "ckpt_critic"):  # both engines checkpointed at step 2 and 4
        path = toy / "full" / ckpt
        assert (path / "global_step2").is_dir()
        shutil.rmtree(path / "global_step4")
        (path / "latest").write_text("global_step2")
    # resumed with both engines' training states asleep through each rollout (--ds_enable_sleep):
    # the same steps bit for bit
    resumed = ranks.run(ppo_run, str(toy), "full", load_checkpoint=True, ds_enable_sleep=True)[0]
    keys = ("loss", "critic_loss", "reward", "kl", "ratio", "values", "grad_norm")
    assert [{k: r[k] for k in keys} for r in resumed["history"]] == \
        [{k: r[k] for k in keys} for r in history[2:]]  # bit-identical
    for name, before in (("model", policy), ("model_critic", value)):
        after = load_file(toy / "full" / name / "model.safetensors")
        assert after.keys() == before.keys()
        assert all(torch.equal(after[k], before[k]) for k in before), name

    # --micro_rollout_batch_size 3: the experience stage's forwards (reference, sampling policy,
    # critic) take a rank's 8 completions 3 at a time, not in the training micro-batches of 4
    by_3 = ranks.run(ppo_run, str(toy), "by_3", micro_rollout_batch_size=3, save_steps=-1)
    for want, got in zip(full, by_3):
        for a, b in zip(want["experience"], got["experience"]):
            for key in ("old_logp", "ref_logp", "old_values", "advantages"):
                torch.testing.assert_close(torch.tensor(b[key]), torch.tensor(a[key]),
                                           rtol=1e-5, atol=1e-6)
    assert [r["step"] for r in by_3[0]["history"]] == [1, 2, 3, 4]
    for a, b in zip(history, by_3[0]["history"]):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)

    # --dynamic_batch: training micro-batches by a 40-token budget (rows x the longest), not 4
    # rows; policy and critic both step after each step's last one: the same updates
    budget = ranks.run(ppo_run, str(toy), "budget", dynamic_batch=True, max_tokens_per_gpu=40,
                       save_steps=-1)
    for a, b in zip(history, budget[0]["history"]):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), (a["step"], key)


def mixed_stages(root: str) -> dict:
    """The policy at ZeRO-2, the critic at its own ZeRO-3 with CPU Adam: what each engine is."""
    from strategy.internals import is_zero3_param
    from strategy.trainers import PPOConfig, PPOTrainer
    from strategy.trainers.algorithms.ppo import build_critic
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.losses import IGNORE, token_values
    from strategy.trainers.run import Run

    argv = _argv(root, "mixed", zero_stage=2, critic_zero_stage=3, critic_adam_offload=True,
                 max_steps=2, save_steps=-1, save_value_network=False,
                 critic_pretrain=f"{root}/init_scaled", normalize_reward=True)
    with Run.from_args(argv, trainer=PPOTrainer) as run:
        reference = run.strategy.from_pretrained(run.model_cfg.pretrain, frozen=True)
        ppo = run.config(PPOConfig)
        built = {"model": run.model(), "critic": build_critic(run, ppo)}  # each as its stage says
        partitioned = {k: any(is_zero3_param(p) for p in m.parameters()) for k, m in built.items()}
        trainer = run.trainer(PPOTrainer, built["model"], grpo=ppo, ref_model=reference,
                              reward=build_rewards(run, ppo), critic=built["critic"])
        trainer.fit()
        batch = trainer.to_device({  # --normalize_reward: the critic's values by its scale
            "input_ids": torch.tensor([[5, 6, 7, 8, 0]]), "labels": torch.tensor(
                [[IGNORE, IGNORE, 7, 8, IGNORE]]), "attention_mask": torch.ones(1, 5).long()})
        with torch.no_grad():
            scaled, raw = trainer.values(batch)[0], token_values(trainer.critic, batch)[0]
        engines = {"model": trainer.model, "critic": trainer.critic}
        return {"stage": {k: e.zero_optimization_stage() for k, e in engines.items()},
                "partitioned": partitioned,
                "adam": {k: type(e.basic_optimizer).__name__ for k, e in engines.items()},
                "head": (trainer.critic.module.dropout.p, trainer.critic.module.score.bias),
                "history": trainer.history, "scale": trainer.value_scale,
                "values": (scaled.cpu(), raw.cpu())}


@pytest.mark.slow
def test_the_critic_runs_at_its_own_zero_stage_and_offload(ranks, toy):
    out = ranks.run(mixed_stages, str(toy))[0]
    assert out["stage"] == {"model": 2, "critic": 3}
    assert out["partitioned"] == {"model": False, "critic": True}  # at construction already
    assert out["adam"] == {"model": "FusedAdam", "critic": "DeepSpeedCPUAdam"}
    assert out["head"] == (0.0, None)  # no dropout (old and new values agree), no bias
    losses = [row["critic_loss"] for row in out["history"]]
    assert len(losses) == 2 and losses[0] != losses[1] and all(v > 0 for v in losses)
    assert not (toy / "mixed" / "model_critic").exists()  # no --save_value_network: no export
    # --normalize_reward with a critic start whose config.json holds mean 0.5, std 4 (OpenRLHF's
    # critic from a reward model): its values (value - 0.5) / 4 where scored, 0 elsewhere
    assert out["scale"] == (0.5, 4.0)
    scaled, raw = out["values"]
    assert torch.equal(scaled != 0, raw != 0) and (raw != 0).sum() == 2
    torch.testing.assert_close(scaled[raw != 0], (raw[raw != 0] - 0.5) / 4.0)


def test_a_derived_factory_leaves_the_runs_construction_hook_as_it_found_it():
    from transformers.integrations.deepspeed import (
        deepspeed_config,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    from strategy.model import construction_hook

    stage = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with construction_hook(stage):  # the run's hook (a ZeRO-3 policy)
        run_hook = deepspeed_config()
        with construction_hook(None):  # a ZeRO-2 critic builds without one
            assert not is_deepspeed_zero3_enabled()
        assert deepspeed_config() is run_hook and is_deepspeed_zero3_enabled()
        with construction_hook({**stage, "zero_optimization": {"stage": 3, "x": 1}}):
            assert deepspeed_config()["zero_optimization"]["x"] == 1
        assert deepspeed_config() is run_hook
    assert not is_deepspeed_zero3_enabled()  # none before, none after
    unset_hf_deepspeed_config()


CASES = [
    ({"critic_pretrain": "OPT"}, "is invalid: a opt model has no value-head class in "
                                 "transformers"),
    ({"critic_pretrain": "TWO"}, "is invalid: its LlamaForSequenceClassification head has 2 "
                                 "labels; a critic needs a 1-label value head"),
    ({"critic_pretrain": "EMPTY"}, "is invalid: the critic starts from it, but it holds no model "
                                   "config.json"),
    ({"advantage_estimator": "rloo"}, "advantage_estimator='rloo' is invalid: use one of gae"),
    ({"lambd": 1.5}, "lambd=1.5 is invalid: use a GAE lambda in [0, 1]"),
    ({"gamma": 0.0}, "gamma=0.0 is invalid: use a discount in (0, 1]"),
    ({"value_clip": -1}, "value_clip=-1.0 is invalid: use a positive range"),
    ({"critic_learning_rate": 0}, "critic_learning_rate=0.0 is invalid: use a positive number"),
    ({"critic_zero_stage": 4}, "critic_zero_stage=4 is invalid: use 0, 1, 2 or 3"),
    ({"critic_zero_stage": 0, "critic_adam_offload": True}, "critic_adam_offload=True is invalid: "
                                                            "optimizer offload needs ZeRO; set "
                                                            "--critic_zero_stage 1, 2 or 3"),
]


@pytest.mark.parametrize("change,message", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_ppo_setting_fails_before_process_group(toy, tmp_path, monkeypatch, change,
                                                     message):
    from strategy.errors import ConfigError
    from strategy.trainers import PPOTrainer
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch)
    (tmp_path / "OPT").mkdir()
    (tmp_path / "OPT" / "config.json").write_text(json.dumps({"model_type": "opt"}))
    (tmp_path / "TWO").mkdir()
    (tmp_path / "TWO" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForSequenceClassification"],
        "id2label": {"0": "bad", "1": "good"}}))
    (tmp_path / "EMPTY").mkdir()
    change = {k: (str(tmp_path / v) if v in ("OPT", "TWO", "EMPTY") else v)
              for k, v in change.items()}
    with pytest.raises(ConfigError) as info:
        Run.from_args(_argv(toy, "refused", **change), trainer=PPOTrainer)
    assert message in str(info.value) and "\n" not in str(info.value)
