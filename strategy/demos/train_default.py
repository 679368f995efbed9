"""The main job: SFT a tiny LLaMA (built from configs/tiny_llama.json) to reverse strings, at 2
CPU ranks.

torchrun --nproc_per_node 2 -m strategy.demos.train_default --config default
(or: deepspeed --num_gpus 2 --module strategy.demos.train_default --config default)

Run by examples/run_default.sh, which first makes the data and afterwards reloads the export in a
fresh process. Here, after training, the in-training model answers the held-out prompts so the
reload can be checked against it.
"""

from __future__ import annotations

import json
import os

from strategy.demos.toy_task import generate
from strategy.dist import run_script
from strategy.trainers import SFTTrainer
from strategy.trainers.run import Run


def main(argv: list[str] | None = None) -> None:
    with Run.from_args(argv, trainer=SFTTrainer) as run:
        trainer = run.trainer(SFTTrainer, run.model())
        trainer.fit()
        rows = [json.loads(line) for line in open(run.data.eval_dataset)]
        trainer.model.eval()
        answers = generate(trainer.model.module, run.tokenizer, [r["input"] for r in rows],
                           synced_gpus=run.strategy.config.partitions_parameters)
        accuracy = sum(a == r["output"] for a, r in zip(answers, rows)) / len(rows)
        run.strategy.print(f"in-training model: held-out exact match {accuracy:.1%}")
        path = os.path.join(run.train.save_path, "..", "answers.jsonl")
        run.strategy.on_rank_0(write_answers, path, rows, answers)


def write_answers(path: str, rows: list[dict], answers: list[str]) -> None:
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"input": row["input"], "answer": answer}) + "\n"
                      for row, answer in zip(rows, answers))


if __name__ == "__main__":
    run_script(main)
