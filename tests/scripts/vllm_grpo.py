"""GRPO with ``--rollout_engine vllm`` at 2 ranks, checking the engine against the ``hf`` one after
every sync (for tests/test_vllm.py).

torchrun --nproc_per_node 2 tests/scripts/vllm_grpo.py OUT.json [GRPO flags]

After each rollout (the vLLM engine synced to the policy of that step) both engines generate the
held-out prompts greedily on the same weights: vLLM's completions, and the policy's own module's
(``EngineRollout``: ZeRO-3's partitioned forward, or the whole module below it); with
``--agent_func_path`` also whole greedy episodes on each. Rank 0 writes
OUT.json: the history, each check's completions, the final metrics and, with
``--is_correction``, each training micro-batch's loss inputs on every rank (advantages, the
trainer's and the engine's log-probs, the scored mask) for a loss computed by hand.

``VLLM_FAULT=raise:R`` or ``hang:R``: rank R's engine raises, or never returns, in its third
``generate`` (the second rollout's, after the first step's checkpoint; the fault tests). (An
engine apart from training, killed or stopped, and a killed rank: tests/test_ray.py.)
"""

import json
import os
import sys
import time

import torch
from vllm.distributed import get_tensor_model_parallel_world_size

from strategy.rollout import EngineRollout
from strategy.rollout.config import RolloutConfig
from strategy.trainers import GRPOConfig, GRPOTrainer
from strategy.trainers.algorithms.completions import generate_completions
from strategy.trainers.algorithms.preference import reference_model
from strategy.trainers.algorithms.rewards import build_rewards
from strategy.trainers.losses import scored_mask
from strategy.trainers.run import Run


class CheckedGRPO(GRPOTrainer):
    """GRPO that generates the held-out prompts greedily with both engines after each rollout."""

    checks: list[dict]

    def rollout(self, batch: dict):
        out = super().rollout(batch)  # synced the vLLM engine to this step's policy
        held = next(iter(self.eval_dataloader))
        ids, mask = held["prompt_ids"].to(self.model.device), held["prompt_mask"]
        settings = dict(max_new_tokens=self.grpo.max_new_tokens, do_sample=False,
                        eos_token_id=self.tokenizer.eos_token_id,
                        pad_token_id=self.tokenizer.pad_token_id)
        hf = EngineRollout(self.model, self.strategy.config.zero_stage == 3)
        got = {name: self._completions(generate_completions(engine, ids, mask.to(ids.device),
                                                            settings).cpu())
               for name, engine in (("vllm", self.rollouts), ("hf", hf))}
        if self.episodes is not None:  # --agent_func_path: whole greedy episodes on each engine
            for name, engine in (("vllm", self.rollouts), ("hf", hf)):
                kept, self.rollouts = self.rollouts, engine
                try:
                    played = self.play(held, sample=False, group=1).episodes
                finally:
                    self.rollouts = kept
                got[f"episodes_{name}"] = [[e.tokens, e.model] for e in played]
        self.checks.append({"step": self.global_step, **got})
        return out

    def compute_loss(self, batch: dict):
        out = super().compute_loss(batch)
        if self.model.training and self.rollout_config.is_correction is not None:
            self.loss_inputs.append({
                "step": self.global_step, "advantages": batch["advantages"].tolist(),
                "trainer": self._old_logps[batch["rollout_index"]].tolist(),
                "engine": batch["engine_logp"].tolist(),
                "mask": self.trained_mask(batch, scored_mask(batch)).tolist()})
        return out


def inject(rollouts, rank: int) -> None:
    """``VLLM_FAULT``'s fault, on its rank's engine."""
    kind, _, where = os.environ.get("VLLM_FAULT", "").partition(":")
    if not kind or int(where) != rank:
        return
    owner, name = rollouts.llm, "enqueue"  # once per generation
    real, calls = getattr(owner, name), []

    def enqueue(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 and kind == "raise":
            raise RuntimeError("injected engine failure")
        if len(calls) == 3:
            time.sleep(3600)
        return real(*args, **kwargs)

    setattr(owner, name, enqueue)


def main() -> None:
    out_path, argv = sys.argv[1], sys.argv[2:]
    with Run.from_args(argv, trainer=CheckedGRPO) as run:
        model, grpo = run.model(), run.config(GRPOConfig)
        reference = reference_model(run, model) if grpo.kl_coef > 0 else None
        reward = None if grpo.agent_func_path else build_rewards(run, grpo)
        trainer = run.trainer(CheckedGRPO, model, grpo=grpo, ref_model=reference, reward=reward,
                              rollout=run.config(RolloutConfig), max_len=run.data.max_len)
        trainer.checks, trainer.loss_inputs = [], []
        inject(trainer.rollouts, run.strategy.rank)
        final = trainer.fit()
        loss_inputs = [[]] * run.strategy.world_size  # every rank's, for rank 0 to write
        if trainer.rollout_config.is_correction is not None:
            torch.distributed.all_gather_object(loss_inputs, trainer.loss_inputs)
        if run.strategy.rank == 0:
            with open(out_path, "w") as f:
                json.dump({"history": trainer.history, "final": final, "checks": trainer.checks,
                           "engine": type(trainer.rollouts).__name__,
                           "engine_ranks": get_tensor_model_parallel_world_size(),
                           "loss_inputs": [x for rank in loss_inputs for x in rank]}, f)


if __name__ == "__main__":
    main()
