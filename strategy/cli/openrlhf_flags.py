"""OpenRLHF's command-line flags, and what each becomes here.

Read from OpenRLHF v0.11.0: ``version.txt`` 0.11.0, commit
3c3be6234e0cb353e76bb8019947db9dfe99fca7 (2026-08-13, the commit tagged v0.11.0, the newest
snapshot). The flags are the argparse blocks of ``openrlhf/cli/train_sft.py``, ``train_rm.py``,
``train_dpo.py`` and ``train_ppo_ray.py``; each script defines all of its flags inline (no shared
helper module adds any; ``openrlhf.utils.config.hierarchize`` only nests the parsed dotted names
into ``args.ds.zero_stage``...).

OpenRLHF 0.11 no longer accepts the undotted 0.9-era spellings (``--zero_stage``, ``--pretrain``,
``--n_samples_per_prompt``): it has no aliases, and argparse's unique-prefix matching cannot reach
a dotted name from an undotted one (it does accept abbreviations such as ``--ds.zero``; the keys
here are full names). A few flags are still undotted in 0.11 and appear here by those names:
``local_rank`` and ``use_ms`` in every parser, and ``optim``, ``lr_scheduler``,
``lr_warmup_ratio``, ``min_lr_ratio`` and ``max_norm`` in train_sft, train_rm and train_dpo
(train_ppo_ray spells them ``actor.*`` and ``critic.*``).

- ``DOTTED``: flag -> the argv tokens it becomes here. Each ``{}`` takes one of the flag's
  values, in order (``adam.betas`` has two). ``ds.lora.target_modules`` takes any number: its one
  ``{}`` is the first, the others follow it as they are (``dotted.openrlhf_argv`` joins
  ``--target_modules q_proj v_proj``). A store_true flag has no ``{}``; an empty tuple is something
  this framework always does (nothing to pass). Trailing comments name differences in detail,
  mostly defaults, which are not translated: a flag OpenRLHF's command line leaves out keeps our
  default, not OpenRLHF's.
- ``VALUE_MAPS``: flag -> {OpenRLHF value: our value} for a ``DOTTED`` flag whose values are
  spelled otherwise here; a value missing from its map has no equivalent (refuse it).
- ``PER_PARSER``: parser -> {flag: tokens} for a flag that means something else in that parser
  than ``DOTTED`` says; these come first.
- ``REFUSED``: flag -> the one-line reason it has no equivalent, naming the closest setting here.
- ``PARSERS``: parser -> every flag it accepts (without ``--``), in its order. Each is in exactly
  one of ``DOTTED`` and ``REFUSED``.

train_ppo_ray is two trainers here: ``--algo.advantage.estimator gae`` (its default) is our PPO
(critic, GAE), the outcome estimators our GRPO. Our batch sizes count what OpenRLHF's do:
``micro_train_batch_size`` per rank, ``train_batch_size`` global per optimizer step (completions
for GRPO/PPO); a rollout here is one step's ``train_batch_size`` completions, stepped
``--ppo_epochs`` times.
"""

from __future__ import annotations

