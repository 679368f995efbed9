"""The losses: pure formulas of logits, labels and log-probs (``formulas``), on-policy
advantages and returns (``advantages``), and the language-model forwards that produce them
(``lm``: summed next-token loss, tiled over the vocabulary, per-token log-probs).

May import: ``strategy`` below ``trainers`` and ``trainers.config`` (names of choices), nothing
else in ``trainers``.
"""

from strategy.trainers.losses.advantages import (
    ESTIMATORS,
    OUTCOME_ESTIMATORS,
    discounted_returns,
    gae,
    kl_estimate,
    length_shaped_rewards,
    outcome_advantages,
    outcome_token_rewards,
    token_moments,
    whiten,
)
from strategy.trainers.losses.formulas import (
    DPO_LOSSES,
    IGNORE,
    dpo_loss,
    dpo_losses,
    engine_is_weights,
    engine_logprob_gap,
    group_advantages,
    grpo_token_losses,
    kto_losses,
    orpo_losses,
    pairwise_losses,
    pairwise_metrics,
    response_loss,
    simpo_losses,
    value_token_losses,
)
from strategy.trainers.losses.lm import (
    forward_inputs,
    last_attended,
    padding_free,
    scored_mask,
    sequence_scores,
    shared_prompts,
    tiled_loss_sum,
    token_logps,
    token_logps_entropy,
    token_values,
)

__all__ = ["DPO_LOSSES", "ESTIMATORS", "IGNORE", "OUTCOME_ESTIMATORS", "discounted_returns",
           "dpo_loss", "dpo_losses", "engine_is_weights", "engine_logprob_gap", "forward_inputs",
           "gae", "kl_estimate",
           "length_shaped_rewards", "outcome_advantages",
           "outcome_token_rewards", "token_moments", "whiten",
           "group_advantages", "grpo_token_losses", "kto_losses", "last_attended", "orpo_losses",
           "padding_free", "pairwise_losses", "pairwise_metrics", "response_loss", "scored_mask",
           "sequence_scores", "shared_prompts",
           "simpo_losses", "tiled_loss_sum", "token_logps", "token_logps_entropy", "token_values",
           "value_token_losses"]
