"""DAPO's dynamic sampling (``--dynamic_filtering``): the filter against OpenRLHF's own on the
same scores, the dealing of kept groups to ranks; at 2 ranks on the real engine, steps of kept
groups only (each trained once, on one rank), more rounds of prompts than steps, an exact resume
across filtered steps, and a short step (``--max_sampling_rounds 1``) whose filler trains
nothing."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from tests.test_grpo import _argv

REWARD = "tests.support.rewards:uniform_or_parity"


# ------------------------------------------------------------ pure


def test_filter_matches_openrlhf_on_the_same_scores():
    from strategy.trainers.algorithms.groups import Sampled, informative
    from tests.support.peer_rl import dynamic_filter_keeps

    rng = random.Random(0)
    groups = [[1.0] * 4, [0.0] * 4, [0.0, 1.0, 1.0, 1.0], [0.5] * 4, [2.0, -1.0, 0.0, 1.0]]
    groups += [[rng.choice([0.0, 0.25, 1.0]) for _ in range(4)] for _ in range(200)]
    for low, high in ((0.0, 1.0), (0.2, 0.9), (-1.0, 0.5)):
        sampled = [Sampled([[1]] * 4, [[2]] * 4, g, ["p"] * 4, [{}] * 4) for g in groups]
        ours = informative(sampled, low, high)
        assert ours == dynamic_filter_keeps(groups, (low, high))
        assert any(ours) and not all(ours)
    assert informative(sampled[:3], 0.0, 1.0) == [False, False, True]  # the ends are out


def test_kept_groups_are_dealt_in_pool_order_and_a_short_pool_is_filled():
    from strategy.trainers.algorithms.groups import Sampled, deal

    def group(name):
        return Sampled([[1]] * 2, [[ord(name)]] * 2, [0.5, 0.5], [name] * 2, [{}] * 2,
                       {"r": [0.5, 0.5]})

    pool = [group(c) for c in "abcdefg"]
    spare = [group(c) for c in "xyz"]
    got, filler = deal(pool, 3, 1, spare)
    assert (got.prompts, filler) == (["d", "d", "e", "e", "f", "f"], 0)
    got, filler = deal(pool, 3, 2, spare)  # rank 2 gets g, then two of its own to fill
    assert (got.prompts, filler) == (["g", "g", "x", "x", "y", "y"], 2)
    assert got.components == {"r": [0.5] * 6} and len(got) == 6
    assert Sampled.join(got.split(2)) == got


# ------------------------------------------------------------ at 2 ranks


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("dapo")
    toy_root(root, n_train=45, n_test=13, model_dir="init")  # 5 rounds of 8 prompts, 5 left
    return root


def filtered(root: str, name: str, **extra) -> dict:
    """GRPO with dynamic sampling, recording each rollout's groups on this rank (prompt,
    completions, scores, filler) and, for the first step, what each micro-batch trains."""
    from strategy.trainers import GRPOConfig, GRPOTrainer
    from strategy.trainers.algorithms.preference import reference_model
    from strategy.trainers.algorithms.rewards import build_rewards
    from strategy.trainers.losses import scored_mask
    from strategy.trainers.run import Run

    class Recording(GRPOTrainer):
        sampled_log: list = []
        micro: list = []

        def experience(self, sampled, filler=0):
            groups = sampled.split(self.grpo.group_size)
            self.sampled_log.append({"step": self.global_step, "filler": filler // 4, "groups": [
                (g.prompts[0], [tuple(c) for c in g.completions], g.scores) for g in groups]})
            return super().experience(sampled, filler)

        def compute_loss(self, batch):
            if torch.is_grad_enabled() and self.global_step == 0:
                trained = batch.get("trained", torch.ones(len(batch["rewards"]), dtype=bool))
                tokens = scored_mask(batch).sum(-1).cpu()
                adv = batch["advantages"].cpu()
                self.micro.append({"trained": trained.tolist(),
                                   "tokens": int(tokens[trained].sum()),
                                   "adv_tokens": float((adv * tokens)[trained].sum()),
                                   "counted": self.micro_counts["tokens"]})
            return super().compute_loss(batch)

    args = {"reward_fn": REWARD, "dynamic_filtering": True, "kl_coef": 0.0, **extra}
    with Run.from_args(_argv(root, name, **args), trainer=GRPOTrainer) as run:
        model, grpo = run.model(), run.config(GRPOConfig)
        trainer = run.trainer(Recording, model, grpo=grpo, ref_model=reference_model(run, model),
                              reward=build_rewards(run, grpo))
        trainer.fit()
        cursor = trainer.checkpoint_state()
    return {"history": trainer.history, "rollouts": Recording.sampled_log, "micro": Recording.micro,
            "cursor": cursor}


KEYS = ("loss", "reward", "reward_std", "ratio", "grad_norm", "completion_length",
        "sampling_rounds", "dynamic_filtering_pass_rate", "filler_groups")


def rows(history):
    return [{k: row[k] for k in KEYS} for row in history]


def test_filtered_steps_train_kept_groups_once_and_resume_exactly(ranks, toy):
    """3 rollouts of 8 groups (32 completions), 2 optimizer steps each, two in three prompts
    scoring alike: every trained group has a mean strictly inside (0, 1), each is trained on one
    rank only, and the rollouts drew more rounds of prompts than there were rollouts (into the
    next epoch's shuffle). Resumed from step 2, the run logs and ends bit-identically."""
    full = ranks.run(filtered, str(toy), "full", max_steps=6, save_steps=2)
    assert rows(full[0]["history"]) == rows(full[1]["history"])
    for step in (0, 2, 4):
        trained = []
        for rank in full:
            [rollout] = [r for r in rank["rollouts"] if r["step"] == step]
            assert rollout["filler"] == 0 and len(rollout["groups"]) == 4  # prompts per rank
            for prompt, completions, scores in rollout["groups"]:
                assert 0 < sum(scores) / len(scores) < 1, (prompt, scores)
                trained.append((prompt, tuple(completions)))
        assert len(set(trained)) == 8  # 8 distinct groups, none on both ranks
    history = full[0]["history"]
    rounds = [row["sampling_rounds"] for row in history[::2]]
    assert sum(rounds) == full[0]["cursor"]["prompt_rounds"] > 3, rounds  # more than rollouts
    for row in history[::2]:
        assert row["filler_groups"] == 0
        assert row["dynamic_filtering_pass_rate"] >= 100 / row["sampling_rounds"] - 1e-9
        assert 0 < row["reward"] < 1

    ckpt = toy / "full" / "ckpt"
    shutil.rmtree(ckpt / "global_step6")
    (ckpt / "latest").write_text("global_step2")
    resumed = ranks.run(filtered, str(toy), "full", max_steps=6, save_steps=2,
                        load_checkpoint=True)
    assert rows(resumed[0]["history"]) == rows(history[2:])  # bit-identical
    for mine, whole in zip(resumed, full):
        assert mine["rollouts"] == whole["rollouts"][1:]  # the same groups on each rank
        assert mine["cursor"] == whole["cursor"]


def test_a_short_step_trains_the_kept_groups_alone(ranks, toy):
    """One round (--max_sampling_rounds 1) keeps about a third of the 8 groups; each rank fills
    its 4 with its own dropped ones, which train nothing: the first step's loss is the token
    mean over the kept completions alone, and the logged reward is theirs."""
    out = ranks.run(filtered, str(toy), "short", max_steps=2, max_sampling_rounds=1)
    first = out[0]["history"][0]
    fillers = [r["rollouts"][0]["filler"] for r in out]
    assert first["sampling_rounds"] == 1 and first["filler_groups"] == sum(fillers) > 0
    kept = [g for r in out for g in r["rollouts"][0]["groups"][:4 - r["rollouts"][0]["filler"]]]
    assert all(0 < sum(s) / len(s) < 1 for _, _, s in kept)
    assert first["dynamic_filtering_pass_rate"] == pytest.approx(100 * len(kept) / 8)
    scores = [s for _, _, group in kept for s in group]
    assert first["reward"] == pytest.approx(sum(scores) / len(scores))
    micro = [m for r in out for m in r["micro"]]
    flags = [f for m in micro for f in m["trained"]]
    assert flags.count(False) == 4 * sum(fillers)
    for m in micro:
        assert m["counted"] == m["tokens"]  # the filler is not counted
    expected = -sum(m["adv_tokens"] for m in micro) / sum(m["tokens"] for m in micro)
    assert first["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


REFUSED = [
    (["--dynamic_filtering", "--dynamic_filtering_range", "1", "0"],
     "dynamic_filtering_range='1.0 0.0' is invalid: give LO < HI, e.g. 0 1"),
    (["--dynamic_filtering", "--max_sampling_rounds", "0"],
     "max_sampling_rounds=0 is invalid: use at least 1 round"),
    (["--dynamic_filtering", "--group_size", "1", "--advantage_estimator", "reinforce",
      "--micro_train_batch_size", "2", "--train_batch_size", "8"],
     "dynamic_filtering=True is invalid: it filters groups by their mean reward; use "
     "--group_size 2 or more"),
]


@pytest.mark.parametrize("extra,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_bad_dynamic_sampling_settings_fail_before_process_group(toy, monkeypatch, extra,
                                                                 message):
    from strategy.errors import ConfigError
    from strategy.trainers import GRPOTrainer
    from strategy.trainers.run import Run
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch)
    with pytest.raises(ConfigError) as info:
        Run.from_args(_argv(toy, "refused") + extra, trainer=GRPOTrainer)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_range_reads_from_yaml_and_openrlhf_flags(toy, tmp_path):
    from strategy.cli.trainers import command_argv
    from strategy.trainers import GRPOConfig, GRPOTrainer
    from strategy.trainers.run import Run

    config = tmp_path / "dapo.yaml"
    config.write_text("dynamic_filtering: true\ndynamic_filtering_range: [0.1, 0.9]\n")
    argv = _argv(toy, "yaml") + [f"--config={config}"]
    configs = Run.check_args(argv, trainer=GRPOTrainer)[0]
    assert configs[GRPOConfig].dynamic_filtering_range == (0.1, 0.9)
    dotted = command_argv(["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range",
                           "0", "1"], "grpo")
    assert dotted == ["--dynamic_filtering", "--dynamic_filtering_range", "0", "1"]