DOTTED: dict[str, tuple[str, ...]] = {
    # ---- Ray placement (strategy.cluster; --ray is set by train_ppo_ray): the reference,
    # critic and reward model each in a group of its own when its size is given and it is not
    # colocated, else inside the actor group's ranks
    "actor.num_nodes": ("--actor_num_nodes", "{}"),
    "actor.num_gpus_per_node": ("--actor_num_gpus_per_node", "{}"),
    "ref.num_nodes": ("--ref_num_nodes", "{}"),
    "ref.num_gpus_per_node": ("--ref_num_gpus_per_node", "{}"),
    "critic.num_nodes": ("--critic_num_nodes", "{}"),
    "critic.num_gpus_per_node": ("--critic_num_gpus_per_node", "{}"),
    "reward.num_nodes": ("--reward_num_nodes", "{}"),
    "reward.num_gpus_per_node": ("--reward_num_gpus_per_node", "{}"),
    "train.colocate_all": ("--colocate_all",),
    "train.colocate_actor_ref": ("--colocate_actor_ref",),
    "train.colocate_critic_reward": ("--colocate_critic_reward",),
    # ---- checkpoints, outputs, logging
    "ckpt.output_dir": ("--save_path", "{}"),  # the final HF export (default ./outputs/model)
    # -1: never mid-run, both; train_ppo_ray's counts rollouts (PER_PARSER), as eval.steps does
    "ckpt.save_steps": ("--save_steps", "{}"),
    "ckpt.save_hf": ("--save_hf_ckpt",),
    "ckpt.disable_ds": ("--disable_ds_ckpt",),
    "ckpt.path": ("--ckpt_path", "{}"),
    "ckpt.max_num": ("--max_ckpt_num", "{}"),
    # GB both; OpenRLHF's default 1e8 (PPO: inf), ours 1000; HF exports beside count here
    "ckpt.max_mem": ("--max_ckpt_mem", "{}"),
    "ckpt.load_enable": ("--load_checkpoint",),
    # always here: a checkpoint of another world size goes through ds_to_universal on load
    "ds.use_universal_ckpt": (),
    "logger.logging_steps": ("--logging_steps", "{}"),
    # -1: OpenRLHF evaluates once per epoch (train_ppo_ray: never), here at the end of training
    "eval.steps": ("--eval_steps", "{}"),
    # here the default is ./outputs/logs (OpenRLHF: no TensorBoard); metrics.jsonl goes there too
    "logger.tensorboard_dir": ("--log_dir", "{}"),
    # the key becomes WANDB_API_KEY (dotted.openrlhf_argv); offline unless WANDB_MODE=online
    "logger.wandb.key": ("--use_wandb", "{}"),
    # ---- batch sizes, length, seed, launcher
    "train.micro_batch_size": ("--micro_train_batch_size", "{}"),  # per rank, both
    "train.batch_size": ("--train_batch_size", "{}"),  # global per step (PPO: completions), both
    "train.max_epochs": ("--max_epochs", "{}"),  # SFT default 2, ours 1; train_ppo_ray: PER_PARSER
    "train.num_episodes": ("--max_epochs", "{}"),  # passes over the prompt dataset
    "train.seed": ("--seed", "{}"),
    "local_rank": ("--local_rank", "{}"),
    # ---- DeepSpeed, precision, memory
    "ds.zero_stage": ("--zero_stage", "{}"),
    "ds.param_dtype": ("--param_dtype", "{}"),  # OpenRLHF's default bf16; ours fp32 unless given
    "ds.zpg": ("--zpg", "{}"),  # ZeRO++ hpZ partition size, both
    "ds.adam_offload": ("--adam_offload",),  # DeepSpeedCPUAdam on offloaded states, both
    "ds.grad_accum_dtype": ("--grad_accum_dtype", "{}"),
    "ds.overlap_comm": ("--overlap_comm",),
    # the trained engines' Adam states, master weights and gradients in CPU memory between
    # updates, both (OpenRLHF's offload_deepspeed_states; a no-op with adam_offload, both)
    "ds.enable_sleep": ("--ds_enable_sleep",),
    # DeepSpeed AutoTP, both; here ZeRO 0-2 and not with GRPO/PPO
    "ds.tensor_parallel_size": ("--tensor_parallel_size", "{}"),
    # 1 only: above 1 refused here (no ring attention; --sequence_parallel_size N is Ulysses)
    "ds.ring_attn_size": ("--ring_attn_size", "{}"),
    # a micro-batch's samples in one padding-free row, both (OpenRLHF's PPO needs vLLM for it)
    "ds.packing_samples": ("--packing_samples",),
    # default flash_attention_2 there, sdpa here; here also sdpa_varlen, flex_attention, eager
    "ds.attn_implementation": ("--attn_implementation", "{}"),
    "model.gradient_checkpointing_enable": ("--gradient_checkpointing",),  # non-reentrant, both
    "actor.gradient_checkpointing_enable": ("--gradient_checkpointing",),  # the critic's too
    "ref.offload": ("--ref_offload",),  # here ZeRO-3 with parameters on CPU between uses
    "reward.offload": ("--ref_offload",),  # one flag here offloads reference and reward model
    # ---- LoRA / QLoRA
    "ds.load_in_4bit": ("--load_in_4bit",),
    "ds.lora.rank": ("--lora_rank", "{}"),
    "ds.lora.alpha": ("--lora_alpha", "{}"),
    "ds.lora.dropout": ("--lora_dropout", "{}"),
    "ds.lora.target_modules": ("--target_modules", "{}"),  # space- or comma-separated here
    # ---- models
    "model.model_name_or_path": ("--pretrain", "{}"),
    "actor.model_name_or_path": ("--pretrain", "{}"),
    "ref.model_name_or_path": ("--ref_pretrain", "{}"),  # default --pretrain, both
    "reward.remote_url": ("--remote_rm_url", "{}"),  # a reward_func file or server URLs
    "data.label_key": ("--label_key", "{}"),  # the labels OpenRLHF's rewards get
    "reward.model_name_or_path": ("--reward_pretrain", "{}"),  # one model here (OpenRLHF: a list)
    "reward.normalize_enable": ("--normalize_reward",),  # by the mean and std it saved
    # default the reward model, else the policy, both
    "critic.model_name_or_path": ("--critic_pretrain", "{}"),
    "critic.save_value_network": ("--save_value_network",),  # here to <save_path>_critic
    # MoE router loss: SFT here; RM, DPO and GRPO/PPO refuse a nonzero value
    "model.aux_loss_coef": ("--aux_loss_coef", "{}"),
    "actor.aux_loss_coef": ("--aux_loss_coef", "{}"),
    "actor.entropy_coef": ("--entropy_coef", "{}"),  # OpenRLHF's None (no logs) is our 0.0
    "rollout.batch_size": ("--rollout_batch_size", "{}"),  # prompts per rollout, both
    "rollout.micro_batch_size": ("--micro_rollout_batch_size", "{}"),  # experience forwards
    "train.dynamic_batch_enable": ("--dynamic_batch",),  # micro-batches by a token budget
    "train.max_tokens_per_gpu": ("--max_tokens_per_gpu", "{}"),
    "rollout.max_tokens_per_gpu": ("--rollout_max_tokens_per_gpu", "{}"),
    "eval.temperature": ("--eval_temperature", "{}"),  # OpenRLHF's default 0.6, ours 0: greedy
    "eval.n_samples_per_prompt": ("--eval_n_samples", "{}"),  # OpenRLHF's default 4, ours 1
    # ---- data
    "data.dataset": ("--dataset", "{}"),
    "data.dataset_probs": ("--dataset_probs", "{}"),  # comma-separated, both
    "data.dataset_split": ("--dataset_split", "{}"),
    "data.prompt_dataset": ("--dataset", "{}"),
    "data.prompt_probs": ("--dataset_probs", "{}"),
    "data.prompt_split": ("--dataset_split", "{}"),
    "eval.dataset": ("--eval_dataset", "{}"),
    "eval.split": ("--eval_split", "{}"),  # OpenRLHF's default train (DPO: test), ours test
    "data.max_samples": ("--max_samples", "{}"),  # OpenRLHF's default 1e6 (PPO 1e8), ours all
    # SFT: the prompt; train_ppo_ray: the prompt too (our GRPO/PPO prompts read --input_key)
    "data.input_key": ("--input_key", "{}"),
    "data.output_key": ("--output_key", "{}"),  # OpenRLHF's default none, ours output
    "data.prompt_key": ("--prompt_key", "{}"),  # OpenRLHF's default none (no prompt), ours prompt
    "data.chosen_key": ("--chosen_key", "{}"),
    "data.rejected_key": ("--rejected_key", "{}"),
    # OpenRLHF's SFT default 'User: {}\nAssistant: ', ours none; here not with a chat template
    "data.input_template": ("--input_template", "{}"),
    "data.apply_chat_template": ("--apply_chat_template",),
    "data.max_len": ("--max_len", "{}"),  # GRPO/PPO: prompt + completion, both
    # ---- optimizer, schedule, clipping (train_ppo_ray: actor.*; the critic shares them here)
    "optim": ("--optimizer", "{}"),  # VALUE_MAPS
    "actor.optim": ("--optimizer", "{}"),  # VALUE_MAPS
    "adam.lr": ("--learning_rate", "{}"),  # defaults differ per script (SFT 5e-6), ours 1e-5
    "actor.adam.lr": ("--learning_rate", "{}"),  # OpenRLHF's default 1e-6
    "critic.adam.lr": ("--critic_learning_rate", "{}"),  # 9e-6, both
    "adam.betas": ("--adam_betas", "{}", "{}"),
    "actor.adam.betas": ("--adam_betas", "{}", "{}"),
    "adam.eps": ("--adam_eps", "{}"),
    "actor.adam.eps": ("--adam_eps", "{}"),
    "adam.weight_decay": ("--l2", "{}"),  # not on biases and norm weights, both
    "actor.adam.weight_decay": ("--l2", "{}"),
    "lr_scheduler": ("--lr_scheduler", "{}"),
    "actor.lr_scheduler": ("--lr_scheduler", "{}"),
    "lr_warmup_ratio": ("--lr_warmup_ratio", "{}"),
    "actor.lr_warmup_ratio": ("--lr_warmup_ratio", "{}"),
    "min_lr_ratio": ("--min_lr_ratio", "{}"),
    "actor.min_lr_ratio": ("--min_lr_ratio", "{}"),
    "max_norm": ("--max_norm", "{}"),
    "actor.max_norm": ("--max_norm", "{}"),
    # ---- RM
    "model.loss_type": ("--loss", "{}"),  # sigmoid or logexpsigmoid, the same function
    # always here: the scores are cast to fp32 before the loss
    "model.compute_fp32_loss_enable": (),
    # ---- DPO
    "model.beta": ("--beta", "{}"),
    "model.ipo_enable": ("--ipo",),
    "model.label_smoothing": ("--label_smoothing", "{}"),  # here refused with ipo (ignored there)
    "model.nll_loss_coef": ("--nll_loss_coef", "{}"),
    # ---- PPO / GRPO (our GRPOConfig / PPOConfig)
    "rollout.n_samples_per_prompt": ("--group_size", "{}"),  # GRPO default 8 here, PPO 1
    # OpenRLHF's default none: max_len - the prompt; ours 64
    "rollout.max_new_tokens": ("--max_new_tokens", "{}"),
    "rollout.temperature": ("--temperature", "{}"),  # log-probs at it too, both
    "rollout.top_p": ("--top_p", "{}"),
    "actor.eps_clip": ("--clip_eps", "{}"),
    "actor.eps_clip_low_high": ("--clip_eps_low", "{}", "--clip_eps_high", "{}"),
    "actor.dual_clip": ("--dual_clip", "{}"),
    "critic.value_clip": ("--value_clip", "{}"),
    "algo.advantage.estimator": ("--advantage_estimator", "{}"),  # gae: our PPO, else GRPO
    "algo.advantage.gamma": ("--gamma", "{}"),  # OpenRLHF forces 1 for the group estimators
    "algo.advantage.lambd": ("--lambd", "{}"),  # OpenRLHF's default 1, ours 0.95
    "algo.kl.init_coef": ("--kl_coef", "{}"),  # OpenRLHF's 0.01 = our PPO's; GRPO's 0.04
    "algo.kl.estimator": ("--kl_estimator", "{}"),  # OpenRLHF's k1 = our PPO's; GRPO's k3
    # KL in the loss; OpenRLHF's default (in the reward) is our PPO's, not our GRPO's: without
    # this flag a GRPO command wants --kl_in_reward
    "algo.kl.use_loss": ("--no-kl_in_reward",),
    # DAPO's overlong punishment and ProRL's stop-properly penalty, both, in OpenRLHF's order
    "algo.dynamic_filtering_enable": ("--dynamic_filtering",),  # OpenRLHF samples on until
    # the batch is full or the data runs out; here at most --max_sampling_rounds (default 10)
    "algo.dynamic_filtering_range": ("--dynamic_filtering_range", "{}", "{}"),
    "reward.overlong_buffer_len": ("--overlong_buffer_len", "{}"),
    "reward.overlong_penalty_factor": ("--overlong_penalty_factor", "{}"),
    "reward.stop_properly_penalty_coef": ("--stop_properly_penalty_coef", "{}"),
    # ppo or gspo, both (gspo: each completion's ratio; its mean over completions, both)
    "actor.policy_loss_type": ("--policy_loss_type", "{}"),
    # vLLM: colocated here, an engine on every rank (OpenRLHF's hybrid engine)
    "vllm.enforce_eager": ("--vllm_enforce_eager",),
    "vllm.enable_sleep": ("--vllm_enable_sleep",),
    "vllm.gpu_memory_utilization": ("--vllm_gpu_memory_utilization", "{}"),
    "vllm.tensor_parallel_size": ("--vllm_tensor_parallel_size", "{}"),
    # engines on GPUs of their own (no --train.colocate_all), each of tensor_parallel_size GPUs
    "vllm.num_engines": ("--vllm_num_engines", "{}"),
    # OpenRLHF's default type is tis; a type flag alone turns the correction on here
    "algo.advantage.is_correction_enable": ("--is_correction", "tis"),
    "algo.advantage.is_correction_type": ("--is_correction", "{}"),
    "algo.advantage.is_correction_threshold": ("--is_correction_threshold", "{}", "{}"),
    # the file's import line: from strategy.agents import AgentInstanceBase, ...
    "train.agent_func_path": ("--agent_func_path", "{}"),
    # one rollout ahead at most here (--async_rollouts 0 or 1); a queue size alone turns it on
    "train.async_enable": ("--async_rollouts", "1"),
    "train.async_queue_size": ("--async_rollouts", "{}"),
    # vLLM's pause and resume there; here the engine stops between two of its steps
    "train.partial_rollout_enable": ("--partial_rollouts",),
}

