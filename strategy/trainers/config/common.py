"""The settings every trainer takes: the model source, the loop's length, cadences and outputs,
the data, LoRA; and the sampling checks on-policy trainers share."""

from __future__ import annotations

from dataclasses import dataclass

from strategy.config.fields import check_positive, check_steps, doc
from strategy.errors import fail

OVERLONG = ("truncate", "drop", "error")
# which trainer commands take a shared field that is not every trainer's (``doc(trainers=)``)
REFERENCED = ("dpo", "kto", "grpo", "ppo")  # a frozen reference model
PAIRED = ("rm", "dpo", "orpo", "simpo", "kto")  # preference pairs (KTO: as one of each)
PROMPTED = ("sft", "grpo", "ppo", "distill")  # input/output rows
LOSS_WEIGHTINGS = ("step", "micro_batch")


@dataclass(frozen=True)
class ModelConfig:
    """Where the model and tokenizer come from."""

    pretrain: str | None = doc("HF model directory or name to fine-tune (None: build from "
                               "--model_config)", None)
    model_config: str | None = doc("JSON file of an HF config to build a fresh model from "
                                   "(tiny toy runs)", None)
    tokenizer: str | None = doc("tokenizer directory (default: --pretrain)", None)
    attn_implementation: str = doc("attention kernel: sdpa (packed rows: sdpa_varlen, per "
                                   "sample), sdpa_varlen, flash_attention_2 (GPU), "
                                   "flex_attention (GPU) or eager", "sdpa")

    ref_pretrain: str | None = doc("the frozen reference of DPO/GRPO (default: --pretrain)",
                                   None, trainers=REFERENCED)

    def __post_init__(self) -> None:
        if self.pretrain is None and self.model_config is None:
            fail("pretrain", None, "set --pretrain MODEL_DIR, or --model_config config.json to "
                 "train from scratch")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop: length, cadences, outputs, resume."""

    max_epochs: int = doc("passes over the training data", 1)
    max_steps: int = doc("stop after this many optimizer steps (-1: run all epochs)", -1)
    logging_steps: int = doc("log loss/lr/grad-norm every N optimizer steps", 1)
    eval_steps: int = doc("evaluate every N optimizer steps (-1: only at the end of training)", -1)
    eval_on_start: bool = doc("also evaluate before the first step (not when resuming)", False)
    save_steps: int = doc("save a resume checkpoint every N optimizer steps (-1: never mid-run)",
                          -1)
    save_path: str = doc("directory of the final Hugging Face export", "./outputs/model")
    save_hf_ckpt: bool = doc("also export an HF model beside each resume checkpoint", False)
    load_checkpoint: bool = doc("resume from the newest complete checkpoint in --ckpt_path if "
                                "there is one", False)
    log_dir: str | None = doc("TensorBoard events and metrics.jsonl go here (None: no logs)",
                              "./outputs/logs")
    use_wandb: bool = doc("also log to Weights & Biases (offline unless WANDB_MODE says otherwise)",
                          False)
    use_tensorboard: str | None = doc("OpenRLHF's TensorBoard directory: the same as --log_dir "
                                      "(metrics.jsonl goes there too)", None)
    disable_ds_ckpt: bool = doc("at --save_steps, save only an HF export (<ckpt_path>/<tag>_hf), "
                                "no DeepSpeed state (OpenRLHF's flag; nothing to resume from)",
                                False)
    max_shard_size: str = doc("largest safetensors shard of an export, e.g. 5GB or 500MB", "5GB")
    loss_weighting: str = doc("'step': every token (sample, for pair losses) of an optimizer step "
                              "weighs the same, however the step is split; 'micro_batch': each "
                              "micro-batch's mean weighs the same (the old way)", "step")
    tiled_logits_loss: bool | None = doc("compute the LM loss a chunk of tokens at a time, never "
                                         "holding all [tokens, vocab] logits (default: from a "
                                         "vocabulary of 65536 up)", None)
    logits_chunk_size: int = doc("tokens per chunk of the tiled logits loss (distill: positions "
                                 "of student and teacher logits per chunk, never [tokens, vocab] "
                                 "whole)", 2048)
    peak_tflops: float | None = doc("accelerator peak TFLOPS per device for the logged MFU "
                                    "(default: known H100/H200/A100 bf16 figures; none on CPU)",
                                    None)
    aux_loss_coef: float = doc("SFT of an MoE model (Mixtral, Qwen2-MoE...): weight of the "
                               "router's load-balancing loss, added per micro-batch", 0.0,
                               trainers=("sft",))
    ema_beta: float = doc("keep an exponential moving average of the trained weights with this "
                          "decay, e.g. 0.999 (0: off); saved in checkpoints", 0.0)
    save_ema: bool = doc("also export the moving-average weights to <save_path>_ema", False)

    def __post_init__(self) -> None:
        check_positive(self, "max_epochs", "logging_steps", "logits_chunk_size")
        if self.disable_ds_ckpt and self.load_checkpoint:
            fail("disable_ds_ckpt", True, "it saves no DeepSpeed state, so --load_checkpoint "
                 "has nothing to resume from; drop one of them")
        if self.use_tensorboard is not None:
            object.__setattr__(self, "log_dir", self.use_tensorboard)
        check_steps(self, "eval_steps", "save_steps", "max_steps")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            fail("loss_weighting", self.loss_weighting, "use step or micro_batch")
        if self.aux_loss_coef < 0:
            fail("aux_loss_coef", self.aux_loss_coef, "use a weight >= 0, e.g. 0.001")
        if not 0 <= self.ema_beta < 1:
            fail("ema_beta", self.ema_beta, "use a decay in [0, 1), e.g. 0.999 (0: off)")
        if self.save_ema and not self.ema_beta:
            fail("save_ema", True, "there is no moving average to export; set --ema_beta too")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            fail("peak_tflops", self.peak_tflops, "use a positive number of TFLOPS, e.g. 989")


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from and how they become token ids."""

    dataset: str | None = doc("training data: what datasets.load_dataset takes (a .json/.jsonl/"
                              ".parquet/.csv/.arrow file, a glob of them, a local dataset folder "
                              "or Hub id) or a save_to_disk folder; several comma-separated are "
                              "mixed (--dataset_probs)", None)
    eval_dataset: str | None = doc("held-out data, the same forms (optional)", None)
    dataset_split: str = doc("split of --dataset to train on (folders and Hub ids; a file or "
                             "glob is one split)", "train")
    eval_split: str = doc("split of --eval_dataset (folders and Hub ids)", "test")
    dataset_probs: str | None = doc("comma-separated sampling weights of the --dataset list, "
                                    "e.g. 0.7,0.3 (seeded; default: concatenated)", None)
    input_template: str | None = doc("wrap each prompt, e.g. 'User: {}\\nAssistant: ' (no chat "
                                     "template)", None)
    input_key: str = doc("SFT/GRPO: field holding the prompt", "input", trainers=PROMPTED)
    output_key: str = doc("SFT: field holding the response (GRPO: the reference answer)",
                          "output", trainers=PROMPTED)
    prompt_key: str = doc("RM/DPO: field holding the prompt", "prompt", trainers=PAIRED)
    chosen_key: str = doc("RM/DPO: field holding the preferred response", "chosen",
                          trainers=PAIRED)
    rejected_key: str = doc("RM/DPO: field holding the rejected response", "rejected",
                            trainers=PAIRED)
    completion_key: str = doc("KTO: field holding the completion", "completion",
                              trainers=("kto",))
    label_key: str = doc("KTO: field holding the label (true: desirable); a row with --chosen_key "
                         "and --rejected_key instead gives one completion of each. GRPO/PPO: "
                         "the field whose value --remote_rm_url gets as each query's label "
                         "('' where a row has none)", "label", trainers=("kto", "grpo", "ppo"))
    messages_key: str = doc("SFT: field holding a chat (a list of role/content turns); rows with "
                            "it are rendered with the tokenizer's chat template", "messages",
                            trainers=("sft", "distill"))
    apply_chat_template: bool = doc("wrap prompts in the tokenizer's chat template", False)
    max_len: int = doc("longest sample in tokens", 512)
    overlong: str = doc("a sample longer than max_len: 'truncate', 'drop' (counted) or 'error'",
                        "truncate")
    skip_bad_rows: bool = doc("skip (and count) rows with missing keys or empty text instead of "
                              "failing", False)
    max_samples: int = doc("use at most N training samples (-1: all)", -1)
    packing_samples: bool = doc("OpenRLHF's packing: batch sizes count samples, and each "
                                "micro-batch's samples are forwarded as one padding-free row "
                                "(position ids restart per sample; GRPO/PPO: the update's "
                                "forwards)", False)
    pack_dataset: bool = doc("SFT/RM/DPO: pack the dataset's samples into rows of up to max_len "
                             "tokens (pairs: 2 x max_len) before batching; batch sizes then "
                             "count those rows, not samples", False)
    streaming: bool = doc("read --dataset lazily (larger than memory): a seeded shuffle buffer, "
                          "pass after pass; needs --max_steps; resume is exact", False)
    shuffle_buffer: int = doc("--streaming: rows held to shuffle from", 10000)

    def __post_init__(self) -> None:
        if self.max_len < 2:
            fail("max_len", self.max_len, "use at least 2 tokens")
        if self.overlong not in OVERLONG:
            fail("overlong", self.overlong, "use truncate, drop or error")
        if self.max_samples == 0 or self.max_samples < -1:
            fail("max_samples", self.max_samples, "use a positive count, or -1 for all")
        if self.input_template is not None and "{}" not in self.input_template:
            fail("input_template", self.input_template, "put {} where the prompt goes")
        if self.input_template and self.apply_chat_template:
            fail("input_template", self.input_template, "pass it or --apply_chat_template, "
                 "not both")
        if self.dataset_probs is not None:
            self.probabilities()
        for name in ("packing_samples", "pack_dataset"):
            if self.streaming and getattr(self, name):
                fail(name, True, "packing is not done on a stream here; drop it or --streaming")
        if self.packing_samples and self.pack_dataset:
            fail("pack_dataset", True, "it packs the dataset into rows, --packing_samples packs "
                 "each micro-batch; pass one")
        check_positive(self, "shuffle_buffer")

    @property
    def packed(self) -> bool:
        """Whether batches are packed rows (``--packing_samples`` or ``--pack_dataset``)."""
        return self.packing_samples or self.pack_dataset

    def probabilities(self) -> list[float] | None:
        """The ``--dataset_probs`` weights, one per ``--dataset`` entry (None: concatenate).

        Returns:
            The weights normalized to sum 1, or None.

        Raises:
            ConfigError: not one positive number per dataset.
        """
        if self.dataset_probs is None:
            return None
        names = (self.dataset or "").split(",")
        try:
            probs = [float(p) for p in self.dataset_probs.split(",")]
        except ValueError:
            fail("dataset_probs", self.dataset_probs, "use comma-separated numbers, e.g. 0.7,0.3")
        if len(probs) != len(names) or min(probs) <= 0:
            fail("dataset_probs", self.dataset_probs, f"give one positive weight for each of the "
                 f"{len(names)} datasets in --dataset")
        return [p / sum(probs) for p in probs]


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters through peft (off when lora_rank is 0)."""

    lora_rank: int = doc("adapter rank; 0 trains the full model", 0)
    lora_alpha: int = doc("adapter scaling numerator (scale = alpha / rank)", 16)
    lora_dropout: float = doc("dropout on the adapter input", 0.0)
    target_modules: str = doc("comma-separated module names to adapt, or all-linear", "all-linear")
    load_in_4bit: bool = doc("QLoRA: load --pretrain's linear layers in 4-bit NF4 (double "
                             "quantisation, compute dtype from --bf16/--fp16) and train LoRA "
                             "adapters on them; needs bitsandbytes (pip install '.[qlora]')", False)

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            fail("lora_rank", self.lora_rank, "use 0 (no LoRA) or a positive rank")
        if not 0 <= self.lora_dropout < 1:
            fail("lora_dropout", self.lora_dropout, "use a probability in [0, 1)")
        if self.lora_rank and not self.target_modules.strip():
            fail("target_modules", self.target_modules, "name modules, e.g. q_proj,v_proj, or "
                 "all-linear")


def check_sampling(config: object) -> None:
    """An on-policy config's sampling settings: ``temperature``, ``top_p``, ``top_k``."""
    if config.temperature <= 0:
        fail("temperature", config.temperature, "use a positive temperature, e.g. 1.0")
    if not 0 < config.top_p <= 1:
        fail("top_p", config.top_p, "use a probability in (0, 1]")
    if config.top_k < 0:
        fail("top_k", config.top_k, "use 0 (all tokens) or a positive count")


def positive(config: object, *names: str) -> None:
    """Each named float field is > 0."""
    for name in names:
        if getattr(config, name) <= 0:
            fail(name, getattr(config, name), "use a positive number")

