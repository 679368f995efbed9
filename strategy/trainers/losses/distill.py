"""Distillation's divergence: the generalized Jensen-Shannon divergence between a student's and a
teacher's next-token distributions (GKD, Agarwal et al. 2024, eq. 1; TRL's
``GKDTrainer.generalized_jsd_loss``), over the whole vocabulary, a chunk of tokens at a time.

Both backbones run once; their hidden states at the scored positions go through the output
layers ``chunk_tokens`` positions at a time, under activation checkpointing for the student (its
backward recomputes the chunk's logits, the teacher's too), so neither model's
``[tokens, vocab]`` logits ever exist whole. Every rank runs the same number of chunks (the most
tokens any rank has): under ZeRO-3 each output-layer call gathers its weight.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from strategy.internals import begin_submodule_forward
from strategy.model import base_model
from strategy.trainers.losses.formulas import IGNORE
from strategy.trainers.losses.lm import at_targets, forward_inputs


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                    beta: float) -> torch.Tensor:
    """Per position, over the last (vocabulary) dimension: ``beta`` x KL(teacher || M) +
    (1 - ``beta``) x KL(student || M), M = ``beta`` x teacher + (1 - ``beta``) x student; at
    ``beta`` 0 the forward KL(teacher || student), at 1 the reverse KL(student || teacher) (TRL's
    ends, where the mixture's terms would vanish).

    Args:
        student_logp: the student's log-probabilities, ... x vocab.
        teacher_logp: the teacher's, the same shape.
        beta: the mix, in [0, 1].

    Returns:
        The divergence per position (the shape without its last dimension).
    """
    if beta == 0:
        return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    if beta == 1:
        return (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)
    mixture = torch.logsumexp(torch.stack([student_logp + math.log(1 - beta),
                                           teacher_logp + math.log(beta)]), dim=0)
    to_teacher = (teacher_logp.exp() * (teacher_logp - mixture)).sum(-1)
    to_student = (student_logp.exp() * (student_logp - mixture)).sum(-1)
    return beta * to_teacher + (1 - beta) * to_student


def scored_hidden(engine, batch: dict) -> torch.Tensor:
    """The backbone's last hidden states at the positions that predict a scored target
    (tokens x hidden), in ``at_targets`` order."""
    model = base_model(getattr(engine, "module", engine))
    backbone = getattr(model, model.base_model_prefix)
    begin_submodule_forward(engine)  # the engine's forward is skipped: its ZeRO bookkeeping not
    hidden, targets = at_targets(backbone(**forward_inputs(batch)).last_hidden_state, batch)
    return hidden[targets != IGNORE]


def _chunk(student: torch.Tensor, teacher: torch.Tensor, student_head, teacher_head,
           beta: float, vocab: int, weight: float) -> torch.Tensor:
    student_logp = torch.log_softmax(student_head(student)[..., :vocab].float(), dim=-1)
    with torch.no_grad():
        teacher_logp = torch.log_softmax(teacher_head(teacher)[..., :vocab].float(), dim=-1)
    return generalized_jsd(student_logp, teacher_logp, beta).sum() * weight


def chunked_jsd_sum(student, teacher, batch: dict, beta: float, chunk_tokens: int,
                    max_tokens: int, vocab: int) -> torch.Tensor:
    """The generalized JSD summed over the batch's scored tokens, ``chunk_tokens`` of logits at a
    time.

    Args:
        student: the trained engine (gradients flow into it).
        teacher: the frozen teacher engine.
        batch: a micro-batch on the device (``labels`` mark the scored tokens).
        beta: the mix (``generalized_jsd``).
        chunk_tokens: positions of logits per chunk.
        max_tokens: the most scored tokens any rank has in this micro-batch (every rank runs
            as many chunks).
        vocab: the logits' columns compared (both models' first ``vocab``: the shared tokens).

    Returns:
        The sum (a scalar tensor).
    """
    hidden = scored_hidden(student, batch)
    with torch.no_grad():
        teacher_hidden = scored_hidden(teacher, batch)
    heads = tuple(base_model(getattr(m, "module", m)).get_output_embeddings()
                  for m in (student, teacher))
    total = hidden.new_zeros((), dtype=torch.float32)
    for index in range(math.ceil(max_tokens / chunk_tokens)):
        window = slice(index * chunk_tokens, (index + 1) * chunk_tokens)
        part, goal, weight = hidden[window], teacher_hidden[window], 1.0
        if part.shape[0] == 0:  # past this rank's end: an empty call keeps the ranks in step,
            # tied to the backbone's output so its backward runs in the same order as a real one
            part = hidden.new_zeros(1, hidden.shape[-1]) + hidden.sum() * 0
            goal, weight = teacher_hidden.new_zeros(1, teacher_hidden.shape[-1]), 0.0
        total = total + checkpoint(_chunk, part, goal, *heads, beta, vocab, weight,
                                   use_reentrant=False)
    return total
