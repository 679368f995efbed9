"""``strategy lora-combiner`` (``python -m strategy.cli.lora_combiner``, OpenRLHF's flags): a LoRA
adapter merged into its base gives the adapted model's outputs, for a causal LM and a reward
model (bf16); paths that will not do are one line before the base loads."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny LLaMA (the toy tokenizer's vocabulary) saved with its tokenizer, and a LoRA adapter
    of it with random weights on every linear layer (a zero-initialised one would change
    nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strategy.demos.toy_task import make_tokenizer
    from tests.support.helpers import save_tiny_llama

    root = tmp_path_factory.mktemp("lora_combiner")
    make_tokenizer(str(root / "tok"))
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    save_tiny_llama(tok, root / "base")
    tok.save_pretrained(root / "base")
    torch.manual_seed(3)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base"),
                          LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                     init_lora_weights=False))
    lora.save_pretrained(root / "adapter")
    return root


def _combine(*argv: str) -> tuple[int, str]:
    """``strategy lora-combiner ARGV`` in this process: its exit status and stderr's last line."""
    import contextlib
    import io

    from strategy.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main(["lora-combiner", *argv])
    return stop.value.code, err.getvalue().strip()


def _ids() -> torch.Tensor:
    return torch.tensor([[5, 9, 12, 7, 3, 11], [4, 4, 8, 2, 10, 6]])


def test_a_merged_causal_lm_gives_the_adapted_models_logits(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, err = _combine("--model_path", str(base / "base"), "--lora_path",
                         str(base / "adapter"), "--output_path", str(tmp_path / "merged"))
    assert code == 0, err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base / "base"),
                                        base / "adapter").eval()
    plain = AutoModelForCausalLM.from_pretrained(base / "base").eval()
    with torch.no_grad():
        got, want, before = (m(_ids()).logits for m in (merged, adapted, plain))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - before).abs().max() > 1e-2  # the adapter changed the model
    assert not any(k for k in merged.state_dict() if "lora" in k)  # merged: plain weights
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").vocab_size == \
        AutoTokenizer.from_pretrained(base / "base").vocab_size


def test_a_merged_reward_model_in_bf16_gives_the_adapted_scores(base, tmp_path):
    """``--is_rm --bf16``: the sequence classifier with its ``score`` head trained fully
    (``modules_to_save``, as a LoRA reward model saves it)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(4)
    rm = AutoModelForSequenceClassification.from_pretrained(base / "base", num_labels=1)
    rm.config.pad_token_id = 0
    rm.save_pretrained(tmp_path / "rm")
    adapted = get_peft_model(rm, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            modules_to_save=["score"], init_lora_weights=False))
    with torch.no_grad():
        adapted.base_model.model.score.modules_to_save["default"].weight.normal_()
    adapted.save_pretrained(tmp_path / "rm_adapter")
    code, err = _combine("--model_path", str(tmp_path / "rm"), "--lora_path",
                         str(tmp_path / "rm_adapter"), "--output_path", str(tmp_path / "merged"),
                         "--is_rm", "--bf16")
    assert code == 0, err
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    assert merged.dtype == torch.bfloat16
    want_model = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm"),
        tmp_path / "rm_adapter").eval()
    with torch.no_grad():
        got = merged(_ids()).logits.float()
        want = want_model(_ids()).logits
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.02)


@pytest.mark.parametrize("paths,line", [
    ({"lora_path": None}, "error: lora_path is required: pass --lora_path VALUE (or set it in "
                          "--config)"),
    ({"lora_path": "base"}, "error: lora_path='ROOT/base' is invalid: no adapter_config.json "
                            "there; give the folder a LoRA run saved (its --save_path)"),
    ({"output_path": "base"}, "error: output_path='ROOT/base' is invalid: it would overwrite an "
                              "input; choose a new folder"),
    ({"model_path": "missing"}, "error: model_path='ROOT/missing' is invalid: cannot load it ("),
    ({"model_path": "other"}, "error: lora_path='ROOT/adapter' is invalid: it does not fit "
                              "'ROOT/other' (Error(s) in loading state_dict for PeftModel: "
                              "size mismatch for "),
])
def test_paths_that_will_not_do_are_one_line(base, tmp_path, paths, line):
    """Each before anything is written; the other base (a wider model) is caught by peft."""
    from transformers import AutoModelForCausalLM

    from strategy.trainers.run import hf_config

    if paths.get("model_path") == "other":
        config = hf_config("configs/tiny_llama.json", None)
        config.hidden_size, config.vocab_size = 2 * config.hidden_size, 13
        AutoModelForCausalLM.from_config(config).save_pretrained(base / "other")
    argv = {"model_path": "base", "lora_path": "adapter", "output_path": str(tmp_path / "out"),
            **paths}
    flags = [x for k, v in argv.items() if v is not None
             for x in (f"--{k}", v if v.startswith("/") else str(base / v))]
    code, err = _combine(*flags)
    shown = err.splitlines()[-1]  # above it at most transformers' weight-loading bar
    assert code == 2 and "Traceback" not in err, err
    assert shown.startswith(line.replace("ROOT", str(base))), err
    assert not (tmp_path / "out").exists()
