"""OpenRLHF 0.9.1's SFT, RM and DPO command lines (examples/scripts/train_{sft,rm,dpo}_llama.sh
at tag v0.9.1, transcribed below) run against our entry points at 2 ranks. Changed, as a user
moving over would: the launcher line (our example scripts), the model and its size (``--pretrain``
a tiny checkpoint, ``--max_len``, the batch sizes), the dataset names (local folders laid out as
the Hub repositories are, rows in those datasets' layouts) and, where flash-attn is not installed,
the attention kernel (refused there with one line, checked first). ``--max_steps 3`` bounds CI."""

from __future__ import annotations

import importlib.util

import datasets
import pytest

SFT = ["--max_len", "2048", "--dataset", "Open-Orca/OpenOrca", "--input_key", "question",
       "--output_key", "response", "--train_batch_size", "256", "--micro_train_batch_size", "2",
       "--max_samples", "500000", "--pretrain", "meta-llama/Meta-Llama-3-8B", "--save_path",
       "./checkpoint/llama3-8b-sft", "--save_steps", "-1", "--logging_steps", "1",
       "--eval_steps", "-1", "--zero_stage", "2", "--max_epochs", "1", "--bf16",
       "--attn_implementation", "flash_attention_2", "--learning_rate", "5e-6",
       "--load_checkpoint", "--packing_samples", "--gradient_checkpointing"]
PREFERENCE = ["--save_steps", "-1", "--logging_steps", "1", "--eval_steps", "-1",
              "--train_batch_size", "256", "--micro_train_batch_size", "1", "--pretrain",
              "OpenRLHF/Llama-3-8b-sft-mixture", "--bf16", "--max_epochs", "1", "--max_len",
              "8192", "--zero_stage", "3", "--learning_rate", "LR",
              "--dataset", "OpenRLHF/preference_dataset_mixture2_and_safe_pku",
              "--apply_chat_template", "--chosen_key", "chosen", "--rejected_key", "rejected",
              "--attn_implementation", "flash_attention_2", "--load_checkpoint",
              "--packing_samples", "--gradient_checkpointing"]
SCRIPTS = {
    "train_sft": SFT,
    "train_rm": ["--save_path", "./checkpoint/llama3-8b-rm"] + PREFERENCE,
    "train_dpo": ["--save_path", "./checkpoint/llama3-8b-dpo"] + PREFERENCE + ["--beta", "0.1"],
}
RATES = {"train_rm": "9e-6", "train_dpo": "5e-7"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Local copies of the datasets and model the scripts name, in their layouts."""
    from strategy.demos.toy_task import make
    from tests.support.helpers import save_tiny_llama
    from tests.support.tokenizers import checkpoint_like_tokenizer

    root = tmp_path_factory.mktemp("hub")
    make(str(root / "toy"), n_train=512, n_test=8)  # packed: still > 3 steps of 8 rows
    rows = [__import__("json").loads(line) for line in open(root / "toy" / "pairs_train.jsonl")]
    orca = [{"id": f"niv.{i}", "system_prompt": "", "question": r["prompt"],
             "response": r["chosen"]} for i, r in enumerate(rows)]
    prefs = [{"chosen": [{"role": "user", "content": r["prompt"]},
                         {"role": "assistant", "content": r["chosen"]}],
              "rejected": [{"role": "user", "content": r["prompt"]},
                           {"role": "assistant", "content": r["rejected"]}]} for r in rows]
    for name, table in (("Open-Orca/OpenOrca", orca),
                        ("OpenRLHF/preference_dataset_mixture2_and_safe_pku", prefs)):
        (root / name / "data").mkdir(parents=True)
        datasets.Dataset.from_list(table).to_parquet(
            str(root / name / "data" / "train-00000-of-00001.parquet"))
    tok = checkpoint_like_tokenizer(str(root / "model"))
    tok.pad_token = tok.eos_token
    save_tiny_llama(tok, root / "model")
    return root


def _moved(script: str, root, kernel: str | None) -> list[str]:
    """The script's command line with what a user moving over changes."""
    flags = [f.replace("LR", RATES.get(script, "")) for f in SCRIPTS[script]]
    sizes = {"--max_len": "64", "--train_batch_size": "8", "--micro_train_batch_size": "2"}
    out = []
    for index, flag in enumerate(flags):
        before = flags[index - 1] if index else ""
        if before in sizes:
            flag = sizes[before]
        elif before == "--pretrain":
            flag = str(root / "model")
        elif before in ("--dataset", "--save_path"):
            flag = str(root / flag.removeprefix("./"))
        elif before == "--attn_implementation" and kernel:
            flag = kernel
        out.append(flag)
    return out + ["--ckpt_path", str(root / script / "ckpt"), "--log_dir",
                  str(root / script / "logs"), "--max_steps", "3"]


def test_flash_attention_without_flash_attn_is_one_line_before_any_process_group(hub,
                                                                                  monkeypatch):
    from strategy.errors import ConfigError
    from tests.support.helpers import forbid_process_group, load_example

    if importlib.util.find_spec("flash_attn"):
        pytest.skip("flash-attn is installed here")
    forbid_process_group(monkeypatch)
    with pytest.raises(ConfigError, match="the flash-attn package is not installed here"):
        load_example("train_sft")(_moved("train_sft", hub, kernel=None))


def run_script(script: str, argv: list[str]) -> dict:
    from tests.support.helpers import load_example

    return load_example(script)(argv)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_openrlhf_command_line_trains(ranks, hub, script):
    import json

    kernel = None if importlib.util.find_spec("flash_attn") else "sdpa"
    ranks.run(run_script, script, _moved(script, hub, kernel))
    rows = [json.loads(line) for line in open(hub / script / "logs" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    saved = hub / "checkpoint" / f"llama3-8b-{script.split('_')[1]}"
    assert (saved / "config.json").is_file() or (saved / "adapter_config.json").is_file()


def test_vllm_sync_backend_is_taken_for_this_devices_backend():
    """``--vllm.sync_backend``: on a machine without CUDA gloo, and a GPU script's nccl too (gloo
    runs: the weight sync's backend is the device's), leaving nothing behind in our flags; on
    CUDA nccl, and gloo is one line naming nccl."""
    import torch

    from strategy.cli.dotted import dotted_argv
    from strategy.errors import ConfigError

    taken = ["nccl"] if torch.cuda.is_available() else ["gloo", "nccl"]
    for value in taken:
        assert dotted_argv(["--vllm.sync_backend", value, "--seed", "3"], "grpo") == [
            "--seed", "3"]
        assert dotted_argv([f"--vllm.sync_backend={value}"], "grpo") == []
    for wrong in {"gloo", "nccl", "mpi"} - set(taken):
        with pytest.raises(ConfigError) as err:
            dotted_argv(["--vllm.sync_backend", wrong], "grpo")
        device = "CUDA" if torch.cuda.is_available() else "CPU"
        assert str(err.value) == (f"--vllm.sync_backend {wrong} (OpenRLHF's) is invalid on this "
                                  f"machine: its {device} device uses {taken[0]} here; pass "
                                  f"{taken[0]} or drop it")
