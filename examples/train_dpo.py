"""DPO on preference pairs against a frozen copy of the starting model.

deepspeed --num_gpus 2 examples/train_dpo.py --config configs/dpo_zero3.yaml
"""

import copy

from strategy.trainers import DPOTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> dict:
    with Run.from_args(argv, trainer=DPOTrainer) as run:
        model = run.model()
        source = run.model_cfg.ref_pretrain or run.model_cfg.pretrain
        reference = (run.strategy.from_pretrained(source, frozen=True) if source
                     else _copy_of(run, model))
        trainer = run.trainer(DPOTrainer, model, ref_model=reference, dpo=run.dpo)
        return trainer.fit()


def _copy_of(run: Run, model):
    """A from-scratch run (--model_config) has no checkpoint to reload: copy the fresh weights."""
    if run.strategy.config.zero_stage == 3 or run.lora.lora_rank:
        raise SystemExit("DPO from --model_config needs ZeRO 0-2 without LoRA; pass --pretrain "
                         "MODEL_DIR instead")
    return copy.deepcopy(model).requires_grad_(False)


if __name__ == "__main__":
    main()
