"""GRPO: sample completions of each prompt, reward them, and push the policy toward the better
ones of each group, under a KL leash to the starting model.

torchrun --nproc_per_node 2 examples/train_grpo.py --config configs/grpo_toy.yaml \
    --pretrain outputs/grpo/sft
deepspeed --num_gpus 8 examples/train_grpo.py --config configs/grpo_toy.yaml \
    --pretrain MODEL_DIR --reward_fn my_rewards:score --zero_stage 3 --ref_offload
(bash examples/run_grpo.sh: the toy data, a short SFT run, then this, with before/after accuracy)
"""

from strategy.trainers import GRPOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=GRPOTrainer) as run:
        model = run.model()
        reference = run.reference(model) if run.grpo.kl_coef > 0 else None  # the KL's anchor
        trainer = run.trainer(GRPOTrainer, model, grpo=run.grpo, ref_model=reference,
                              reward=run.reward(), answer_key=run.data.output_key,
                              packing=run.data.packing_samples)
        return trainer.fit()


if __name__ == "__main__":
    main()
