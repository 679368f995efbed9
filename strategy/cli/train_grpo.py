"""GRPO: sample completions of each prompt, reward them, and push the policy toward the better
ones of each group, under a KL leash to the starting model.

strategy grpo --nproc 2 --config grpo_toy --pretrain outputs/grpo/sft
deepspeed --num_gpus 8 --module strategy.cli.train_grpo --config grpo_toy \
    --pretrain MODEL_DIR --reward_fn my_rewards:score --zero_stage 3 --ref_offload
(bash examples/run_grpo.sh: the toy data, a short SFT run, then this, with before/after accuracy)
"""

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.rollout.config import RolloutConfig
from strategy.trainers import GRPOConfig, GRPOTrainer
from strategy.trainers.algorithms.preference import reference_model
from strategy.trainers.algorithms.rewards import build_rewards
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "grpo"), trainer=GRPOTrainer) as run:
        model, grpo = run.model(), run.config(GRPOConfig)
        reference = reference_model(run, model) if grpo.kl_coef > 0 else None  # the KL's anchor
        reward = None if grpo.agent_func_path else build_rewards(run, grpo)  # the agent's
        trainer = run.trainer(GRPOTrainer, model, grpo=grpo, ref_model=reference,
                              reward=reward,
                              answer_key=run.data.output_key,
                              packing=run.data.packing_samples,
                              rollout=run.config(RolloutConfig),
                              max_len=run.data.max_len)
        return trainer.fit()


if __name__ == "__main__":
    run_script(main)
