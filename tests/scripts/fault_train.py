"""SFT on toy data with an injected fault on one rank at one step (for the fault tests).

torchrun --nproc_per_node 2 tests/scripts/fault_train.py --fault raise --fault_rank 1 \
    --fault_step 3 [SFT flags]

``--fault kill_in_save``: the rank SIGKILLs itself inside the checkpoint save of that step, its
files written, just before it would publish them (the multi-node tests kill one "node" so).
"""

import argparse
import os
import signal

import torch

from strategy.trainers import SFTTrainer
from strategy.trainers.run import Run


class FaultySFT(SFTTrainer):
    fault, fault_rank, fault_step = "none", 1, 3

    def compute_loss(self, batch: dict):
        loss, metrics = super().compute_loss(batch)
        if self.global_step + 1 == self.fault_step and self.strategy.rank == self.fault_rank:
            if self.fault == "raise":
                raise ValueError(f"injected failure on rank {self.fault_rank}")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        on_fault_rank = self.strategy.rank == self.fault_rank
        if self.global_step + 1 >= self.fault_step and self.fault == "nan" and on_fault_rank:
            loss = loss * torch.tensor(float("nan"))  # one rank only: the others must stop too
        return loss, metrics


def kill_in_save(rank: int, fault_rank: int, fault_step: int) -> None:
    from strategy.checkpoint import save

    publish = save.publish

    def killing_publish(save_dir, staged, tag, meta, *rest):
        if rank == fault_rank and meta["global_step"] == fault_step:
            print(f"KILLED rank {rank} before publishing {tag}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return publish(save_dir, staged, tag, meta, *rest)

    save.publish = killing_publish


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="none",
                        choices=["none", "raise", "kill", "nan", "kill_in_save"])
    parser.add_argument("--fault_rank", type=int, default=1)
    parser.add_argument("--fault_step", type=int, default=3)
    with Run.from_args(argv, parser) as run:
        if run.args.fault == "kill_in_save":
            kill_in_save(run.strategy.rank, run.args.fault_rank, run.args.fault_step)
        trainer = run.trainer(FaultySFT, run.model())
        trainer.fault, trainer.fault_rank = run.args.fault, run.args.fault_rank
        trainer.fault_step = run.args.fault_step
        trainer.fit()
        run.strategy.print(f"DONE step={trainer.global_step}")


if __name__ == "__main__":
    main()
