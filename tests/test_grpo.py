"""GRPO: advantages and loss on hand-computed groups; at 2 ranks on the real engine, the first
update's ratio 1 and KL 0, an exact mid-run resume (sampling and EMA weights included), greedy
generation under ZeRO-3 equal to ZeRO-0's, the offloaded reference's log-probs equal to the
resident one's, a reward model's scores under ZeRO-3 equal to a plain forward's, and the bad
settings refused before any process group (or at the first bad reward, naming the prompt)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

REWARD = "strategy.demos.toy_task:reversal_reward"


def text_reward(prompt: str, completion: str, row: dict):
    """A broken reward (for the test below): text instead of a number, on rank 1 only."""
    return "abc" if os.environ.get("RANK") == "1" else 1.0


# ------------------------------------------------------------ pure math


def test_group_advantages_by_hand():
    from strategy.trainers.losses import group_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])
    got = group_advantages(rewards, 4, eps=0.01)
    std = math.sqrt(((0.5**2) * 2) / 3)  # unbiased: squared deviations 0.25, 0.25, 0, 0 over 3
    want = torch.tensor([0.5, -0.5, 0.0, 0.0]) / (std + 0.01)
    torch.testing.assert_close(got[:4], want)
    assert torch.equal(got[4:], torch.zeros(4))  # a group of equal rewards: no push at all


def test_grpo_token_losses_by_hand():
    from strategy.trainers.losses import grpo_token_losses

    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.3]]))
    old = torch.log(torch.tensor([[0.25, 0.2, 0.3], [0.3, 0.6, 0.3]]))
    ref = torch.log(torch.tensor([[0.5, 0.1, 0.9], [0.3, 0.3, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    losses, metrics = grpo_token_losses(logp, old, ref, adv, mask, clip_eps=0.2, beta=0.5)
    # row 0: ratios 2, 1, 3 -> clipped to 1.2, 1, 1.2 (advantage > 0: min picks the clip)
    # row 1: ratios 1, 0.5 -> 0.5 is below 0.8: with advantage < 0 min picks -2 * 0.8 = -1.6
    k3 = (0.1 / 0.2) - math.log(0.1 / 0.2) - 1  # ref/pi = 0.5 at row 0 token 1
    want = torch.tensor([[-1.2, -1.0 + 0.5 * k3, -1.2], [2.0, 1.6, 0.0]])
    torch.testing.assert_close(losses, want)
    assert metrics["clip_fraction"] == (3.0, 5)  # tokens 0 and 2 of row 0, token 1 of row 1
    assert metrics["kl"][1] == 5 and metrics["kl"][0] == pytest.approx(k3)
    assert metrics["ratio"][0] == pytest.approx(2 + 1 + 3 + 1 + 0.5)


# ------------------------------------------------------------ at 2 ranks


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    from strategy.trainers.run import hf_config
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("grpo")
    tok = toy_root(root, n_train=45, n_test=13, model_dir="init")  # 5 rollouts of 8, 5 left
    torch.manual_seed(1)  # a reward model: the same backbone family, one output
    scorer = AutoModelForSequenceClassification.from_config(
        hf_config("configs/tiny_llama.json", tok, num_labels=1))
    scorer.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    scorer.config.mean, scorer.config.std = 0.25, 2.0  # as OpenRLHF's reward models save them
    scorer.save_pretrained(root / "rm_normalized")
    tok.save_pretrained(root / "rm_normalized")
    return root


def _argv(root, name: str, **extra) -> list[str]:
    args = {"zero_stage": 2, "micro_train_batch_size": 8, "train_batch_size": 32,
            "micro_eval_batch_size": 4, "group_size": 4, "reward_fn": REWARD,
            "max_new_tokens": 8, "max_len": 24, "learning_rate": 1e-3, "lr_warmup_ratio": 0.0,
            "kl_coef": 0.1, "ppo_epochs": 2, "max_steps": 4, "logging_steps": 1, "seed": 5,
            "pretrain": f"{root}/init", "dataset": f"{root}/data/train.jsonl",
            "eval_dataset": f"{root}/data/test.jsonl", "save_path": f"{root}/{name}/model",
            "ckpt_path": f"{root}/{name}/ckpt", "log_dir": f"{root}/{name}/logs", **extra}
    flags = {True: "--{}", False: "--no-{}"}
    return [flags[v].format(k) if isinstance(v, bool) else f"--{k}={v}" for k, v in args.items()]


def train(root: str, name: str, **extra) -> dict:
    from strategy.internals.transformers import CACHE_KEYWORD
    from strategy.trainers import GRPOConfig, GRPOTrainer
    from strategy.trainers.algorithms.preference import reference_model
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.run import Run

    with Run.from_args(_argv(root, name, **extra), trainer=GRPOTrainer) as run:
        model = run.model()
        grpo = run.config(GRPOConfig)
        trainer = run.trainer(GRPOTrainer, model, grpo=grpo, ref_model=reference_model(run, model),
                              reward=build_rewards(run, grpo),
                              packing=run.data.packing_samples)
        attention = {"policy": trainer.model.module.config._attn_implementation,
                     "reference": trainer.ref_model.module.config._attn_implementation}
        packed = {"policy": 0, "reference": 0}  # forwards of one packed row (no attention mask)
        shared = {"policy": [], "reference": []}  # rows of each update forward on a KV cache
        rows = {"policy": [], "reference": []}  # rows of each forward without gradients
        grad_rows = []  # rows of each training forward of the policy
        asleep = []  # each policy forward: (with gradients, its training states off the device)

        def count(name):
            def hook(module, args, kwargs):
                packed[name] += kwargs.get("attention_mask") is None and kwargs[
                    "input_ids"].shape[0] == 1
                if not torch.is_grad_enabled() and kwargs.get(CACHE_KEYWORD) is None \
                        and not kwargs.get("use_cache"):  # not a generation step
                    rows[name].append(int(kwargs["input_ids"].shape[0]))
                if name == "policy":
                    asleep.append((torch.is_grad_enabled(), run.strategy.asleep(trainer.model)))
                if torch.is_grad_enabled() and name == "policy":
                    grad_rows.append(int(kwargs["input_ids"].shape[0]))
                if kwargs.get(CACHE_KEYWORD) is not None and (name == "reference" or
                                                        torch.is_grad_enabled()):
                    shared[name].append(int(kwargs["input_ids"].shape[0]))
            return hook

        trainer.model.module.register_forward_pre_hook(count("policy"), with_kwargs=True)
        trainer.ref_model.module.register_forward_pre_hook(count("reference"), with_kwargs=True)
        final = trainer.fit()
    return {"history": trainer.history, "final": final, "attention": attention, "packed": packed,
            "shared": shared, "rows": rows, "grad_rows": grad_rows, "asleep": asleep}


@pytest.mark.slow
def test_first_update_and_exact_resume(ranks, toy):
    from safetensors.torch import load_file

    ema = {"ema_beta": 0.9, "save_ema": True}  # any trainer keeps EMA weights: GRPO's too
    full = ranks.run(train, str(toy), "full", save_steps=2, **ema)
    averaged = load_file(toy / "full" / "model_ema" / "model.safetensors")
    current = load_file(toy / "full" / "model" / "model.safetensors")
    assert averaged.keys() == current.keys()
    assert not all(torch.equal(averaged[k], current[k]) for k in current)
    first = full[0]["history"][0]
    assert first["ratio"] == 1.0 and first["kl"] == 0.0 and first["clip_fraction"] == 0.0
    second = full[0]["history"][1]  # the rollout's second update: the policy moved
    assert second["ratio"] != 1.0 and second["kl"] > 0.0
    keys = ("loss", "reward", "reward_std", "kl", "ratio", "clip_fraction", "grad_norm",
            "completion_length")
    same = [[{k: row[k] for k in keys} for row in out["history"]] for out in full]
    assert same[0] == same[1]  # every rank logs the same reduced figures
    for row in full[0]["history"]:
        assert 0.0 <= row["reward"] <= 1.0 and row["completion_length"] >= 1
    for row in full[0]["history"][::2]:  # a rollout's first step: its generation is in its time
        assert row["step_time"] > row["generation_s"] > 0
    assert "exact_match" in full[0]["final"] and "reward" in full[0]["final"]

    ckpt = toy / "full" / "ckpt"
    shutil.rmtree(ckpt / "global_step4")
    (ckpt / "latest").write_text("global_step2")
    resumed = ranks.run(train, str(toy), "full", save_steps=2, load_checkpoint=True, **ema)[0]
    want = [{k: row[k] for k in keys} for row in full[0]["history"][2:]]
    assert [{k: row[k] for k in keys} for row in resumed["history"]] == want  # bit-identical
    assert resumed["final"] == full[0]["final"]
    again = load_file(toy / "full" / "model_ema" / "model.safetensors")  # EMA restored exactly
    assert all(torch.equal(again[k], averaged[k]) for k in averaged)
    policy = load_file(toy / "full" / "model" / "model.safetensors")  # and the policy's export
    assert policy.keys() == current.keys()
    assert all(torch.equal(policy[k], current[k]) for k in current)


@pytest.mark.slow
def test_padding_free_and_shared_prompt_updates_match_per_row_ones(ranks, toy):
    """The update's forwards (policy and reference) three ways log the same figures (one
    rollout, two optimizer steps): per row (prompt + completion, padded: ZeRO-3's default, where
    every forward call gathers the weights), each distinct prompt once with its completions on
    its cache (the default below ZeRO-3, and asked for at ZeRO-3), and ``--packing_samples`` (no
    padding, on ``sdpa_varlen``)."""
    runs = {name: ranks.run(train, str(toy), name, max_steps=2, **extra) for name, extra in (
        ("per_row", {"zero_stage": 3}), ("shared", {}), ("packed", {"packing_samples": True}),
        ("shared_zero3", {"zero_stage": 3, "shared_prompt_forward": True}))}
    assert [r["attention"] for r in runs["packed"]] == [{"policy": "sdpa_varlen",
                                                        "reference": "sdpa_varlen"}] * 2
    assert runs["per_row"][0]["attention"]["policy"] == "sdpa"
    for name in ("per_row", "shared"):
        assert [r["packed"] for r in runs[name]] == [{"policy": 0, "reference": 0}] * 2
    for r in runs["packed"]:  # 2 micro-batches per rank: 2 steps x 2 policy forwards, 1 ref pass
        assert r["packed"] == {"policy": 4, "reference": 2}, r["packed"]
        assert r["shared"] == {"policy": [], "reference": []}
    assert runs["per_row"][0]["shared"] == {"policy": [], "reference": []}
    for r in runs["shared"] + runs["shared_zero3"]:  # a micro-batch of 8 holds 2 prompts x 4:
        assert r["shared"] == {"policy": [2, 8] * 4, "reference": [2, 8] * 2}, r["shared"]
    per_row = runs["per_row"][0]["history"]  # (2 rows, then the 8 on their cache)
    for name in ("shared", "packed", "shared_zero3"):
        got_rows = runs[name][0]["history"]
        assert [r["step"] for r in got_rows] == [1, 2]
        for want, got in zip(per_row, got_rows):
            assert got["reward"] == want["reward"] and got["completion_length"] == want[
                "completion_length"]  # the same rollout
            for key in ("loss", "kl", "ratio", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (name, key)
        assert got_rows[1]["kl"] > 0 and got_rows[1]["ratio"] != 1.0  # the second step moved off


def test_the_entropy_bonus_subtracts_its_coefficient_times_the_logged_entropy(ranks, toy):
    """At ZeRO-3, one rollout stepped twice: the first update (ratio 1, KL 0) logs the same
    entropy with and without ``--entropy_coef 0.5`` (and packed), and its loss is lower by 0.5 x
    that entropy (OpenRLHF's ``loss -= entropy_loss * entropy_coef``); the bonus then moves the
    policy (the second step's figures differ)."""
    runs = {name: ranks.run(train, str(toy), name, max_steps=2, zero_stage=3, **extra)[0]
            ["history"] for name, extra in (("plain", {}), ("bonus", {"entropy_coef": 0.5}),
                                            ("bonus_packed", {"entropy_coef": 0.5,
                                                              "packing_samples": True}))}
    first = {name: rows[0] for name, rows in runs.items()}
    assert first["plain"]["kl"] == 0.0 and first["plain"]["entropy"] > 0.1
    for name in ("bonus", "bonus_packed"):
        assert first[name]["entropy"] == pytest.approx(first["plain"]["entropy"], rel=1e-5)
        assert first[name]["loss"] - first["plain"]["loss"] == pytest.approx(
            -0.5 * first["plain"]["entropy"], rel=1e-4, abs=1e-6), name
    assert runs["bonus"][1]["entropy"] != pytest.approx(runs["plain"][1]["entropy"], rel=1e-6)


def test_held_out_prompts_sampled_k_times_log_pass_at_k(ranks, toy):
    """``--eval_temperature 1 --eval_n_samples 3`` (OpenRLHF's eval flags): the held-out figures
    of 3 samples per prompt (13 prompts, 7 and 6 per rank): pass3 at least pass1 (= reward),
    exact match alike, each a share in [0, 1]; the same samples on a rerun; greedy (the
    default) logs no pass figures."""
    sampled = {"eval_temperature": 1.0, "eval_n_samples": 3, "eval_steps": 2}
    runs = [ranks.run(train, str(toy), name, max_steps=2, **sampled)[0]["final"]
            for name in ("sampled", "sampled_again")]
    final = runs[0]
    assert runs[1] == final
    assert 0 <= final["pass1"] <= final["pass3"] <= 1 and final["pass1"] == final["reward"]
    assert 0 <= final["exact_match"] <= final["exact_match_pass3"] <= 1
    assert final["pass3"] > final["pass1"], final  # 3 samples of an untrained policy differ
    greedy = ranks.run(train, str(toy), "greedy_eval", max_steps=2, eval_steps=2)[0]["final"]
    assert not [key for key in greedy if key.startswith("pass")], greedy


def split_rollout(root: str, name: str, replay: list | None = None, **extra) -> dict:
    """GRPO recording each optimizer step's micro-batches (``replay`` None), or generating
    nothing and training on ``replay``'s, this rank's, one step's per rollout, their "old"
    log-probs taken here from the policy before its first update (frozen)."""
    import os

    from strategy.trainers import GRPOConfig, GRPOTrainer
    from strategy.trainers.algorithms.preference import reference_model
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.losses import token_logps
    from strategy.trainers.run import Run

    mine = None if replay is None else replay[int(os.environ["RANK"])]

    class Split(GRPOTrainer):
        def rollout(self, batch):
            if mine is None:
                return super().rollout(batch)
            self.next_prompts()  # the prompt cursor moves as a rollout's would
            if not fed:  # before any update: every replayed step's "old" log-probs, frozen
                for batches, metrics in mine:
                    batches = [{k: torch.from_numpy(v) if hasattr(v, "dtype") else v
                                for k, v in b.items() if k != "old_logp"} for b in batches]
                    with torch.no_grad():
                        for b in batches:
                            b["old_logp"] = token_logps(self.model, self.to_device(b),
                                                        self.grpo.temperature)[0].cpu()
                    fed.append((batches, metrics))
            return fed[len(self.history)]

        def train_steps(self, epoch, count):
            for step in super().train_steps(epoch, count):  # numpy: tensors sent between
                steps.append(([{k: v.cpu().numpy() if torch.is_tensor(v) else v  # processes
                                for k, v in b.items()} for b in step.batches],  # leave a pymp
                              dict(step.metrics)))  # folder behind (torch's fd sharing)
                yield step

    steps, fed = [], []
    with Run.from_args(_argv(root, name, **extra), trainer=Split) as run:
        model, grpo = run.model(), run.config(GRPOConfig)
        trainer = run.trainer(Split, model, grpo=grpo, ref_model=reference_model(run, model),
                              reward=build_rewards(run, grpo))
        trainer.fit()
    return {"history": trainer.history, "steps": steps}


@pytest.mark.slow
def test_a_rollout_of_two_train_batches_equals_two_rollouts_of_a_frozen_policy(ranks, toy):
    """``--rollout_batch_size 8`` prompts x 4 = 32 completions in optimizer steps of 16 (OpenRLHF's
    --rollout.batch_size with --train.batch_size): two updates per rollout, the second's ratio
    to the policy that sampled it. The same samples fed as two rollouts of one step each, their
    "old" log-probs those of that frozen policy, give the same two updates (losses, KL, ratio,
    gradient norm, to 1e-6)."""
    base = {"train_batch_size": 16, "ppo_epochs": 1, "max_steps": 2, "group_size": 4}
    split = ranks.run(split_rollout, str(toy), "split", rollout_batch_size=8, **base)
    assert [len(r["steps"]) for r in split] == [2, 2]  # one rollout, two steps, per rank
    replay = [[step for step in r["steps"]] for r in split]
    fed = ranks.run(split_rollout, str(toy), "fed", replay=replay, **base)
    want, got = split[0]["history"], fed[0]["history"]
    assert [r["step"] for r in want] == [r["step"] for r in got] == [1, 2]
    for a, b in zip(want, got):
        for key in ("loss", "kl", "ratio", "grad_norm", "reward", "completion_length"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (a["step"], key)
    assert want[1]["ratio"] != 1.0 and want[1]["kl"] > 0  # the second step's ratio is off 1
    assert [r["rollout"] for r in want] == [1, 1] and [r["rollout"] for r in got] == [1, 2]


def test_experience_micro_batches_regroup_rows_and_lay_outputs_back():
    """``regrouped`` deals right-padded rows of micro-batches of different widths into groups of
    another size, each trimmed to its longest row; ``scattered`` puts per-token outputs of those
    groups back in the first micro-batches' rows and widths."""
    from strategy.trainers.algorithms.completions import (
        completion_batch,
        regrouped,
        scattered,
    )

    prompts = [[5, 6], [7], [8, 9, 10], [11], [12, 13]]
    completions = [[1], [4], [1], [2, 3, 4, 5], [6, 7]]
    batches = [completion_batch(prompts[:2], completions[:2], 0),
               completion_batch(prompts[2:], completions[2:], 0)]
    parts = regrouped(batches, [3, 2], pad=0)
    assert [p["input_ids"].tolist() for p in parts] == [
        [[5, 6, 1, 0], [7, 4, 0, 0], [8, 9, 10, 1]], [[11, 2, 3, 4, 5], [12, 13, 6, 7, 0]]]
    assert parts[1]["labels"].tolist()[1] == [-100, -100, 6, 7, -100]
    assert parts[1]["attention_mask"].tolist()[1] == [1, 1, 1, 1, 0]
    # an output that tells rows and positions apart: row number x 10 + position, on targets
    outputs = [(torch.arange(len(p["input_ids"]))[:, None] * 10 + torch.arange(
        p["input_ids"].shape[1] - 1)).float() * (p["labels"][:, 1:] != -100) for p in parts]
    laid = scattered(outputs, batches)
    assert [t.shape for t in laid] == [(2, 2), (3, 4)]
    assert laid[0].tolist() == [[0, 1], [10, 0]] and laid[1].tolist() == [
        [0, 0, 22, 0], [0, 1, 2, 3], [0, 11, 12, 0]]


def test_a_token_budget_cuts_rows_in_order_into_as_few_micro_batches_as_fit():
    """``fewest_chunks``: contiguous micro-batches of at most the budget's forward tokens (rows x
    the longest when padded, the sum when packed; a longer row alone). ``chunk_sizes``: a given
    count of them whose largest is smallest. ``budget_bounds``: each optimizer step's rows cut
    on their own, into the most micro-batches any rank needs when told."""
    from strategy.trainers.algorithms.token_budget import (
        budget_bounds,
        chunk_sizes,
        fewest_chunks,
        forward_tokens,
    )

    lengths = [5, 3, 7, 2, 6, 9, 1]
    assert forward_tokens([5, 3, 7], packed=False) == 21 and forward_tokens([5, 3, 7], True) == 15
    assert fewest_chunks(lengths, 10, packed=True) == 4  # [5,3] [7,2] [6] [9,1], in order
    assert fewest_chunks(lengths, 14, packed=False) == 5  # [5,3] [7,2] [6] [9] [1]
    assert fewest_chunks([20, 1], 10, packed=True) == 2  # a longer row trains alone
    for packed in (True, False):
        for count in range(1, len(lengths) + 1):
            sizes = chunk_sizes(lengths, count, packed)
            assert len(sizes) == count and sum(sizes) == len(lengths) and min(sizes) >= 1
            starts = [sum(sizes[:i]) for i in range(count)]
            worst = max(forward_tokens(lengths[a:a + n], packed) for a, n in zip(starts, sizes))
            # no contiguous cut into ``count`` parts has a smaller largest forward (the
            # longest row's own is the least there is)
            assert worst == max(lengths) or fewest_chunks(lengths, worst - 1, packed) > count
    assert chunk_sizes(lengths, 3, packed=True) == [3, 2, 2]  # 15, 8, 10 tokens
    bounds = budget_bounds([4, 4, 4, 4, 9, 1, 1, 1], steps=2, budget=8, packed=True)
    assert bounds == [(0, 2, 0), (2, 4, 0), (4, 5, 1), (5, 8, 1)]
    assert budget_bounds([4, 4, 4, 4, 9, 1, 1, 1], 2, 8, True, most=[3, 3]) == [
        (0, 1, 0), (1, 2, 0), (2, 4, 0), (4, 5, 1), (5, 6, 1), (6, 8, 1)]


def test_a_rollouts_micro_batches_go_to_their_optimizer_steps():
    """``by_step``: runs of the same ``rollout_step`` (the experience stage's cut: any count
    each, and one step's alone when a subclass feeds a later step's as a rollout of its own),
    else equal runs in order (a subclass's micro-batches that carry none)."""
    from strategy.trainers.algorithms.grpo import by_step

    cut = [{"rollout_step": s, "i": i} for i, s in enumerate([0, 0, 0, 1, 1])]
    assert [[b["i"] for b in run] for run in by_step(cut, 2)] == [[0, 1, 2], [3, 4]]
    fed = [{"rollout_step": 1, "i": i} for i in range(2)]  # a later step fed as a rollout
    assert [[b["i"] for b in run] for run in by_step(fed, 1)] == [[0, 1]]
    own = [{"i": i} for i in range(4)]
    assert [[b["i"] for b in run] for run in by_step(own, 2)] == [[0, 1], [2, 3]]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_micro_batches_by_a_token_budget_give_the_count_based_updates(ranks, toy, stage):
    """``--dynamic_batch --max_tokens_per_gpu 70`` (OpenRLHF's --train.dynamic_batch_enable):
    a rank's 16 completions of each optimizer step cut by the budget into micro-batches of
    varying count (not DeepSpeed's 2 accumulation steps), DeepSpeed stepping after each step's
    last; the experience forwards by their own budget (``--rollout_max_tokens_per_gpu 100``).
    In fp32, at ZeRO-2 and ZeRO-3, the updates equal the row-count run's (loss, KL, ratio,
    grad norm to 1e-6) over a rollout's two passes (``--ppo_epochs 2``)."""
    base = {"zero_stage": stage, "max_steps": 2, "eval_steps": -1, "shared_prompt_forward": False}
    counted = ranks.run(train, str(toy), f"counted_{stage}", **base)
    budget = ranks.run(train, str(toy), f"budget_{stage}", dynamic_batch=True,
                       max_tokens_per_gpu=70, rollout_max_tokens_per_gpu=100, **base)
    for out in counted:  # training micro-batches of 8: two per step
        assert out["grad_rows"] == [8, 8, 8, 8], out["grad_rows"]
    for out, other in zip(budget, budget[::-1]):
        assert sum(out["grad_rows"]) == 32 and max(out["grad_rows"]) < 8
        assert len(out["grad_rows"]) == len(other["grad_rows"])  # as many on every rank
        assert sum(out["rows"]["reference"]) == 16 and len(out["rows"]["reference"]) > 2
    want, got = counted[0]["history"], budget[0]["history"]
    assert [r["step"] for r in want] == [r["step"] for r in got] == [1, 2]
    for a, b in zip(want, got):
        assert b["reward"] == a["reward"] and b["completion_length"] == a["completion_length"]
        for key in ("loss", "kl", "ratio", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (stage, a["step"], key)
    assert want[1]["ratio"] != 1.0  # the second pass moved off the sampling policy


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_sleeping_training_states_during_rollouts_give_the_same_updates(ranks, toy, stage):
    """``--ds_enable_sleep`` (OpenRLHF's --ds.enable_sleep), at ZeRO-2 and ZeRO-3: over two
    rollouts of two optimizer steps each (``--rollout_batch_size 8 --train_batch_size 16``), the
    policy's Adam states, master weights and gradients are off the device while each rollout is
    made (every forward of the policy without gradients: generation, the old log-probs) and
    back from its update's first backward on (DeepSpeed's own record of what it moved); the
    updates and the exported model equal the run without sleep exactly."""
    from safetensors.torch import load_file

    base = {"zero_stage": stage, "max_steps": 4, "eval_steps": -1, "rollout_batch_size": 8,
            "train_batch_size": 16, "ppo_epochs": 1,  # two steps a rollout: old log-probs taken
            "shared_prompt_forward": False}  # one forward per micro-batch, then its backward
    awake = ranks.run(train, str(toy), f"awake_{stage}", **base)
    slept = ranks.run(train, str(toy), f"slept_{stage}", ds_enable_sleep=True, **base)
    assert not any(state for out in awake for _, state in out["asleep"])
    for out in slept:
        seen = out["asleep"]
        last = max(i for i, (grad, _) in enumerate(seen) if grad)  # the final evaluation after
        states = [state for grad, state in seen[:last + 1] if not grad]
        assert states and all(states), "a rollout forward ran with the states on the device"
        firsts = [i for i, (grad, _) in enumerate(seen) if grad and not seen[i - 1][0]]
        assert len(firsts) == 2  # each rollout's update: its first forward, then backward wakes
        assert all(seen[i][1] for i in firsts)
        assert not any(state for i, (grad, state) in enumerate(seen) if grad and i not in firsts)
    want, got = awake[0]["history"], slept[0]["history"]
    assert [r["step"] for r in want] == [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(want, got):
        for key in ("loss", "kl", "ratio", "grad_norm", "reward"):
            assert b[key] == a[key], (stage, a["step"], key)
    exported = [load_file(toy / name / "model" / "model.safetensors")
                for name in (f"awake_{stage}", f"slept_{stage}")]
    assert exported[0].keys() == exported[1].keys()
    for key, value in exported[0].items():
        assert torch.equal(exported[1][key], value), key


@pytest.mark.slow
def test_experience_forwards_in_micro_batches_of_their_own_give_the_same_updates(ranks, toy):
    """``--micro_rollout_batch_size 3`` (OpenRLHF's --rollout.micro_batch_size), at ZeRO-3: a
    rank's 16 completions of a rollout (two optimizer steps of 16 over 2 ranks, micro-batches of
    8) go through the reference and the sampling policy 3 at a time (the last forward of 1);
    the two updates equal those of the default run, where those forwards take the training
    micro-batches."""
    base = {"zero_stage": 3, "rollout_batch_size": 8, "train_batch_size": 16, "ppo_epochs": 1,
            "max_steps": 2, "eval_steps": -1}
    default = ranks.run(train, str(toy), "experience_default", **base)
    regrouped = ranks.run(train, str(toy), "experience_by_3", micro_rollout_batch_size=3, **base)
    for out in default:  # the reference's pass, then the policy's before the first update
        assert out["rows"] == {"policy": [8, 8], "reference": [8, 8]}, out["rows"]
    for out in regrouped:
        assert out["rows"] == {"policy": [3, 3, 3, 3, 3, 1], "reference": [3, 3, 3, 3, 3, 1]}
    want, got = default[0]["history"], regrouped[0]["history"]
    assert [r["step"] for r in want] == [r["step"] for r in got] == [1, 2]
    for a, b in zip(want, got):
        assert b["reward"] == a["reward"] and b["completion_length"] == a["completion_length"]
        for key in ("loss", "kl", "ratio", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    assert want[1]["ratio"] != 1.0 and want[1]["kl"] > 0  # the old log-probs were used


@pytest.mark.slow
def test_a_run_of_rollouts_spanning_two_steps_resumes_exactly_between_rollouts(ranks, toy):
    """``--rollout_batch_size 16`` (64 completions, two optimizer steps of 32 per rollout), four
    steps, a checkpoint after the first rollout: resumed there, steps 3 and 4 (the second
    rollout, sampled and trained again) are bit-identical."""
    settings = {"rollout_batch_size": 16, "ppo_epochs": 1, "max_steps": 4, "save_steps": 2}
    keys = ("loss", "reward", "kl", "ratio", "grad_norm", "completion_length", "rollout")
    full = ranks.run(train, str(toy), "spans", **settings)[0]["history"]
    assert [row["rollout"] for row in full] == [1, 1, 2, 2]
    ckpt = toy / "spans" / "ckpt"
    shutil.rmtree(ckpt / "global_step4")
    (ckpt / "latest").write_text("global_step2")
    resumed = ranks.run(train, str(toy), "spans", load_checkpoint=True, **settings)[0]["history"]
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys}
                                                          for r in full[2:]]


def test_gspo_and_cispo_train_at_zero3_and_start_as_their_token_level_twins(ranks, toy):
    """At ZeRO-3, one rollout stepped twice per loss type. The first update has ratio 1, where
    GSPO's gradient is PPO's under the same mean over completions, and CISPO's is PPO's under the
    token mean (its loss value, -advantage x logp, is not); on the second, off-policy, they part:
    a sequence-level clip, a clipped weight that keeps its gradient."""
    runs = {name: ranks.run(train, str(toy), name, max_steps=2, zero_stage=3, **extra)[0]
            for name, extra in (("ppo_token", {}),
                                ("ppo_seq", {"policy_loss_agg": "seq_mean_token_mean"}),
                                ("gspo", {"policy_loss_type": "gspo"}),
                                ("cispo", {"policy_loss_type": "cispo", "clip_eps_high": 0.05}))}
    for name, twin in (("gspo", "ppo_seq"), ("cispo", "ppo_token")):
        got, want = runs[name]["history"], runs[twin]["history"]
        assert [r["step"] for r in got] == [1, 2]
        assert got[0]["reward"] == want[0]["reward"]  # the same rollout
        assert got[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-4), name
        assert got[1]["ratio"] > 1.0 or got[1]["ratio"] < 1.0  # the policy moved off
        assert got[1]["grad_norm"] != pytest.approx(want[1]["grad_norm"], rel=1e-6), name
        assert all(math.isfinite(r["loss"]) for r in got)
    assert runs["gspo"]["history"][0]["loss"] == pytest.approx(
        runs["ppo_seq"]["history"][0]["loss"], rel=1e-4, abs=1e-6)
    assert runs["cispo"]["history"][0]["loss"] != pytest.approx(
        runs["ppo_token"]["history"][0]["loss"], rel=1e-3)


def masked_truncation(root: str, name: str, **extra) -> dict:
    """GRPO with --mask_truncated_completions, recording for each training micro-batch of the
    first step (ratio 1, KL 0 against the unchanged reference) which rows train, their rewards,
    and the token mean the loss should be: -sum(advantage x tokens) / tokens over trained rows."""
    from strategy.trainers import GRPOConfig, GRPOTrainer
    from strategy.trainers.algorithms.preference import reference_model
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.losses import scored_mask
    from strategy.trainers.run import Run

    class Recording(GRPOTrainer):
        seen: list = []

        def compute_loss(self, batch):
            if torch.is_grad_enabled() and self.global_step == 0:
                trained = batch.get("trained", torch.ones(len(batch["rewards"]), dtype=bool))
                tokens = scored_mask(batch).sum(-1).cpu()
                adv = batch["advantages"].cpu()
                self.seen.append({"trained": trained.tolist(), "rewards": batch["rewards"].tolist(),
                                  "adv_tokens": float((adv * tokens)[trained].sum()),
                                  "tokens": int(tokens[trained].sum()),
                                  "counted": self.micro_counts["tokens"]})
            return super().compute_loss(batch)

    with Run.from_args(_argv(root, name, **extra), trainer=GRPOTrainer) as run:
        model, grpo = run.model(), run.config(GRPOConfig)
        trainer = run.trainer(Recording, model, grpo=grpo, ref_model=reference_model(run, model),
                              reward=build_rewards(run, grpo))
        trainer.fit()
    return {"history": trainer.history, "seen": Recording.seen}


def test_length_penalties_and_masked_truncated_completions_at_two_ranks(ranks, toy):
    """One rollout, stepped twice. DAPO's overlong punishment over the whole completion
    (buffer = max_new_tokens) takes each completion's length / 8 off the same rollout's reward.
    Completions cut at 2 tokens get ProRL's fixed -0.5 and, with --mask_truncated_completions,
    train nothing: the first step's loss is the token mean over the ended ones alone."""
    runs = {name: ranks.run(train, str(toy), name, max_steps=2, **extra)[0]["history"]
            for name, extra in (("plain", {}), ("overlong", {"overlong_buffer_len": 8}))}
    plain, overlong = runs["plain"][0], runs["overlong"][0]
    assert overlong["completion_length"] == plain["completion_length"]  # the same rollout
    assert overlong["overlong_penalized"] == 1.0  # every completion is within the buffer
    assert overlong["reward"] == pytest.approx(plain["reward"] - plain["completion_length"] / 8,
                                               abs=1e-6)
    assert 0 < plain["truncated"] < 1, plain["truncated"]  # some end, some are cut at 8
    cut = ranks.run(masked_truncation, str(toy), "cut", max_steps=2, max_new_tokens=2,
                    stop_properly_penalty_coef=-0.5, mask_truncated_completions=True)
    seen = [row for rank in cut for row in rank["seen"]]
    flags = [f for row in seen for f in row["trained"]]
    assert any(flags) and not all(flags), flags  # ended and cut completions both
    for row in seen:
        assert all(r == -0.5 for r, t in zip(row["rewards"], row["trained"]) if not t)
        assert row["counted"] == row["tokens"]  # the cut ones are not counted
    expected = -sum(r["adv_tokens"] for r in seen) / sum(r["tokens"] for r in seen)
    first = cut[0]["history"][0]
    assert first["truncated"] == pytest.approx(1 - sum(flags) / len(flags))
    assert first["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def greedy_tokens(root: str, stage: int, gather: str = "full") -> dict:
    """Greedy completions of this rank's held-out prompts, as the trainer generates them, and
    which rollout engine made them; sampled completions of groups of 4 copies of the first
    prompts, with each prompt's forward shared by its group and without (the same draws), and
    whether the shared path ran; under ZeRO-3 ``full``, also the refusal a rank with too little
    free memory gets."""
    from unittest import mock

    from strategy.errors import ConfigError
    from strategy.internals import with_cache
    from strategy.rollout.hf import _every_rank, prefill_groups
    from strategy.trainers import GRPOConfig, GRPOTrainer
    from strategy.trainers.algorithms.grpo import sampling_rng
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.run import Run

    extra = {"zero_stage": stage, "rollout_gather": gather}
    if stage == 3:
        extra["ds_config_overrides"] = json.dumps(
            {"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    refused = None
    argv = _argv(root, f"greedy{stage}", kl_coef=0.0, **extra)
    with Run.from_args(argv, trainer=GRPOTrainer) as run:
        grpo = run.config(GRPOConfig)
        trainer = run.trainer(GRPOTrainer, run.model(), grpo=grpo,
                              reward=build_rewards(run, grpo))
        out = []
        for batch in trainer.eval_dataloader:  # uneven shards: 7 and 6 prompts, 2 calls each
            batch = trainer.to_device(batch)
            out += trainer.generate(batch["prompt_ids"], batch["prompt_mask"], False).tolist()
        ids, mask = (batch[k].repeat_interleave(4, 0) for k in ("prompt_ids", "prompt_mask"))
        sampled = {}
        for group in (4, 1):  # shared prompt forward, then the plain one, from the same seed
            with sampling_rng(7, 0, run.strategy.rank):
                sampled[group] = trainer.generate(ids, mask, True, group=group).tolist()
        module = trainer.rollouts.module
        cache = prefill_groups(module, ids, mask, 4, _every_rank)
        with torch.no_grad():  # the last prompt token on the shared cache, and on no cache
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            last = module(input_ids=ids[:, -1:], attention_mask=mask, **with_cache(cache),
                          position_ids=positions[:, -1:]).logits[:, -1]
            whole = module(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(last, whole[:, -1], rtol=1e-5, atol=1e-5)
        if stage == 3 and gather == "full":
            tight = 10**6 if run.strategy.rank == 1 else 10**12  # 1 MB free on one rank only
            with mock.patch("strategy.deepspeed_strategy.free_memory_bytes", lambda: tight):
                try:
                    run.strategy.rollout_engine(trainer.model, "full")
                except ConfigError as exc:
                    refused = str(exc)
    return {"tokens": out, "engine": type(trainer.rollouts).__name__, "refused": refused,
            "sampled": sampled, "shared": cache is not None, "padded": bool((mask == 0).any())}


@pytest.mark.slow
def test_greedy_generation_under_zero3_matches_zero0(ranks, toy):
    """ZeRO-3's two rollout paths (a gathered copy, per-layer gathers) give ZeRO-0's tokens on
    uneven held-out shards (ZeRO-0 and the copy sample with ``strategy.decode``, ``layer`` with
    ``generate(synced_gpus=True)``); the copy is refused on every rank when one rank lacks the
    memory.
    Sampling groups that share their prompt's forward draw the tokens a plain generate draws
    from the same seed, on every path (left-padded prompts of different lengths)."""
    plain = ranks.run(greedy_tokens, str(toy), 0)
    full = ranks.run(greedy_tokens, str(toy), 3, "full")
    layer = ranks.run(greedy_tokens, str(toy), 3, "layer")
    assert [len(r["tokens"]) for r in plain] == [7, 6]
    assert [r["tokens"] for r in full] == [r["tokens"] for r in plain]
    assert [r["tokens"] for r in layer] == [r["tokens"] for r in plain]
    assert len({tuple(t) for r in plain for t in r["tokens"]}) > 1  # not one degenerate answer
    for r in plain + full + layer:
        assert r["shared"] and r["padded"]
        assert r["sampled"][4] == r["sampled"][1]
        assert len({tuple(t) for t in r["sampled"][4][:4]}) > 1  # one prompt, several samples
    assert [r["engine"] for r in plain + full + layer] == ["EngineRollout"] * 2 + [
        "GatheredRollout"] * 2 + ["EngineRollout"] * 2
    for r in full:  # every rank raises the same line, though only rank 1 is short of memory
        assert r["refused"].startswith("rollout_gather='full' is invalid: a generation copy of "
                                       "the policy needs 0.")
        assert "one rank has 0.00 GB free; use --rollout_gather layer" in r["refused"]


def reference_logps(root: str, offload: bool) -> dict:
    from strategy.internals import is_zero3_param
    from strategy.trainers import GRPOTrainer, data
    from strategy.trainers.losses import token_logps
    from strategy.trainers.run import Run

    with Run.from_args(_argv(root, "ref", ref_offload=offload), trainer=GRPOTrainer) as run:
        ref = run.strategy.prepare(run.strategy.from_pretrained(run.model_cfg.pretrain,
                                                                frozen=True))
        rows = data.load_sft(f"{root}/data/test.jsonl", run.tokenizer, run.data)
        batch = data.collate_sft(run.tokenizer.pad_token_id)(rows[:6])
        with torch.no_grad():
            logp, mask = token_logps(ref, batch)
        params = list(ref.module.parameters())
        partitioned = all(is_zero3_param(p) and p.numel() == 0 for p in params)
        on_cpu = all(p.ds_tensor.device.type == "cpu" for p in params) if partitioned else None
    return {"logp": logp, "mask": mask, "partitioned": partitioned, "on_cpu": on_cpu}


@pytest.mark.slow
def test_offloaded_reference_gives_the_same_logps(ranks, toy):
    resident = ranks.run(reference_logps, str(toy), False)[0]
    offloaded = ranks.run(reference_logps, str(toy), True)[0]
    assert not resident["partitioned"]
    assert offloaded["partitioned"] and offloaded["on_cpu"]  # held as CPU partitions between uses
    assert torch.equal(resident["mask"], offloaded["mask"])
    torch.testing.assert_close(offloaded["logp"], resident["logp"], rtol=1e-6, atol=1e-6)


def model_reward_run(root: str) -> dict:
    """GRPO at ZeRO-3 scored by a reward model (an offloaded eval engine) plus 0.5 x the toy
    reward function: the model's scores of some texts of very different lengths, and the run's
    history (each reward logged on its own). The update runs the non-default
    choices (REINFORCE++-baseline advantages whitened over both ranks, the GRPO paper's
    per-completion mean, DAPO's clip-higher, dual clip, a k2 KL in the token rewards, discounted
    returns): their math is checked in tests/test_advantages.py, here that they run at 2 ranks."""
    from strategy.trainers import GRPOConfig, GRPOTrainer
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.run import Run

    argv = _argv(root, "rm_run", zero_stage=3, reward_pretrain=f"{root}/rm",
                 reward_weights="0.5,1.0", ref_offload=True, max_steps=2,
                 advantage_estimator="reinforce_baseline", policy_loss_agg="seq_mean_token_mean",
                 clip_eps_high=0.28, dual_clip=3.0, kl_estimator="k2", kl_in_reward=True,
                 gamma=0.9)
    with Run.from_args(argv, trainer=GRPOTrainer) as run:
        reward = build_rewards(run, run.config(GRPOConfig))
        prompts, completions = ["ab=", "abcdef=", "q="], ["ba", "fedcbaxyzxyz", ""]
        reward(prompts, completions, [{"output": "ba"}] * 3)
        scores = reward.last["model"]
        normalized = build_rewards(run, dataclasses.replace(  # --normalize_reward
            run.config(GRPOConfig), reward_pretrain=f"{root}/rm_normalized",
            normalize_reward=True))
        normalized(prompts, completions, [{"output": "ba"}] * 3)
        reference = run.strategy.from_pretrained(run.model_cfg.pretrain, frozen=True)
        trainer = run.trainer(GRPOTrainer, run.model(), grpo=run.config(GRPOConfig),
                              ref_model=reference, reward=reward)
        trainer.fit()
    return {"scores": scores, "normalized": normalized.last["model"],
            "texts": [p + c for p, c in zip(prompts, completions)], "history": trainer.history}


@pytest.mark.slow
def test_reward_model_scores_under_zero3_with_offload(ranks, toy):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = ranks.run(model_reward_run, str(toy))
    assert out[0]["scores"] == out[1]["scores"]
    scorer = AutoModelForSequenceClassification.from_pretrained(toy / "rm").eval()
    tok = AutoTokenizer.from_pretrained(toy / "rm")
    with torch.no_grad():  # each text alone: no padding to get wrong
        want = [scorer(**tok(t, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
                for t in out[0]["texts"]]
    assert len(set(want)) == 3
    assert out[0]["scores"] == pytest.approx(want, abs=1e-5)
    # --normalize_reward: by the mean and std the model's config.json holds
    assert out[0]["normalized"] == pytest.approx([(w - 0.25) / 2.0 for w in want], abs=1e-5)
    assert [row["step"] for row in out[0]["history"]] == [1, 2]
    assert all(math.isfinite(row["reward"]) and math.isfinite(row["loss"])
               for row in out[0]["history"])
    assert out[0]["history"][1]["kl"] > 0  # k2 of the moved policy
    for row in out[0]["history"]:  # the mean of the weighted sum is the weighted sum of means
        assert row["reward"] == pytest.approx(
            0.5 * row["reward_reversal_reward"] + row["reward_model"], abs=1e-6)


def hanging_reward_run(root: str) -> str:
    from strategy.errors import StrategyError

    try:
        train(root, "hang", reward_fn="tests.support.rewards:hanging_on_rank_1", kl_coef=0.0,
              max_steps=2, reward_timeout=2)
    except StrategyError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_hanging_reward_is_stopped_by_the_timeout_on_every_rank(ranks, toy):
    messages = ranks.run(hanging_reward_run, str(toy), timeout=120)  # rank 1's worker hangs
    for message in messages:
        assert message.startswith("rank 1: DataError: reward_fn='tests.support.rewards:hanging_"
                                  "on_rank_1' did not return within --reward_timeout=2 s for "
                                  "prompt "), message
        assert message.endswith("; fix the function or raise the limit") and "\n" not in message


def bad_reward_run(root: str) -> str:
    from strategy.errors import StrategyError

    try:
        train(root, "bad", reward_fn="tests.test_grpo:text_reward", kl_coef=0.0, max_steps=2)
    except StrategyError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_reward_that_is_not_a_number_stops_every_rank(ranks, toy):
    messages = ranks.run(bad_reward_run, str(toy))  # rank 1's reward fails, rank 0's does not
    for message in messages:
        assert message.startswith("rank 1: DataError: reward_fn='tests.test_grpo:text_reward' "
                                  "returned 'abc' (str) for prompt "), message
        assert message.endswith("; return a finite float") and "\n" not in message


# ------------------------------------------------------------ before any process group


CASES = [
    ({"group_size": 1}, "group_size=1 is invalid: group_norm compares completions within a group"),
    ({"train_batch_size": 24, "micro_train_batch_size": 4, "group_size": 8},
     "train_batch_size=24 is invalid: each rank's 12 completions per step (micro x accumulation) "
     "must divide into groups of group_size=8; use a multiple of 16"),
    ({"reward_fn": "strategy.demos.toy_task:no_such_reward"},
     "reward_fn='strategy.demos.toy_task:no_such_reward' is invalid: strategy.demos.toy_task has "
     "no callable 'no_such_reward'"),
    ({"reward_fn": "no_such_module:f"}, "reward_fn='no_such_module:f' is invalid: cannot import"),
    ({"reward_fn": "just_a_name"}, "reward_fn='just_a_name' is invalid: write it as "
                                   "module:function"),
    ({"reward_fn": None}, "reward_fn=None is invalid: name a reward"),
    ({"save_steps": 3}, "save_steps=3 is invalid: a rollout spans ppo_epochs=2 optimizer steps"),
    ({"rollout_batch_size": 5}, "rollout_batch_size=5 is invalid: its 20 completions (x "
     "group_size=4) must divide into optimizer steps of train_batch_size=32, and its prompts "
     "over 2 data-parallel ranks"),
    ({"rollout_batch_size": 16, "save_steps": 2}, "save_steps=2 is invalid: a rollout spans 4 "
     "(ppo_epochs=2 passes over rollout_batch_size x group_size completions in steps of "
     "train_batch_size) optimizer steps; use a multiple of 4"),
    ({"max_new_tokens": 24}, "max_new_tokens=24 is invalid: prompt and completion share "
                             "max_len=24"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size=2 is invalid: GRPO generates whole "
                                    "sequences"),
    ({"pretrain": None, "model_config": "configs/tiny_llama.json", "tokenizer": "TOK"},
     "kl_coef=0.1 is invalid: the reference is the --pretrain model"),
    ({"advantage_estimator": "gae"}, "advantage_estimator='gae' is invalid: GAE needs a value "
                                     "model (a critic), which GRPO has none of"),
    ({"policy_loss_agg": "seq_mean"}, "policy_loss_agg='seq_mean' is invalid: use one of "
                                      "token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"),
    ({"dual_clip": 0.5}, "dual_clip=0.5 is invalid: use a bound > 1"),
    ({"kl_estimator": "k4"}, "kl_estimator='k4' is invalid: use one of k1, k2, k3"),
    ({"reward_weights": "1,2"}, "reward_weights='1,2' is invalid: give one finite weight per "
                                "reward: 1 (strategy.demos.toy_task:reversal_reward)"),
    ({"reward_weights": "1,x"}, "reward_weights='1,x' is invalid: write numbers separated by "
                                "commas"),
    ({"reward_timeout": -1}, "reward_timeout=-1.0 is invalid: use seconds > 0, or 0"),
    ({"normalize_reward": True, "reward_pretrain": "RM"},  # a config.json without mean and std
     "/rm/config.json holds no mean and std (OpenRLHF's reward models save them); drop the flag"),
    ({"reward_fn": f"{REWARD},tests.support.rewards:nope"},
     "reward_fn='tests.support.rewards:nope' is invalid: tests.support.rewards has no callable "
     "'nope'"),
    ({"ds_enable_sleep": True, "zero_stage": 0}, "ds_enable_sleep=True is invalid: DeepSpeed "
                                                 "moves a ZeRO optimizer's states"),
    ({"ds_enable_sleep": True, "zero_stage": 3, "param_offload": True},
     "ds_enable_sleep=True is invalid: DeepSpeed moves a ZeRO optimizer's states, with the "
     "parameters on the device: set --zero_stage 1, 2 or 3 without --param_offload"),
    ({"ds_enable_sleep": True, "zero_stage": 3, "optimizer": "cpu_adam"},
     "ds_enable_sleep=True is invalid: DeepSpeed moves ZeRO-3's states with FusedAdam only, not "
     "cpu_adam: use --optimizer fused_adam, or --adam_offload"),
]


@pytest.mark.parametrize("change,message", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_grpo_setting_fails_before_process_group(toy, monkeypatch, change, message):
    from strategy.errors import ConfigError
    from strategy.trainers import GRPOTrainer
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch)
    named = {"TOK": f"{toy}/data/tokenizer", "RM": f"{toy}/rm"}
    change = {k: named.get(v, v) if isinstance(v, str) else v for k, v in change.items()}
    argv = [a for a in _argv(toy, "refused", **change) if not a.endswith("=None")]
    with pytest.raises(ConfigError) as info:
        Run.from_args(argv, trainer=GRPOTrainer)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_save_and_eval_rollouts_are_the_steps_their_rollouts_span():
    """``--save_rollouts N`` / ``--eval_rollouts N`` (OpenRLHF's rollout-counted
    ``--ckpt.save_steps`` / ``--eval.steps``) set ``--save_steps`` / ``--eval_steps`` to N x
    the optimizer steps of a rollout (ppo_epochs passes over rollout_batch_size x group_size
    completions in steps of train_batch_size); -1 stays -1; with the step count given too, one
    line."""
    from strategy.errors import ConfigError
    from strategy.trainers.algorithms.grpo_checks import rollout_counted
    from strategy.trainers.config import GRPOConfig, TrainConfig

    grpo = GRPOConfig(reward_fn="m:f", rollout_batch_size=6, group_size=4, ppo_epochs=2,
                      save_rollouts=3, eval_rollouts=-1)
    got = rollout_counted(TrainConfig(), grpo, train_batch_size=8)  # 24 / 8 = 3 steps, twice
    assert (got.save_steps, got.eval_steps) == (3 * 2 * 3, -1)
    with pytest.raises(ConfigError, match=r"^save_rollouts=3 is invalid: it sets --save_steps "
                                          r"\(N rollouts = N x 6 steps\); give one of them$"):
        rollout_counted(TrainConfig(save_steps=4), grpo, 8)
    plain = TrainConfig(save_steps=4)
    assert rollout_counted(plain, GRPOConfig(reward_fn="m:f"), 8) is plain
    with pytest.raises(ConfigError, match="^eval_rollouts=0 is invalid: use a positive number "
                                          "of rollouts, or -1$"):
        GRPOConfig(reward_fn="m:f", eval_rollouts=0)
