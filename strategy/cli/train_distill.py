"""On-policy distillation (GKD): a student learns a frozen teacher's next-token distributions on
its own samples (--lmbda of the steps) and on the dataset's completions, by a generalized JSD.

strategy distill --nproc 2 --config distill_toy --teacher_pretrain outputs/grpo/model
deepspeed --num_gpus 8 --module strategy.cli.train_distill --pretrain STUDENT_DIR \
    --teacher_pretrain TEACHER_DIR --dataset DATA --zero_stage 3 --teacher_offload --beta 1
(bash examples/run_distill.sh: a GRPO-trained toy teacher into a smaller student, against SFT
of the same student on the same budget)
"""

from strategy.cli.trainers import command_argv
from strategy.dist import run_script
from strategy.rollout.config import RolloutConfig
from strategy.trainers import DistillationTrainer, DistillConfig
from strategy.trainers.algorithms.distill import build_teacher
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(command_argv(argv, "distill"), trainer=DistillationTrainer) as run:
        distill = run.config(DistillConfig)
        trainer = run.trainer(DistillationTrainer, run.model(), distill=distill,
                              teacher=build_teacher(run, distill),
                              rollout=run.config(RolloutConfig))
        return trainer.fit()


if __name__ == "__main__":
    run_script(main)