VALUE_MAPS: dict[str, dict[str, str]] = {
    # DeepSpeedCPUAdam with --adam_offload, FusedAdam otherwise, both; Muon is not here
    "optim": {"adam": "fused_adam"},
    "actor.optim": {"adam": "fused_adam"},
}

PER_PARSER: dict[str, dict[str, tuple[str, ...]]] = {
    # passes over each rollout, one optimizer step a pass when the rollout is one
    # train_batch_size (here always)
    "train_ppo_ray": {"train.max_epochs": ("--ppo_epochs", "{}"),
                      # its steps are rollouts there (global_step counts train_step calls)
                      "ckpt.save_steps": ("--save_rollouts", "{}"),
                      "eval.steps": ("--eval_rollouts", "{}")},
}

_VLLM = ("vLLM engines here run in every rank (--rollout_engine vllm) or on devices of their own "
         "(--vllm_num_engines N: on Ray, Ray actors), their weights synced over a process group "
         "of their own")
_MUON = "Muon is not here; --optimizer fused_adam, cpu_adam or hybrid_adam (Adam)"
_VLM = "vision-language training is not here; text prompts only"
_CRITIC = "the critic takes the policy's {} (its own setting here: --critic_learning_rate)"

REFUSED: dict[str, str] = {
    # ---- runtime, kernels, tokenizer, hub
    "ds.deepcompile": "DeepCompile is not here (engines are not compiled); --ds_config_overrides "
                      "for other DeepSpeed settings",
    "train.full_determinism_enable": "no deterministic-kernels mode here; runs are seeded "
                                     "(--seed) and a resume samples exactly what the run did",
    "ds.experts_implementation": "MoE expert kernels are transformers' default here (no flag)",
    "ds.use_liger_kernel": "Liger kernels are not here; --tiled_logits_loss bounds the logits' "
                           "memory",
    "model.gradient_checkpointing_reentrant": "gradient checkpointing is non-reentrant here "
                                              "(--gradient_checkpointing)",
    "actor.gradient_checkpointing_reentrant": "gradient checkpointing is non-reentrant here "
                                              "(--gradient_checkpointing)",
    "data.disable_fast_tokenizer": "the tokenizer is AutoTokenizer's default (fast where there "
                                   "is one); --tokenizer DIR picks another",
    "data.dataloader_num_workers": "loaders read in the training process (OpenRLHF's default 0 "
                                   "workers); no flag",
    "data.tokenizer_chat_template": "the chat template is the tokenizer's own: save one into a "
                                    "--tokenizer DIR",
    "use_ms": "ModelScope is not here: download the model and pass its directory as --pretrain",
    "ds.ring_attn_head_stride": "ring attention is not here; --sequence_parallel_size N "
                                "(DeepSpeed Ulysses)",
    "ds.value_head_prefix": "the head is AutoModelForSequenceClassification's (score in most "
                            "families); no flag",
    # ---- logging
    "logger.wandb.org": "wandb.init reads WANDB_ENTITY here; set it with --use_wandb",
    "logger.wandb.group": "wandb.init reads WANDB_RUN_GROUP here; set it with --use_wandb",
    "logger.wandb.project": "wandb.init reads WANDB_PROJECT here; set it with --use_wandb",
    "logger.wandb.run_name": "wandb.init reads WANDB_NAME here; set it with --use_wandb",
    # ---- checkpoints
    "ckpt.best_metric_key": "best checkpoints: --keep_best_ckpt K --best_metric NAME "
                            "(--best_metric_higher); off by default here",
    "train.enable_ema": "EMA here: --ema_beta B turns it on, --save_ema exports it beside the "
                        "model to <save_path>_ema (OpenRLHF exports the EMA as the model)",
    "train.ema_beta": "only with train.enable_ema there; here --ema_beta B (> 0) turns EMA on by "
                      "itself (--save_ema to export it)",
    # ---- optimizer
    "muon.lr": _MUON,
    "muon.momentum": _MUON,
    "muon.ns_steps": _MUON,
    "muon.nesterov": _MUON,
    "muon.no_nesterov": _MUON,
    "actor.muon.lr": _MUON,
    "actor.muon.momentum": _MUON,
    "actor.muon.ns_steps": _MUON,
    "actor.muon.nesterov": _MUON,
    "actor.muon.no_nesterov": _MUON,
    "critic.muon.lr": _MUON,
    "critic.muon.momentum": _MUON,
    "critic.muon.ns_steps": _MUON,
    "critic.muon.nesterov": _MUON,
    "critic.muon.no_nesterov": _MUON,
    "critic.optim": _CRITIC.format("--optimizer (Adam; Muon is not here)"),
    "critic.adam.betas": _CRITIC.format("--adam_betas"),
    "critic.adam.eps": _CRITIC.format("--adam_eps"),
    "critic.adam.weight_decay": _CRITIC.format("--l2"),
    "critic.lr_scheduler": _CRITIC.format("--lr_scheduler"),
    "critic.lr_warmup_ratio": _CRITIC.format("--lr_warmup_ratio"),
    "critic.min_lr_ratio": _CRITIC.format("--min_lr_ratio"),
    "critic.max_norm": _CRITIC.format("--max_norm"),
    # ---- SFT / RM data and losses
    "model.pretrain_mode_enable": "no pretraining loss over prompt tokens here: SFT scores the "
                                  "response (--output_key) or chat assistant turns",
    "data.multiturn": "chat rows are found by --messages_key (default messages; all assistant "
                      "turns scored): pass --messages_key <the --input_key field>",
    "model.margin_loss_enable": "the RM pairwise loss has no margin term here (--loss sigmoid)",
    # ---- vLLM
    "vllm.sync_with_ray": _VLLM,
    "vllm.enable_prefix_caching": "our vLLM engines always cache prefixes; drop it",
    "rollout.vllm_generate_batch_size": _VLLM,
    # ---- PPO / GRPO
    "critic.freezing_steps": "no critic warm-up here: policy and critic train from the first step",
    "algo.kl.target": "no adaptive KL controller here: the weight is fixed (--kl_coef)",
    "algo.kl.horizon": "no adaptive KL controller here: the weight is fixed (--kl_coef)",
    "reward.clip_range": "rewards are not clipped here (OpenRLHF clamps to [-10, 10] by "
                         "default); clip in --reward_fn",
    "algo.advantage.no_std_norm": "whitening here always divides by the std; --advantage_estimator "
                                  "dr_grpo is the group mean alone",
    # ---- vision-language
    "data.image_key": _VLM,
    "data.max_images_per_prompt": _VLM,
    "actor.freeze_visual_encoder": _VLM,
}

