"""Train a tiny model a few steps through the strategy; print one RESULT line per rank.

deepspeed --num_gpus 2 tests/scripts/launch_probe.py --zero_stage 3
torchrun --nproc_per_node 2 tests/scripts/launch_probe.py
python tests/scripts/launch_probe.py            # one process, no launcher
"""

import os

import torch

from strategy import DeepSpeedStrategy, OptimConfig, StrategyConfig, parse_configs
from strategy.internals import shm_allreduce_buffer_path
from tests.support.models import tiny_llama, token_batches


def main() -> None:
    (cfg, optim), _ = parse_configs(
        [StrategyConfig, OptimConfig],
        [
            "--micro_train_batch_size",
            "2",
            "--train_batch_size",
            "4",
            "--learning_rate",
            "1e-2",
            *os.sys.argv[1:],
        ],
    )
    s = DeepSpeedStrategy(cfg, optim)
    s.setup_distributed(timeout=120)
    model = s.from_pretrained(tiny_llama())
    opt = s.create_optimizer(model)
    engine = s.prepare((model, opt, s.create_scheduler(opt, num_training_steps=3)))
    x = token_batches(1, 2, seed=s.rank)[0]
    for _ in range(3 * s.accumulation_steps):
        loss = engine(input_ids=x, labels=x).loss
        s.backward(loss, engine)
        s.optimizer_step(engine)
    mean = s.all_reduce(loss.item())
    shm_left = os.path.exists(shm_allreduce_buffer_path(int(os.environ.get("RANK", 0))))
    print(
        f"RESULT rank={s.rank} world={s.world_size} stage={engine.zero_optimization_stage()} "
        f"loss={mean:.6f} shm_left={shm_left} threads={torch.get_num_threads()}",
        flush=True,
    )
    s.close()
    # as PyTorch asks of every script: a process group left to interpreter teardown once aborted a
    # rank after its RESULT ("terminate called without an active exception", 1 of 3 CI runs)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
