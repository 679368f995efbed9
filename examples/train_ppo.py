"""PPO with a critic: sample completions, reward them, value each token with a critic trained
beside the policy, and push the policy along GAE advantages under a KL leash (in the reward).

torchrun --nproc_per_node 2 examples/train_ppo.py --config configs/ppo_toy.yaml \
    --pretrain outputs/ppo/sft
deepspeed --num_gpus 8 examples/train_ppo.py --config configs/ppo_toy.yaml \
    --pretrain MODEL_DIR --reward_pretrain RM_DIR --zero_stage 3 --save_value_network
(TRAINER=ppo GRPO_CONFIG=configs/ppo_toy.yaml OUT=outputs/ppo bash examples/run_grpo.sh: the toy
data, a short SFT run, then this, with before/after accuracy)
"""

from strategy.trainers import PPOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=PPOTrainer) as run:
        model = run.model()
        reference = run.reference(model) if run.grpo.kl_coef > 0 else None  # the KL's anchor
        trainer = run.trainer(PPOTrainer, model, grpo=run.grpo, ref_model=reference,
                              reward=run.reward(), critic=run.critic(),
                              answer_key=run.data.output_key,
                              packing=run.data.packing_samples)
        return trainer.fit()


if __name__ == "__main__":
    main()
