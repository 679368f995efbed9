"""A tokenizer configured as real chat checkpoints are (Llama/Qwen style), for the toy data:
no pad token (the wiring falls back to pad == eos), left padding, a BOS that the chat template
adds, and an end-of-turn token (``<|im_end|>``) that is not EOS (``</s>``)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from strategy.demos.toy_task import ALPHABET

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_end|>", "<|system|>", "<|user|>", "<|assistant|>"]
TEMPLATE = ("<s>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def checkpoint_like_tokenizer(out_dir: str) -> PreTrainedTokenizerFast:
    """Saved to ``out_dir`` and returned."""
    vocab = {token: i for i, token in enumerate(SPECIAL + list(ALPHABET) + ["="])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", padding_side="left",
                                        additional_special_tokens=SPECIAL[3:])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer
