"""Peers' preference losses, transcribed as pure torch functions for cross-checks.

Each function takes per-sequence log-prob tensors (shape ``(batch,)``) and returns the per-example
loss tensor, unreduced, plus whatever rewards/statistics the peer returns, computed with the
peer's own arithmetic order (so results agree with the peer to float rounding, not just
mathematically).  Only ``self.``/``.to(device)``/accelerate plumbing is dropped; nothing is
reduced unless the peer's loss function itself reduces (said per function).

Sources (read from git snapshots, not from installed packages):

* TRL, https://github.com/huggingface/trl, tag ``v1.9.0`` =
  ``35def3ee000a87f6839e66f4b7749b06274ed1b3`` (2026-07-21).  The four files used below are
  byte-identical at the newest snapshot seen (``f2cd57710ae345ea6428ae95363267fcf38a3dc8``).

  - ``trl_dpo_losses``: ``trl/trainer/dpo_trainer.py`` ``DPOTrainer._compute_loss``.  TRL v0.29+
    has no ``DPOTrainer.dpo_loss`` any more; the losses are inlined in ``_compute_loss`` and the
    sigmoid loss ignores ``label_smoothing`` (plain DPO; the cDPO smoothing is gone).  Summed
    response log-probs; ``"ipo"`` divides the *summed* log-ratio by the number of completion
    tokens inside the loss.
  - ``trl_dpo_losses_legacy``: the last ``DPOTrainer.dpo_loss``, ``trl/trainer/dpo_trainer.py``
    @ ``v0.27.0`` = ``17acd61f28140243a458d10656a2194af788ff38``.  Sigmoid has cDPO label
    smoothing; ``"ipo"`` gets per-token *averaged* log-probs (policy and reference) from
    ``concatenated_forward``, all other types summed log-probs.
  - ``trl_simpo_losses``: ``trl/experimental/cpo/cpo_trainer.py`` ``CPOTrainer.cpo_loss`` with
    ``loss_type="simpo"``.  CPO moved from ``trl/trainer/`` to ``trl.experimental.cpo`` (absent
    from ``trl/trainer`` since v0.27).  Averaged response log-probs (``average_log_prob=True`` for
    ``"ipo"`` and ``"simpo"``); no reference model.
  - ``trl_orpo_losses``: ``trl/experimental/orpo/orpo_trainer.py``
    ``ORPOTrainer.odds_ratio_loss`` (moved to ``trl.experimental.orpo`` like CPO).  Averaged
    response log-probs; returns ``beta * logsigmoid(log_odds)``, which the trainer *subtracts*.
  - ``trl_kto_losses``: ``trl/trainer/kto_trainer.py`` ``KTOTrainer._compute_loss``.  KTO went to
    ``trl/experimental/kto`` (v0.27 - v1.5, still with a ``kto_loss`` method, same arithmetic) and
    was rewritten and promoted back to ``trl/trainer`` in v1.6; there is no ``kto_loss`` method
    any more, the loss is inlined.  Summed response log-probs.

* OpenRLHF, https://github.com/OpenRLHF/OpenRLHF.

  - ``openrlhf_dpo_losses``: ``openrlhf/models/loss.py`` ``DPOLoss.forward`` @ ``v0.11.0`` =
    ``3c3be6234e0cb353e76bb8019947db9dfe99fca7`` (= newest snapshot).  Summed response log-probs
    for both sigmoid and IPO (no length normalisation for IPO).  The peer returns
    ``losses.mean()``; we return ``losses``.
  - ``openrlhf_kto_losses``: ``openrlhf/models/loss.py`` ``KTOLoss.forward`` @ ``v0.9.5`` =
    ``c0e2ee2473cd115863630599cc3d51917d4b7c3e``.  KTO was removed from OpenRLHF in
    ``6a981c8c97310190cc4f0ed606d97072c576b072`` ("refactor: remove KTO, PRM, KD, ..."); v0.9.5
    is the last tag with it.  Summed response log-probs.  The peer returns ``losses.mean()``.

Convention differences at a glance (``c``/``r`` = chosen/rejected, ``pi``/``ref`` =
policy/reference):

* DPO margin order: TRL v1.9 ``(pi_c - ref_c) - (pi_r - ref_r)``; TRL v0.27 and OpenRLHF
  ``(pi_c - pi_r) - (ref_c - ref_r)``.  Mathematically equal, different rounding.
* IPO: TRL v1.9 divides the summed log-ratio by the completion length inside the loss; TRL v0.27
  feeds per-token averaged log-probs; OpenRLHF uses summed log-probs unnormalised.
* ``label_smoothing``: TRL v1.9 uses it only for ``"robust"`` (and ``"exo_pair"``), not for
  ``"sigmoid"``; TRL v0.27, TRL CPO/SimPO and OpenRLHF use it as cDPO smoothing in the sigmoid.
* SimPO ``gamma``: TRL's ``simpo_gamma`` is the margin in reward units (the paper's gamma):
  the code subtracts ``simpo_gamma / beta`` from the log-prob difference and then multiplies by
  ``beta``, so the argument is ``beta * (c - r) - simpo_gamma``.
* ORPO: ``losses`` are log-likelihoods (<= 0) scaled by beta; total is ``nll - losses.mean()``.
* KTO: TRL and OpenRLHF both detach the KL estimate, average it across ranks and clamp at 0; they
  differ in how the mismatched KL completions are paired (see ``trl_kto_losses`` and
  ``openrlhf_kto_losses``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

TRL_TAG = "v1.9.0"
TRL_COMMIT = "35def3ee000a87f6839e66f4b7749b06274ed1b3"
TRL_LEGACY_DPO_TAG = "v0.27.0"
TRL_LEGACY_DPO_COMMIT = "17acd61f28140243a458d10656a2194af788ff38"
OPENRLHF_TAG = "v0.11.0"
OPENRLHF_COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"
OPENRLHF_KTO_TAG = "v0.9.5"
OPENRLHF_KTO_COMMIT = "c0e2ee2473cd115863630599cc3d51917d4b7c3e"


# --------------------------------------------------------------------------------------------
# DPO
# --------------------------------------------------------------------------------------------


def trl_dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
    *,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL ``trl/trainer/dpo_trainer.py`` ``DPOTrainer._compute_loss`` @ v1.9.0 (35def3ee).

    The ``f_divergence_type="reverse_kl"`` (default), ``ld_alpha=None``, ``use_weighting=False``
    path, for ``loss_type`` in ``"sigmoid"``, ``"ipo"``, ``"hinge"``, ``"robust"``.  Returns
    ``(per_sequence_loss, chosen_rewards, rejected_rewards)``; the rewards are what the trainer
    logs (``beta * logratio.detach()``, from the *summed* log-ratios even for IPO).

    Log-probs: ``_compute_loss`` always sums per-token log-probs over the completion
    (``per_token_logps.sum(dim=1)``, prompt tokens zeroed), for the policy and the reference.
    For ``"ipo"`` TRL then length-normalises *inside the loss*: the summed log-ratio of each
    side is divided by ``completion_mask.sum(dim=1).clamp(min=1.0)`` of that side; pass those
    token counts as ``chosen_lengths``/``rejected_lengths``.  If they are ``None`` no division
    happens (for callers that already pass per-token averaged log-probs; equal up to rounding).

    ``label_smoothing`` is used by ``"robust"`` only (TRL requires it in [0, 0.5) there);
    ``"sigmoid"`` ignores it in v1.9 (the cDPO form lives in ``trl_dpo_losses_legacy``).
    TRL defaults: ``beta=0.1``, ``label_smoothing=0.0``, ``loss_type=["sigmoid"]``,
    ``loss_weights=None`` (all 1.0).  The trainer reduces as
    ``loss = sum_k per_sequence_loss_k.mean() * loss_weight_k``.
    """
    # Get the log ratios for the chosen and rejected responses
    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected

    # f_divergence_type == "reverse_kl": standard DPO
    chosen_scores = chosen_logratios
    rejected_scores = rejected_logratios

    delta_score = chosen_scores - rejected_scores

    if loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(beta * delta_score)

    elif loss_type == "hinge":
        per_sequence_loss = torch.relu(1 - beta * delta_score)

    elif loss_type == "ipo":
        # TRL: chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        #      chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
        if chosen_lengths is not None:
            chosen_avg_score = chosen_scores / chosen_lengths.clamp(min=1.0)
        else:
            chosen_avg_score = chosen_scores
        if rejected_lengths is not None:
            rejected_avg_score = rejected_scores / rejected_lengths.clamp(min=1.0)
        else:
            rejected_avg_score = rejected_scores
        ipo_delta = chosen_avg_score - rejected_avg_score
        # (Eq. 17) of the paper where beta is the regularization parameter for the IPO loss (tau).
        per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2

    elif loss_type == "robust":
        clean_loss_term = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
        flipped_loss_term = -label_smoothing * F.logsigmoid(-beta * delta_score)
        per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)

    else:
        raise ValueError(f"transcribed loss types: sigmoid, hinge, ipo, robust; got {loss_type!r}")

    # Rewards for chosen and rejected completions (logged by the trainer)
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return per_sequence_loss, chosen_rewards, rejected_rewards


