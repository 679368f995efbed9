"""Language-model forwards the trainers share: next-token targets with or without sequence
parallelism, the summed loss (plain, or tiled so the [tokens, vocab] logits never exist at once),
per-token log-probabilities, and a reward model's score of each sequence.

A reward model scores one position: the last attended token of each row (the EOS that ends
prompt + response; left or right padding alike), or each packed sample's own last token. Never
"the last token that is not ``pad_token_id``", which is the token before EOS when pad == eos.

A sequence-parallel slice carries ``shift_labels`` (labels already shifted, aligned with its own
positions); a plain batch carries ``labels`` (the model shifts them). Tiled: the backbone's hidden
states go through the output layer a chunk of tokens at a time under activation checkpointing, so
forward and backward each hold one chunk's logits. Every rank runs the same number of chunks (one
max over ranks per micro-batch): under ZeRO-3 each call of the output layer gathers its weight,
and ranks must gather alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from strategy.internals import begin_submodule_forward, with_cache
from strategy.model import base_model
from strategy.trainers.losses.formulas import IGNORE

TILE_VOCAB = 65536  # automatic tiling from this vocabulary size up (--tiled_logits_loss unset)
FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids")


def forward_inputs(batch: dict) -> dict:
    """What the model's forward takes from a batch (no cache: packed rows need none)."""
    return {key: batch[key] for key in FORWARD_KEYS if key in batch} | {"use_cache": False}


def targets_of(batch: dict) -> tuple[torch.Tensor, bool]:
    """(next-token targets, already aligned with every position) for a batch."""
    if "shift_labels" in batch:
        return batch["shift_labels"], True
    return batch["labels"][:, 1:], False


