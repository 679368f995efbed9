"""OpenRLHF 0.11's own example scripts (tests/data/openrlhf_scripts: the 12 ``train_*.sh`` and
``serve_remote_rm.sh``, copied unchanged under their licence line) through ``--print_config``.

Each script runs in bash as written, up to the command that would start its job (its arguments
captured: ``tests/support/openrlhf_capture.sh``); its hub models, datasets and output folders
become tiny local ones, as a user's would on their machine; then our module of the same name
(``openrlhf.cli.train_sft`` -> ``strategy.cli.train_sft``) checks the settings as a run would.
A refused flag is one line naming it; the test drops it and checks again until the settings
pass. What each script is refused for is the ledger below: flags that need CUDA or a CUDA-only
package, and what this framework does not do (yet). A script refused for anything else, or no
longer refused for a flag the ledger names, fails the test: the ledger is kept true.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
from pathlib import Path

import pytest

from strategy.cli.openrlhf_flags import DOTTED
from strategy.errors import StrategyError

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "data" / "openrlhf_scripts"
WRAPPER = "train_nonrl_slurm.sh"  # runs another script's command under Slurm: none of its own
MODULES = {"train_ppo_ray": "strategy.cli.train_ppo_ray", "serve_rm": "strategy.cli.serve_rm"}

REFUSED = {  # script -> the flags it is refused for here (each with its one line)
    "serve_remote_rm.sh": [],  # flash-attn: serve_rm takes its model's attention as it is
    "train_sft.sh": ["--ds.attn_implementation"],
    "train_rm.sh": ["--ds.attn_implementation"],
    "train_dpo_llama.sh": ["--ds.attn_implementation"],
    # the script's Mixtral replaced by a tiny Llama: no router, so no router loss
    "train_sft_mixtral_lora.sh": ["--ds.attn_implementation", "--model.aux_loss_coef"],
    "train_ppo_ray_hybrid_engine.sh": ["--vllm.enable_sleep"],
    "train_ppo_ray_slurm.sh": [],
    "train_ppo_with_reward_fn.sh": ["--ds.attn_implementation"],
    "train_dapo_ray_hybrid_engine.sh": ["--vllm.enable_sleep"],
    "train_prorlv2_math_hybrid_engine.sh": ["--vllm.enable_sleep"],
    "train_reinforce_baseline_hybrid_engine.sh": [
        "--ds.ring_attn_head_stride", "--ds.ring_attn_size"],
    "train_reinforce_baseline_ray_agent_async.sh": [
        "--ds.ring_attn_head_stride", "--ds.ring_attn_size",
        # async with dynamic sampling (its next round needs this one's rewards; async with the
        # environment alone plays its episodes ahead), and so partial rollouts
        "--train.async_enable", "--train.partial_rollout_enable"],
    "train_vlm_math_hybrid_engine.sh": [
        "--data.image_key", "--data.max_images_per_prompt",
        "--actor.freeze_visual_encoder", "--vllm.enable_sleep"],
}
OURS: dict[str, list[str]] = {}  # ours -> OpenRLHF's flags that become it
for _name, _tokens in DOTTED.items():
    if _tokens:
        OURS.setdefault(_tokens[0], []).append(f"--{_name}")


def captured(script: Path, tmp: Path) -> tuple[str, list[str]]:
    """The OpenRLHF module ``script`` would run and its arguments, as bash expands them; the
    ``<PLACEHOLDER>`` values a user fills in filled."""
    text = re.sub(r"<[A-Z_]+>", "placeholder", script.read_text())
    (tmp / script.name).write_text(text)
    out = tmp / "argv"
    subprocess.run(["bash", "-c", f"source {ROOT}/tests/support/openrlhf_capture.sh; "
                    f"source {tmp / script.name}"], cwd=tmp, env={
                        **os.environ, "CAPTURE_OUT": str(out)}, capture_output=True, timeout=60)
    args = out.read_text().split("\0")[:-1]
    start = next(i for i, arg in enumerate(args) if arg.startswith("openrlhf.cli."))
    return args[start].rsplit(".", 1)[1], args[start + 1:]


def local(argv: list[str], toy: Path, tmp: Path) -> list[str]:
    """Hub models, datasets and the script's folders as tiny local ones."""
    pairs = "pairs_train.jsonl"
    paths = {"--actor.model_name_or_path": toy / "init", "--model.model_name_or_path": toy / "init",
             "--reward.model_name_or_path": toy / "rm", "--ckpt.output_dir": tmp / "out",
             "--ckpt.path": tmp / "ckpt", "--logger.tensorboard_dir": tmp / "tb",
             "--data.prompt_dataset": toy / "data" / "train.jsonl",
             "--eval.dataset": toy / "data" / "test.jsonl",
             "--reward.remote_url": ROOT / "tests" / "data" / "openrlhf_reward_func.py",
             "--train.agent_func_path": ROOT / "tests" / "data" / "agents" / "openrlhf_style.py"}
    out = []
    for arg in argv:
        flag = out[-1] if out else ""
        if flag == "--data.dataset":  # preference pairs for RM and DPO
            out.append(str(toy / "data" / (pairs if "preference" in arg else "train.jsonl")))
        else:
            out.append(str(paths[flag]) if flag in paths else arg)
    return out