def trl_dpo_losses_legacy(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL ``trl/trainer/dpo_trainer.py`` ``DPOTrainer.dpo_loss`` @ v0.27.0 (17acd61f).

    The last release with a ``dpo_loss`` method (removed by v0.29).  ``reference_free=False``,
    ``f_divergence_type`` reverse KL.  Returns ``(losses, chosen_rewards, rejected_rewards)``.

    Log-probs: ``concatenated_forward`` sums per-token log-probs over the completion, except
    that when ``"ipo"`` is among the loss types it divides them by the completion token count
    (``all_logps = all_logps / loss_mask.sum(-1)``) -- for the reference model too, since
    ``compute_ref_log_probs`` goes through the same ``concatenated_forward``.  So for ``"ipo"``
    pass per-token *averaged* log-probs; for the others summed ones.

    ``"sigmoid"`` is cDPO: ``-logsigmoid(b z)(1-ls) - logsigmoid(-b z) ls``; ``"hinge"`` and
    ``"ipo"`` ignore ``label_smoothing``.  Defaults ``beta=0.1``, ``label_smoothing=0.0``.  The
    trainer combines ``losses = sum_k losses_k * weight_k`` and then takes ``losses.mean()``.
    """
    logratios = policy_chosen - policy_rejected
    ref_logratios = ref_chosen - ref_rejected
    logits = logratios - ref_logratios

    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )

    elif loss_type == "robust":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            + F.logsigmoid(-beta * logits) * label_smoothing
        ) / (1 - 2 * label_smoothing)

    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)

    elif loss_type == "ipo":
        # eqn (17) of the paper where beta is the regularization parameter for the IPO loss (tau).
        losses = (logits - 1 / (2 * beta)) ** 2

    else:
        raise ValueError(f"transcribed loss types: sigmoid, robust, hinge, ipo; got {loss_type!r}")

    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()

    return losses, chosen_rewards, rejected_rewards


def openrlhf_dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    ipo: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OpenRLHF ``openrlhf/models/loss.py`` ``DPOLoss.forward`` @ v0.11.0 (3c3be623).

    Returns ``(losses, chosen_rewards, rejected_rewards)`` where the peer returns
    ``(losses.mean(), chosen_rewards, rejected_rewards)``.

    Log-probs: ``openrlhf/trainer/dpo_trainer.py`` ``concatenated_forward`` feeds the *summed*
    response log-probs (``_get_batch_logps`` -> ``logprobs_sums``; prompt masked by
    ``prompt_id_lens``) to the loss for both sigmoid and IPO: IPO is not length-normalised.
    The per-token mean is used only for the optional NLL term, ``-logps_mean[chosen].mean()``
    (mean over examples of each chosen response's token-mean log-prob), added as
    ``loss = preference_loss + aux_loss * aux_loss_coef + nll_loss * nll_loss_coef``.
    CLI defaults (``openrlhf/cli/train_dpo.py``): ``--model.beta 0.1``,
    ``--model.label_smoothing 0.0``, ``--model.ipo_enable False``, ``--model.nll_loss_coef 0``.
    """
    pi_logratios = policy_chosen - policy_rejected
    ref_logratios = ref_chosen - ref_rejected
    logits = pi_logratios - ref_logratios

    if ipo:
        losses = (logits - 1 / (2 * beta)) ** 2  # Eq. 17 of https://arxiv.org/pdf/2310.12036v2.pdf
    else:
        # Eq. 3 https://ericmitchell.ai/cdpo.pdf; label_smoothing=0 gives original DPO
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )

    # peer: loss = losses.mean()
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()

    return losses, chosen_rewards, rejected_rewards