def at_targets(per_position: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_position`` (rows x positions x ...) cut to the positions that predict a target, and
    those targets."""
    targets, aligned = targets_of(batch)
    return (per_position if aligned else per_position[:, :-1]), targets


def scored_mask(batch: dict) -> torch.Tensor:
    """Which positions of ``at_targets`` are scored (their target is not ``IGNORE``)."""
    return targets_of(batch)[0] != IGNORE


def logits_bytes(rows: int, length: int, vocab: int) -> int:
    """The fp32 logits a plain forward would hold."""
    return rows * length * vocab * 4


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")


def tiled_loss_sum(engine, batch: dict, chunk_tokens: int, max_tokens: int) -> torch.Tensor:
    """Summed next-token cross-entropy, ``chunk_tokens`` positions of logits at a time;
    ``max_tokens`` (the most any rank has) fixes how many chunks every rank runs."""
    model = base_model(engine.module)
    backbone = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    begin_submodule_forward(engine)  # the engine's forward is skipped: its ZeRO bookkeeping not
    hidden, targets = at_targets(backbone(**forward_inputs(batch)).last_hidden_state, batch)
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for index in range(math.ceil(max_tokens / chunk_tokens)):
        window = slice(index * chunk_tokens, (index + 1) * chunk_tokens)
        part, goal = hidden[window], targets[window]
        if part.shape[0] == 0:  # past this rank's end: an empty call keeps the ranks in step
            part, goal = hidden[:1] * 0, torch.full_like(targets[:1], IGNORE)
        total = total + checkpoint(_chunk_loss, part, goal, head, use_reentrant=False)
    return total


def padding_free(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    """The keys that make ``token_logps`` and ``token_values`` forward a padded batch without its
    padding: every row's tokens back to back in one packed row whose positions restart at 0 for
    each row (``packed_input_ids``, ``packed_position_ids``: 1 x tokens), and where each padded
    position sits in it (``pack_index``: rows x width, -1 on padding). The outputs come back in
    the padded layout, so everything downstream reads them as it reads a padded forward's.

    Args:
        input_ids: padded rows (either side).
        attention_mask: their mask.

    Returns:
        The three tensors, to add to the batch beside ``input_ids``, ``labels``, ...
    """
    real = attention_mask.bool()
    index = torch.full_like(input_ids, -1)
    index[real] = torch.arange(int(real.sum()), device=input_ids.device)
    positions = (real.long().cumsum(-1) - 1)[real]
    return {"packed_input_ids": input_ids[real][None], "packed_position_ids": positions[None],
            "pack_index": index}


def shared_prompts(prompts: list[list[int]], completions: list[list[int]], pad: int) -> dict:
    """The keys that make ``token_logps`` and ``token_values`` forward each distinct prompt of a
    batch once and every completion on its prompt's KV cache, instead of prompt + completion per
    row: a GRPO group's ``G`` rows share one prompt, whose forward (and backward) then runs once
    for them, not ``G`` times. The same log-probs and gradients to float rounding (the attention
    sums over the same keys); the outputs come back in the padded layout.

    Args:
        prompts: each row's prompt tokens (no padding).
        completions: each row's completion tokens, the row's scored targets.
        pad: the id that pads (never attended).

    Returns:
        ``prefix_ids`` / ``prefix_mask`` (distinct prompts, left-padded), ``prefix_index`` (each
        row's prompt among them), ``suffix_ids`` / ``suffix_mask`` / ``suffix_position_ids``
        (the completions, right-padded, their positions after their prompt's); empty when no
        prompt repeats (nothing to share) or one is empty.
    """
    index: dict[tuple[int, ...], int] = {}
    inverse = [index.setdefault(tuple(p), len(index)) for p in prompts]
    if len(index) == len(prompts) or not all(prompts):
        return {}
    width, long = max(map(len, index)), max(1, *map(len, completions))
    starts = torch.tensor([len(p) for p in prompts])
    return {"prefix_ids": torch.tensor([[pad] * (width - len(p)) + list(p) for p in index]),
            "prefix_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in index]),
            "prefix_index": torch.tensor(inverse),
            "suffix_ids": torch.tensor([c + [pad] * (long - len(c)) for c in completions]),
            "suffix_mask": torch.tensor([[1] * len(c) + [0] * (long - len(c))
                                         for c in completions]),
            "suffix_position_ids": starts[:, None] + torch.arange(long)}


def _plain_cache(model) -> DynamicCache | None:
    """A dynamic cache of full-attention layers for ``model``, or None where its cache is another
    kind (sliding windows, linear attention: the shared forward would not see what a per-row one
    sees)."""
    if not getattr(model, "_supports_default_dynamic_cache", lambda: True)():
        return None
    cache = DynamicCache(config=model.config)
    return cache if all(type(layer) is DynamicLayer for layer in cache.layers) else None


def _shared_cache(module, batch: dict) -> DynamicCache | None:
    """The empty cache ``shared_prompts``' path fills, or None where this forward runs per row:
    the batch lacks its keys, the model's cache is not ``_plain_cache``'s, or it is a training
    forward under gradient checkpointing (its recomputation would fill the cache twice). The
    same answer on every rank for the same model and batch layout, so ZeRO-3's per-forward
    gathers stay in step."""
    if "prefix_index" not in batch:
        return None
    model = base_model(getattr(module, "module", module))
    if torch.is_grad_enabled() and getattr(model, "is_gradient_checkpointing", False):
        return None
    return _plain_cache(model)


def _prefix_scored(module, batch: dict, read: Any,
                   cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """``shared_prompts``' forward, filling ``cache``: ``read(output)`` at the position
    predicting each scored target (the prompt's last position, then the completion's), in
    ``at_targets`` order, and the scored mask (rows x width - 1)."""
    mask = targets_of(batch)[0] != IGNORE
    model = base_model(getattr(module, "module", module))
    keep = {"logits_to_keep": 1} if getattr(model, "_supports_logits_to_keep", bool)() else {}
    prefix_mask, index = batch["prefix_mask"], batch["prefix_index"]
    positions = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 1)
    first = read(module(input_ids=batch["prefix_ids"], attention_mask=prefix_mask,
                        position_ids=positions, use_cache=True, **with_cache(cache),
                        **keep))[:, -1:]
    cache.batch_select_indices(index)  # each row's prompt keys and values (autograd follows)
    rest = read(module(input_ids=batch["suffix_ids"],
                       attention_mask=torch.cat([prefix_mask[index], batch["suffix_mask"]], 1),
                       position_ids=batch["suffix_position_ids"], use_cache=True,
                       **with_cache(cache)))
    # completion token k of a row is the target at position (its prompt's length - 1 + k);
    # an episode's feedback tokens are in the suffix but not scored
    at = (batch["suffix_position_ids"] - 1).clamp(max=mask.shape[1] - 1)
    wanted = batch["suffix_mask"].bool() & mask.gather(1, at)
    scored = torch.cat([first[index], rest[:, :-1]], 1)[wanted]
    if scored.shape[0] != int(mask.sum()):
        raise ValueError(f"shared_prompts' completions hold {scored.shape[0]} tokens, the labels "
                         f"score {int(mask.sum())}: build them from the same rows")
    return scored, mask


def _packed_scored(module, batch: dict, read: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed forward (``padding_free``'s keys): ``read(output)`` (1 x tokens x ...) at the
    position predicting each scored target, in a padded forward's ``at_targets`` order, and the
    scored mask (rows x width - 1)."""
    mask = targets_of(batch)[0] != IGNORE
    out = module(input_ids=batch["packed_input_ids"],
                 position_ids=batch["packed_position_ids"], use_cache=False)
    return read(out)[0][batch["pack_index"][:, :-1][mask]], mask


def _compact_scored(module, batch: dict, read: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A packed (``padding_free``) or prompt-shared (``shared_prompts``) forward's scored outputs
    and mask, or None where the batch is forwarded per row."""
    if "pack_index" in batch:
        return _packed_scored(module, batch, read)
    cache = _shared_cache(module, batch)
    return None if cache is None else _prefix_scored(module, batch, read, cache)


def _laid_out(mask: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``scored`` (one value per True of ``mask``) in ``mask``'s layout, zero elsewhere."""
    return torch.zeros(mask.shape, device=scored.device).masked_scatter(mask, scored.float())


def token_logps(engine, batch: dict,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-probability of each next-token target, and the mask of scored ones;
    ``temperature`` scales the logits first (the distribution a sampler drew from). A batch with
    ``padding_free``'s keys is forwarded without its padding, one with ``shared_prompts``' keys
    runs each distinct prompt once; the result is laid out alike."""
    logp, mask, _ = token_logps_entropy(engine, batch, temperature, entropy=None)
    return logp, mask


def token_logps_entropy(engine, batch: dict, temperature: float = 1.0,
                        entropy: str | None = "logged",
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``token_logps``'s log-probs and mask, and each scored position's entropy of the same
    distribution (zero elsewhere): ``entropy="trained"`` keeps its gradient (an entropy bonus),
    ``"logged"`` does not (no graph kept over the vocabulary), None skips it.

    Args:
        engine: the model (or its engine).
        batch: a batch as ``token_logps`` takes it.
        temperature: the sampler's temperature.
        entropy: ``"trained"``, ``"logged"`` or None.

    Returns:
        ``(logp, mask, entropy or None)``, rows x positions each.
    """
    scored = _compact_scored(engine, batch, lambda out: out.logits)
    if scored is not None:
        logits, mask = scored
        picked = targets_of(batch)[0][mask].unsqueeze(-1)
    else:
        logits, targets = at_targets(engine(**forward_inputs(batch)).logits, batch)
        mask = targets != IGNORE
        picked = targets.clamp(min=0).unsqueeze(-1)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = log_probs.gather(-1, picked).squeeze(-1)
    spread = None
    if entropy is not None:
        with torch.set_grad_enabled(entropy == "trained" and torch.is_grad_enabled()):
            spread = -(log_probs.exp() * log_probs).sum(-1)
    if scored is not None:  # one value per scored target: laid out as the rows
        return _laid_out(mask, logp), mask, None if spread is None else _laid_out(mask, spread)
    return logp * mask, mask, None if spread is None else spread * mask


def token_values(critic, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A value model's value (``...ForTokenClassification``, 1 label) of each state that precedes
    a scored target, aligned with ``token_logps``, and the mask of scored ones (OpenRLHF's
    critic reads the same positions). Packed or prompt-shared like ``token_logps`` when the batch
    says so."""
    scored = _compact_scored(critic, batch, lambda out: out.logits[..., 0])
    if scored is not None:
        values, mask = scored
        return _laid_out(mask, values), mask
    values, targets = at_targets(critic(**forward_inputs(batch)).logits[..., 0], batch)
    mask = targets != IGNORE
    return values.float() * mask, mask


def last_attended(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last position whose ``mask`` is 1 (right or left padding)."""
    return mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)


def sequence_scores(model, batch: dict) -> torch.Tensor:
    """A reward model's score of each row at its last attended token, or of each packed sample
    at its own last token (``last_token``: flat indices into the packed rows).

    Args:
        model: an ``AutoModelForSequenceClassification`` (1 label), bare, PEFT-wrapped or the
            ``module`` of an engine.
        batch: ``input_ids`` with an ``attention_mask``, or packed rows with ``position_ids``
            and ``last_token``.

    Returns:
        One float32 score per row (per packed sample).
    """
    model = base_model(model)
    backbone = getattr(model, model.base_model_prefix)
    states = backbone(**forward_inputs(batch)).last_hidden_state
    if "last_token" in batch:
        picked = states.reshape(-1, states.shape[-1])[batch["last_token"]]
    else:
        rows = torch.arange(states.shape[0], device=states.device)
        picked = states[rows, last_attended(batch["attention_mask"])]
    return model.score(picked)[:, 0].float()