# flags whose value is the device's: each device's values taken (the first is what runs: a GPU
# script's nccl on a machine without CUDA runs gloo), another one line
DEVICE_FLAGS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.sync_backend": {"cuda": ("nccl",), "cpu": ("gloo", "nccl")},  # the weight sync's
}

PARSERS: dict[str, tuple[str, ...]] = {
    "train_sft": (
        "ckpt.output_dir", "ckpt.save_steps", "ckpt.save_hf", "ckpt.disable_ds",
        "logger.logging_steps", "eval.steps", "ckpt.path", "ckpt.max_num", "ckpt.max_mem",
        "ckpt.load_enable", "ds.use_universal_ckpt", "train.micro_batch_size", "train.batch_size",
        "model.gradient_checkpointing_enable", "ds.deepcompile", "train.seed",
        "train.full_determinism_enable", "local_rank", "ds.zero_stage", "ds.param_dtype", "ds.zpg",
        "ds.adam_offload", "ds.attn_implementation", "ds.experts_implementation",
        "ds.use_liger_kernel", "ds.grad_accum_dtype", "ds.overlap_comm",
        "model.gradient_checkpointing_reentrant", "data.disable_fast_tokenizer",
        "data.dataloader_num_workers", "ds.tensor_parallel_size", "train.max_epochs",
        "model.aux_loss_coef", "model.model_name_or_path", "model.pretrain_mode_enable", "optim",
        "muon.lr", "muon.momentum", "muon.ns_steps", "muon.nesterov", "muon.no_nesterov", "adam.lr",
        "adam.betas", "adam.eps", "adam.weight_decay", "lr_scheduler", "lr_warmup_ratio",
        "min_lr_ratio", "max_norm", "ds.ring_attn_size", "ds.ring_attn_head_stride",
        "ds.load_in_4bit", "ds.lora.rank", "ds.lora.alpha", "ds.lora.target_modules",
        "ds.lora.dropout", "ds.packing_samples", "data.dataset", "data.dataset_probs",
        "eval.dataset", "data.dataset_split", "eval.split", "data.max_samples", "data.multiturn",
        "data.input_key", "data.output_key", "data.input_template", "data.apply_chat_template",
        "data.tokenizer_chat_template", "data.max_len", "logger.wandb.key", "logger.wandb.org",
        "logger.wandb.group", "logger.wandb.project", "logger.wandb.run_name",
        "logger.tensorboard_dir", "use_ms",
    ),
    "train_rm": (
        "ckpt.output_dir", "ckpt.save_steps", "ckpt.save_hf", "ckpt.disable_ds",
        "logger.logging_steps", "eval.steps", "ckpt.path", "ckpt.max_num", "ckpt.max_mem",
        "ckpt.load_enable", "ds.use_universal_ckpt", "model.gradient_checkpointing_enable",
        "ds.deepcompile", "train.seed", "train.full_determinism_enable", "local_rank",
        "ds.zero_stage", "ds.param_dtype", "ds.zpg", "ds.adam_offload", "ds.attn_implementation",
        "ds.experts_implementation", "ds.grad_accum_dtype", "ds.overlap_comm",
        "model.gradient_checkpointing_reentrant", "data.disable_fast_tokenizer",
        "data.dataloader_num_workers", "ds.tensor_parallel_size", "model.model_name_or_path",
        "ds.value_head_prefix", "ds.ring_attn_size", "ds.ring_attn_head_stride", "ds.load_in_4bit",
        "ds.lora.rank", "ds.lora.alpha", "ds.lora.dropout", "ds.lora.target_modules",
        "train.max_epochs", "model.aux_loss_coef", "model.compute_fp32_loss_enable",
        "model.margin_loss_enable", "train.micro_batch_size", "train.batch_size", "model.loss_type",
        "optim", "muon.lr", "muon.momentum", "muon.ns_steps", "muon.nesterov", "muon.no_nesterov",
        "adam.lr", "adam.betas", "adam.eps", "adam.weight_decay", "lr_scheduler", "lr_warmup_ratio",
        "min_lr_ratio", "max_norm", "ds.packing_samples", "data.dataset", "data.dataset_probs",
        "eval.dataset", "data.dataset_split", "eval.split", "data.max_samples", "data.prompt_key",
        "data.chosen_key", "data.rejected_key", "data.input_template", "data.apply_chat_template",
        "data.tokenizer_chat_template", "data.max_len", "logger.wandb.key", "logger.wandb.org",
        "logger.wandb.group", "logger.wandb.project", "logger.wandb.run_name",
        "logger.tensorboard_dir", "use_ms",
    ),
    "train_dpo": (
        "ckpt.output_dir", "ckpt.save_steps", "ckpt.save_hf", "ckpt.disable_ds",
        "logger.logging_steps", "eval.steps", "ckpt.path", "ckpt.max_num", "ckpt.max_mem",
        "ds.use_universal_ckpt", "train.micro_batch_size", "train.batch_size", "ckpt.load_enable",
        "model.gradient_checkpointing_enable", "ds.deepcompile", "train.seed",
        "train.full_determinism_enable", "data.disable_fast_tokenizer",
        "data.dataloader_num_workers", "local_rank", "ds.zero_stage", "ds.param_dtype",
        "ref.offload", "ds.zpg", "ds.adam_offload", "ds.attn_implementation",
        "ds.experts_implementation", "ds.use_liger_kernel", "ds.grad_accum_dtype",
        "ds.overlap_comm", "model.gradient_checkpointing_reentrant", "ds.tensor_parallel_size",
        "train.max_epochs", "model.beta", "model.ipo_enable", "model.label_smoothing",
        "model.aux_loss_coef", "model.nll_loss_coef", "optim", "muon.lr", "muon.momentum",
        "muon.ns_steps", "muon.nesterov", "muon.no_nesterov", "adam.lr", "adam.betas", "adam.eps",
        "adam.weight_decay", "lr_scheduler", "lr_warmup_ratio", "min_lr_ratio", "max_norm",
        "ds.ring_attn_size", "ds.ring_attn_head_stride", "ds.load_in_4bit", "ds.lora.rank",
        "ds.lora.alpha", "ds.lora.target_modules", "ds.lora.dropout", "ds.packing_samples",
        "model.model_name_or_path", "ref.model_name_or_path", "data.dataset", "data.dataset_probs",
        "eval.dataset", "data.dataset_split", "eval.split", "data.max_samples", "data.prompt_key",
        "data.chosen_key", "data.rejected_key", "data.input_template", "data.apply_chat_template",
        "data.tokenizer_chat_template", "data.max_len", "logger.wandb.key", "logger.wandb.org",
        "logger.wandb.group", "logger.wandb.project", "logger.wandb.run_name",
        "logger.tensorboard_dir", "use_ms",
    ),
    "train_ppo_ray": (
        "ref.num_nodes", "ref.num_gpus_per_node", "reward.num_nodes", "reward.num_gpus_per_node",
        "train.colocate_actor_ref", "actor.num_nodes", "actor.num_gpus_per_node",
        "critic.num_nodes", "critic.num_gpus_per_node", "train.colocate_critic_reward",
        "train.colocate_all", "vllm.num_engines", "vllm.tensor_parallel_size", "vllm.sync_backend",
        "vllm.sync_with_ray", "vllm.enable_prefix_caching", "vllm.enforce_eager",
        "vllm.enable_sleep", "vllm.gpu_memory_utilization", "algo.advantage.is_correction_enable",
        "algo.advantage.is_correction_threshold", "algo.advantage.is_correction_type",
        "train.async_enable", "train.async_queue_size", "train.partial_rollout_enable",
        "eval.steps", "ckpt.save_steps", "logger.logging_steps", "ckpt.path", "ckpt.save_hf",
        "ckpt.disable_ds", "ckpt.max_num", "ckpt.max_mem", "ckpt.load_enable",
        "ckpt.best_metric_key", "ds.use_universal_ckpt", "local_rank", "ds.zero_stage",
        "actor.gradient_checkpointing_enable", "ds.deepcompile", "ds.param_dtype",
        "train.enable_ema", "train.ema_beta", "ds.zpg", "ds.adam_offload", "ds.attn_implementation",
        "ds.experts_implementation", "ds.use_liger_kernel", "ds.grad_accum_dtype",
        "ds.overlap_comm", "actor.gradient_checkpointing_reentrant", "data.disable_fast_tokenizer",
        "data.dataloader_num_workers", "ds.enable_sleep", "ds.tensor_parallel_size",
        "ds.packing_samples", "train.dynamic_batch_enable", "rollout.max_tokens_per_gpu",
        "train.max_tokens_per_gpu", "ds.load_in_4bit", "ds.lora.rank", "ds.lora.alpha",
        "ds.lora.target_modules", "ds.lora.dropout", "ckpt.output_dir", "train.num_episodes",
        "rollout.batch_size", "rollout.vllm_generate_batch_size", "rollout.micro_batch_size",
        "train.max_epochs", "data.max_len", "rollout.max_new_tokens", "data.max_samples",
        "actor.eps_clip", "actor.eps_clip_low_high", "actor.dual_clip", "critic.value_clip",
        "algo.advantage.lambd", "algo.advantage.gamma", "train.micro_batch_size",
        "train.batch_size", "reward.normalize_enable", "rollout.top_p", "rollout.temperature",
        "train.seed", "train.full_determinism_enable", "critic.freezing_steps",
        "rollout.n_samples_per_prompt", "critic.save_value_network", "algo.kl.target",
        "algo.kl.horizon", "algo.kl.init_coef", "actor.policy_loss_type", "algo.kl.estimator",
        "actor.aux_loss_coef", "actor.entropy_coef", "reward.clip_range", "actor.optim",
        "actor.muon.lr", "actor.muon.momentum", "actor.muon.ns_steps", "actor.muon.nesterov",
        "actor.muon.no_nesterov", "actor.adam.lr", "actor.adam.betas", "actor.adam.eps",
        "actor.adam.weight_decay", "actor.lr_scheduler", "actor.lr_warmup_ratio",
        "actor.min_lr_ratio", "actor.max_norm", "critic.optim", "critic.muon.lr",
        "critic.muon.momentum", "critic.muon.ns_steps", "critic.muon.nesterov",
        "critic.muon.no_nesterov", "critic.adam.lr", "critic.adam.betas", "critic.adam.eps",
        "critic.adam.weight_decay", "critic.lr_scheduler", "critic.lr_warmup_ratio",
        "critic.min_lr_ratio", "critic.max_norm", "algo.advantage.estimator", "algo.kl.use_loss",
        "algo.advantage.no_std_norm", "reward.overlong_buffer_len",
        "reward.overlong_penalty_factor", "reward.stop_properly_penalty_coef", "ds.ring_attn_size",
        "ds.ring_attn_head_stride", "actor.model_name_or_path", "reward.model_name_or_path",
        "reward.remote_url", "critic.model_name_or_path", "ds.value_head_prefix", "ref.offload",
        "reward.offload", "train.agent_func_path", "data.prompt_dataset", "data.prompt_probs",
        "data.prompt_split", "eval.dataset", "eval.split", "eval.temperature",
        "eval.n_samples_per_prompt", "data.input_key", "data.label_key", "data.input_template",
        "data.apply_chat_template", "logger.wandb.key", "logger.wandb.org", "logger.wandb.group",
        "logger.wandb.project", "logger.wandb.run_name", "algo.dynamic_filtering_enable",
        "algo.dynamic_filtering_range", "data.image_key", "data.max_images_per_prompt",
        "actor.freeze_visual_encoder", "logger.tensorboard_dir", "use_ms",
    ),
}