# --------------------------------------------------------------------------------------------
# SimPO (TRL CPOTrainer, loss_type="simpo")
# --------------------------------------------------------------------------------------------


def trl_simpo_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    *,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL ``trl/experimental/cpo/cpo_trainer.py`` ``CPOTrainer.cpo_loss`` @ v1.9.0 (35def3ee).

    ``loss_type="simpo"``; ``gamma`` is ``CPOConfig.simpo_gamma``, ``alpha`` is the AlphaPO
    ``CPOConfig.alpha`` (0 = plain SimPO).  Returns ``(losses, chosen_rewards,
    rejected_rewards)``.  CPO lives in ``trl.experimental.cpo`` (not in ``trl/trainer``).

    Log-probs: ``concatenated_forward`` calls ``get_batch_logps(...,
    average_log_prob=self.loss_type in ["ipo", "simpo"])``, so SimPO gets per-token *averaged*
    response log-probs, ``(logp * mask).sum(-1) / mask.sum(-1)`` over label tokens != -100.
    No reference model.

    gamma semantics: the code subtracts ``gamma_logratios = simpo_gamma / beta`` from
    ``c - r`` and then scales by ``beta``, so the sigmoid argument is
    ``beta * (c - r - simpo_gamma / beta)`` = ``beta * (c - r) - simpo_gamma``: ``simpo_gamma``
    is the paper's target margin gamma in reward units; the SimPO repo's
    ``gamma_beta_ratio`` corresponds to ``simpo_gamma / beta``.

    Defaults: ``beta=0.1``, ``simpo_gamma=0.5``, ``label_smoothing=0.0``, ``alpha=0.0``, and
    ``cpo_alpha=1.0`` -- the trainer's total is ``losses.mean() + cpo_alpha * nll_loss`` (NLL
    = token-mean cross entropy over the chosen labels), so pure SimPO needs ``cpo_alpha=0.0``
    (``loss_type="alphapo"`` is sugar for ``simpo`` with ``cpo_alpha=0``).  TRL's docs
    recommend SimPO with ``cpo_alpha=0.0``.
    """
    # Apply AlphaPO reward transformation if alpha != 0
    if alpha != 0.0:
        chosen_probs = torch.exp(chosen_logps)
        rejected_probs = torch.exp(rejected_logps)
        # AlphaPO transformation: r = (1 - p^(-alpha)) / alpha
        policy_chosen_rewards = (1 - chosen_probs.pow(-alpha)) / alpha
        policy_rejected_rewards = (1 - rejected_probs.pow(-alpha)) / alpha
        logits = policy_chosen_rewards - policy_rejected_rewards
    else:
        logits = chosen_logps - rejected_logps

    # loss_type == "simpo"
    gamma_logratios = gamma / beta
    logits = logits - gamma_logratios
    # This reduces to Equation 3 from the CPO paper when label_smoothing -> 0.
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing)
        - F.logsigmoid(-beta * logits) * label_smoothing
    )

    if alpha != 0.0:
        chosen_rewards = beta * policy_chosen_rewards.detach()
        rejected_rewards = beta * policy_rejected_rewards.detach()
    else:
        chosen_rewards = beta * chosen_logps.detach()
        rejected_rewards = beta * rejected_logps.detach()

    return losses, chosen_rewards, rejected_rewards


# --------------------------------------------------------------------------------------------
# ORPO
# --------------------------------------------------------------------------------------------


def _trl_log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log1mexp`` from ``trl/experimental/orpo/orpo_trainer.py`` @ v1.9.0: log(1 - exp(x))."""
    # branch at -ln 2 ~ -0.693 to avoid cancellation
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def trl_orpo_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL ``trl/experimental/orpo/orpo_trainer.py`` ``ORPOTrainer.odds_ratio_loss`` @ v1.9.0.

    Commit 35def3ee.  ORPO lives in ``trl.experimental.orpo`` (not in ``trl/trainer``).
    Returns ``(losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen)`` as
    the peer does, where ``losses = beta * logsigmoid(log_odds)`` (<= 0, one per pair),
    ``log_odds_ratio = mean(logsigmoid(log_odds))`` and ``log_odds_chosen = mean(log_odds)``
    (scalars, for logging), rewards ``beta * logps.detach()``.  Inputs are cast to float32.
    ``log_odds = (c - r) - (log1mexp(c) - log1mexp(r))`` with a branch-stable ``log1mexp``
    (TRL <= v0.25 used ``torch.log1p(-torch.exp(.))`` instead).

    Log-probs: ``concatenated_forward`` uses ``get_batch_logps(..., average_log_prob=True)``:
    per-token *averaged* response log-probs (label tokens != -100, prompt masked).

    Total loss (``get_batch_loss_metrics``): ``loss = policy_nll_loss - losses.mean()``, i.e.
    ``NLL + beta * mean(-logsigmoid(log_odds))`` (see ``trl_orpo_total_loss``).
    ``policy_nll_loss`` is ``nn.CrossEntropyLoss()`` (token mean over the whole chosen batch)
    of the chosen sequences on labels = ``input_ids`` where ``attention_mask == 1`` -- prompt
    tokens included ("orpo chosen nll loss is computed over the full prompt and response") for
    decoder-only models.  Default ``beta=0.1`` (the paper's lambda).
    """
    policy_chosen_logps = chosen_logps.float()
    policy_rejected_logps = rejected_logps.float()
    log_odds = (policy_chosen_logps - policy_rejected_logps) - (
        _trl_log1mexp(policy_chosen_logps) - _trl_log1mexp(policy_rejected_logps)
    )
    ratio = F.logsigmoid(log_odds)
    losses = beta * ratio

    chosen_rewards = beta * policy_chosen_logps.detach()
    rejected_rewards = beta * policy_rejected_logps.detach()

    return losses, chosen_rewards, rejected_rewards, torch.mean(ratio), torch.mean(log_odds)


def trl_orpo_total_loss(policy_nll_loss: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """TRL ORPO total: ``loss = policy_nll_loss - losses.mean()`` (``get_batch_loss_metrics``)."""
    return policy_nll_loss - losses.mean()


# --------------------------------------------------------------------------------------------
# KTO
# --------------------------------------------------------------------------------------------


def trl_kto_kl(
    policy_kl: torch.Tensor | Sequence[torch.Tensor],
    ref_kl: torch.Tensor | Sequence[torch.Tensor],
) -> torch.Tensor:
    """TRL v1.9.0 KTO KL estimate; a sequence of tensors stands for one tensor per rank.

    ``kl = (KL_logps - ref_KL_logps).mean().detach()`` per rank, then
    ``accelerator.gather_for_metrics(kl).mean().clamp(min=0)``: the mean over ranks of the
    per-rank means (each rank weighs equally, whatever its batch size), clamped at 0.
    """
    if isinstance(policy_kl, torch.Tensor):
        policy_kl, ref_kl = [policy_kl], [ref_kl]
    per_rank = [(p - r).mean().detach() for p, r in zip(policy_kl, ref_kl, strict=True)]
    gathered = per_rank[0] if len(per_rank) == 1 else torch.stack(per_rank)
    return gathered.mean().clamp(min=0)


def trl_kto_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    policy_kl: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    ref_kl: torch.Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    *,
    kl: torch.Tensor | None = None,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL ``trl/trainer/kto_trainer.py`` ``KTOTrainer._compute_loss`` @ v1.9.0 (35def3ee).

    Returns ``(losses, chosen_rewards, rejected_rewards, kl)``; ``losses`` is
    ``cat(desirable_weight * chosen_losses, undesirable_weight * rejected_losses)`` -- all
    chosen first, then all rejected, not batch order.  The trainer's loss is
    ``losses.nanmean()`` (a plain mean over the weighted per-example losses of the micro-batch;
    the weights do not enter the denominator).  Same arithmetic as ``kto_loss`` in
    ``trl/experimental/kto/kto_trainer.py`` @ v1.5.0 (bd1e73f0) and in ``trl/trainer`` <= v0.25.

    Log-probs: summed over completion tokens (``per_token_logps.sum(-1)``, prompt zeroed) for
    matched and KL sequences, policy and reference.  The policy KL log-probs are computed with
    grad but the KL is detached.

    KL estimate: single process ``kl = (policy_kl - ref_kl).mean().detach().clamp(min=0)``;
    with several ranks each rank's mean is gathered (``gather_for_metrics``) and averaged, then
    clamped (``trl_kto_kl`` with one tensor per rank; pass its result as ``kl=``).  The KL
    batch has one mismatched sequence per example (chosen and rejected alike).
    ``loss_type="apo_zero_unpaired"`` uses no KL (``kl = zeros(1)``).

    Mismatched KL completions (``_prepare_dataset``): ``dataset.map(add_kl_completion_ids,
    batched=True, batch_size=per_device_train_batch_size)`` with
    ``KL_completion_ids = [completion_ids[-1]] + completion_ids[:-1]``: within each consecutive
    chunk of ``per_device_train_batch_size`` examples, example i is paired with completion i-1
    (first with last): (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}).  This needs
    ``train_sampling_strategy="sequential"`` (KTOConfig default; other values raise) and
    ``per_device_train_batch_size > 1``.  The vision collator rotates the same way per batch.

    Defaults (``KTOConfig``): ``beta=0.1``, ``desirable_weight=1.0``,
    ``undesirable_weight=1.0``, ``loss_type="kto"``.
    """
    if kl is None:
        if loss_type == "kto":
            kl = trl_kto_kl(policy_kl, ref_kl)
        else:
            kl = torch.zeros(1)

    # Chosen losses
    if policy_chosen.shape[0] != 0 or ref_chosen.shape[0] != 0:
        chosen_logratios = policy_chosen - ref_chosen
        if loss_type == "kto":
            # Eqn (7) of the KTO paper (https://huggingface.co/papers/2402.01306)
            chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
        elif loss_type == "apo_zero_unpaired":
            chosen_losses = 1 - F.sigmoid(beta * chosen_logratios)
        else:
            raise ValueError(f"unknown KTO loss_type {loss_type!r}")
        chosen_rewards = beta * chosen_logratios.detach()
    else:
        chosen_losses = torch.Tensor([])
        chosen_rewards = torch.Tensor([])

    # Rejected losses
    if policy_rejected.shape[0] != 0 or ref_rejected.shape[0] != 0:
        rejected_logratios = policy_rejected - ref_rejected
        if loss_type == "kto":
            rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
        elif loss_type == "apo_zero_unpaired":
            rejected_losses = F.sigmoid(beta * rejected_logratios)
        else:
            raise ValueError(f"unknown KTO loss_type {loss_type!r}")
        rejected_rewards = beta * rejected_logratios.detach()
    else:
        rejected_losses = torch.Tensor([])
        rejected_rewards = torch.Tensor([])

    losses = torch.cat(
        (desirable_weight * chosen_losses, undesirable_weight * rejected_losses),
        0,
    )
    return losses, chosen_rewards, rejected_rewards, kl


def openrlhf_kto_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    policy_kl: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    ref_kl: torch.Tensor,
    beta: float = 0.01,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    *,
    kl_sum_over_ranks: torch.Tensor | None = None,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """OpenRLHF ``openrlhf/models/loss.py`` ``KTOLoss.forward`` @ v0.9.5 (c0e2ee24).

    KTO was removed from OpenRLHF in 6a981c8c; v0.9.5 is the last tag that has it.  (The same
    file also had ``VanillaKTOLoss``, unused by the trainer.)  Returns ``(losses,
    chosen_rewards, rejected_rewards, KL)`` where the peer returns ``losses.mean()`` in place of
    ``losses``: ``cat(desirable_weight * chosen_losses, undesirable_weight * rejected_losses)
    .mean()`` -- a plain mean, weights not in the denominator, chosen first.

    KL estimate: ``KL = (policy_KL_logps - reference_KL_logps).mean().detach()``, then
    ``dist.all_reduce(KL, SUM)`` and ``KL = (KL / world_size).clamp(min=0)``.  Single process:
    all_reduce is the identity.  For several ranks pass the all-reduced sum of per-rank means
    as ``kl_sum_over_ranks`` and ``world_size``.

    Log-probs (``openrlhf/trainer/kto_trainer.py`` ``_get_batch_logps(average_log_prob=False)``):
    summed over response tokens (prompt masked by ``prompt_id_lens``).  Each micro-batch is
    ``[matched (x_i, y_i) for i in batch] + [mismatched (x_i, y_{(i+1) % n}) for i in batch]``,
    built in ``UnpairedPreferenceDataset.collate_fn`` (``openrlhf/datasets/
    unpaired_preference_dataset.py``): prompt i with the *next* example's response (last with
    first) -- the opposite rotation to TRL.  The front half gives chosen/rejected logps by
    label, the back half the KL logps.  Trainer total: ``kto_loss + aux_loss * aux_loss_coef``.
    CLI defaults (``openrlhf/cli/train_kto.py``): ``--beta 0.01``,
    ``--desirable_loss_weight 1.0``, ``--undesirable_loss_weight 1.0``.
    """
    if kl_sum_over_ranks is None:
        KL = (policy_kl - ref_kl).mean().detach()
        # dist.all_reduce(KL, op=dist.ReduceOp.SUM): identity on a single process
    else:
        KL = kl_sum_over_ranks.detach()
    # take average (will also scale gradients appropriately)
    KL = (KL / world_size).clamp(min=0)

    if policy_chosen.shape[0] != 0:
        chosen_logratios = policy_chosen - ref_chosen
        chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - KL))
        chosen_rewards = beta * chosen_logratios.detach()
    else:
        # important to cast to policy_dtype; otherwise error will occur during all_gather
        chosen_losses = torch.Tensor([]).to(policy_rejected.dtype)
        chosen_rewards = torch.Tensor([]).to(policy_rejected.dtype)

    if policy_rejected.shape[0] != 0:
        rejected_logratios = policy_rejected - ref_rejected
        rejected_losses = 1 - F.sigmoid(beta * (KL - rejected_logratios))
        rejected_rewards = beta * rejected_logratios.detach()
    else:
        rejected_losses = torch.Tensor([]).to(policy_chosen.dtype)
        rejected_rewards = torch.Tensor([]).to(policy_chosen.dtype)

    # peer: losses = torch.cat(...).mean()
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses, chosen_rewards, rejected_rewards, KL