def check(main, argv: list[str]) -> tuple[int | str, str, str]:
    """``main(argv + ['--print_config'])``: its exit (or the refusal it raised), stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([*argv, "--print_config"])
        code: int | str = 0
    except SystemExit as stop:
        code = stop.code or 0
    except StrategyError as error:  # raised where no launcher's hook prints it
        code, err = 2, io.StringIO(f"error: {error}\n")
    return code, out.getvalue(), err.getvalue()


def refused_flag(line: str, argv: list[str]) -> str:
    """The script's flag a refusal line names (OpenRLHF's spelling, or ours translated)."""
    named = line.removeprefix("error: ").split(" ", 1)[0].split("=", 1)[0]
    if named.startswith("--"):
        return named
    ours = OURS.get(f"--{named}", [])
    candidates = [arg for arg in argv if arg in ours or arg.startswith("--") and
                  arg.replace(".", "_").endswith(named)]
    return candidates[0] if candidates else named


def drop(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its values."""
    at = argv.index(flag)
    end = at + 1
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return argv[:at] + argv[end:]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    import torch
    from transformers import AutoModelForSequenceClassification

    from strategy.trainers.run import hf_config
    from tests.support.helpers import toy_root

    root = tmp_path_factory.mktemp("openrlhf_scripts")
    tok = toy_root(root, n_train=20, n_test=6, model_dir="init")
    torch.manual_seed(1)
    scorer = AutoModelForSequenceClassification.from_config(
        hf_config(str(ROOT / "configs" / "tiny_llama.json"), tok, num_labels=1))
    scorer.config.mean, scorer.config.std = 0.25, 2.0  # as OpenRLHF's reward models save them
    scorer.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    return root


def test_the_ledger_names_every_script():
    scripts = {p.name for p in SCRIPTS.glob("*.sh")} - {WRAPPER}
    assert scripts == set(REFUSED), scripts ^ set(REFUSED)
    assert len([s for s in scripts if s.startswith("train_")]) == 12


@pytest.mark.parametrize("script", sorted(REFUSED))
def test_openrlhf_script_passes_print_config_but_for_its_ledger(script, toy, tmp_path,
                                                                monkeypatch):
    from tests.support.helpers import forbid_process_group

    forbid_process_group(monkeypatch, world_size=None)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    name, argv = captured(SCRIPTS / script, tmp_path)
    argv = local(argv, toy, tmp_path)
    main = importlib.import_module(MODULES.get(name, f"strategy.cli.{name}")).main
    refused = []
    for _ in range(25):  # a bound: each pass drops one flag
        code, out, err = check(main, argv)
        if code == 0:
            break
        lines = err.strip().splitlines()
        assert lines and lines[-1].startswith("error: "), (script, err[-2000:])
        assert "Traceback" not in err, (script, err[-2000:])
        flag = refused_flag(lines[-1], argv)
        assert flag in argv, (script, lines[-1])
        refused.append(flag)
        argv = drop(argv, flag)
    assert code == 0 and "# StrategyConfig" in out or name == "serve_rm" and code == 0, (
        script, refused, err[-2000:])
    assert refused == REFUSED[script], (script, "\n".join(refused))
    if name == "train_ppo_ray":
        _steps_count_rollouts(argv, out)


def _steps_count_rollouts(argv: list[str], printed: str) -> None:
    """OpenRLHF's ``--ckpt.save_steps N`` and ``--eval.steps N`` count rollouts (its PPO
    trainer's global_step is one a rollout): here they are N x the optimizer steps a rollout
    spans (max_epochs passes over rollout.batch_size x n_samples_per_prompt completions in steps
    of train.batch_size), -1 as it is."""
    def value(flag: str, default: float) -> float:
        return float(argv[argv.index(flag) + 1]) if flag in argv else default

    span = int(value("--train.max_epochs", 1)) * max(int(
        value("--rollout.batch_size", 0) * value("--rollout.n_samples_per_prompt", 1)
        // value("--train.batch_size", 1)), 1)
    for theirs, ours in (("--ckpt.save_steps", "save_steps"), ("--eval.steps", "eval_steps")):
        if theirs in argv:
            count = int(value(theirs, 0))
            shown = re.search(rf"^\s*{ours}: (-?\d+)", printed, re.M)
            assert shown and int(shown.group(1)) == (count if count == -1 else count * span), (
                theirs, count, span, shown and shown.group(0))
