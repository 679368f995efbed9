"""The main job: SFT a tiny LLaMA (built from configs/tiny_llama.json) to reverse strings, at 2 CPU ranks.

deepspeed --num_gpus 2 examples/train_default.py --config configs/default.yaml

Run by examples/run_default.sh, which first makes the data and afterwards reloads the export in a
fresh process. Here, after training, the in-training model answers the held-out prompts so the
reload can be checked against it.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from toy_task import generate  # noqa: E402

from strategy.trainers import SFTTrainer  # noqa: E402
from strategy.trainers.recipe import Run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    run = Run.from_args(argv)
    trainer = run.trainer(SFTTrainer, run.model())
    trainer.fit()

    rows = [json.loads(line) for line in open(run.data.eval_dataset)]
    trainer.model.eval()
    answers = generate(trainer.model.module, run.tokenizer, [r["input"] for r in rows],
                       synced_gpus=run.strategy.config.zero_stage == 3)
    acc = sum(a == r["output"] for a, r in zip(answers, rows)) / len(rows)
    run.strategy.print(f"in-training model: held-out exact match {acc:.1%}")
    if run.strategy.is_rank_0:
        with open(os.path.join(run.train.save_path, "..", "answers.jsonl"), "w") as fh:
            fh.writelines(json.dumps({"input": r["input"], "answer": a}) + "\n" for r, a in zip(rows, answers))
    run.strategy.close()


if __name__ == "__main__":
    main()
