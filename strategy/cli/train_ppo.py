"""PPO with a critic: GRPO's rollouts (one completion per prompt by default), a value model
beside the policy, and the policy pushed along GAE advantages under a KL leash (in the reward).

strategy ppo --nproc 2 --config ppo_toy --pretrain outputs/ppo/sft
deepspeed --num_gpus 8 --module strategy.cli.train_ppo --config ppo_toy \
    --pretrain MODEL_DIR --reward_pretrain RM_DIR --zero_stage 3 --save_value_network
(TRAINER=ppo GRPO_CONFIG=ppo_toy OUT=outputs/ppo bash examples/run_grpo.sh: the toy data, a
short SFT run, then this, with before/after accuracy)
"""

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.rollout.config import RolloutConfig
from strategy.trainers import PPOConfig, PPOTrainer
from strategy.trainers.algorithms.ppo import build_critic
from strategy.trainers.algorithms.preference import reference_model
from strategy.trainers.algorithms.rewards import build_rewards
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "ppo"), trainer=PPOTrainer) as run:
        model, ppo = run.model(), run.config(PPOConfig)
        reference = reference_model(run, model) if ppo.kl_coef > 0 else None  # the KL's anchor
        reward = None if ppo.agent_func_path else build_rewards(run, ppo)  # the agent's
        trainer = run.trainer(PPOTrainer, model, grpo=ppo, ref_model=reference,
                              reward=reward,
                              critic=build_critic(run, ppo),
                              answer_key=run.data.output_key,
                              packing=run.data.packing_samples,
                              rollout=run.config(RolloutConfig),
                              max_len=run.data.max_len)
        return trainer.fit()


if __name__ == "__main__":
    run_script(main)
