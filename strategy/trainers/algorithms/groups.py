"""Sampled groups, and DAPO's dynamic sampling over them.

A rollout samples ``group_size`` completions of each prompt and scores them. With
``--dynamic_filtering`` a group whose mean score lies outside the open range (LO, HI) says
nothing (every completion alike: all right or all wrong) and is dropped; the step samples more
rounds of prompts until ``train_batch_size`` completions of kept groups are there. The kept groups
of every rank are pooled in one order (round, rank, group) and dealt out, the first
``prompts_per_rank`` to rank 0, the next to rank 1..., so every rank trains the same number of
micro-batches whatever each one kept. Short of a full step after ``max_sampling_rounds``, a rank
fills its share with groups of its own last round that train nothing (``filler``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sampled:
    """Completions of prompts with their scores, one entry per completion, in runs of one
    group per prompt.

    Attributes:
        prompt_ids: each completion's prompt tokens (no padding).
        completions: its tokens, up to and including the end-of-sequence token.
        scores: the reward's score (before any length shaping).
        prompts: its prompt text.
        rows: its dataset row.
        components: each reward of a weighted sum by name: its scores.
        engine_logps: the rollout engine's log-prob of each completion token (vLLM), or empty.
        episodes: the multi-turn episodes the completions are (``--agent_func_path``), or empty:
            which tokens the model made, the turns' rewards, which episodes were cut.
    """

    prompt_ids: list[list[int]]
    completions: list[list[int]]
    scores: list[float]
    prompts: list[str]
    rows: list[dict]
    components: dict[str, list[float]] = field(default_factory=dict)
    engine_logps: list[list[float]] = field(default_factory=list)
    episodes: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def filter_scores(self) -> list[float]:
        """What dynamic sampling reads: the scores, or an episode's last ``scores`` from its
        environment where it gave them (OpenRLHF's)."""
        if not self.episodes:
            return self.scores
        return [s if e.score is None else e.score for s, e in zip(self.scores, self.episodes)]

    def split(self, size: int) -> list[Sampled]:
        """Its groups, ``size`` completions each."""
        return [self._slice(i, i + size) for i in range(0, len(self), size)]

    def _slice(self, start: int, stop: int) -> Sampled:
        return Sampled(self.prompt_ids[start:stop], self.completions[start:stop],
                       self.scores[start:stop], self.prompts[start:stop], self.rows[start:stop],
                       {k: v[start:stop] for k, v in self.components.items()},
                       self.engine_logps[start:stop], self.episodes[start:stop])

    @classmethod
    def join(cls, parts: list[Sampled]) -> Sampled:
        """One ``Sampled`` of ``parts`` in order."""
        names = parts[0].components if parts else {}
        return cls(*([x for p in parts for x in getattr(p, name)]
                     for name in ("prompt_ids", "completions", "scores", "prompts", "rows")),
                   {k: [x for p in parts for x in p.components.get(k, [])] for k in names},
                   [x for p in parts for x in p.engine_logps],
                   [x for p in parts for x in p.episodes])


def informative(groups: list[Sampled], low: float, high: float) -> list[bool]:
    """Which groups a dynamic-sampling step keeps: mean score strictly inside (low, high)
    (OpenRLHF's ``min_r < avg_reward < max_r``).

    Args:
        groups: sampled groups.
        low: the range's lower end.
        high: its upper end.

    Returns:
        One flag per group.
    """
    return [low < sum(g.filter_scores) / len(g.filter_scores) < high for g in groups]


def deal(pool: list[Sampled], per_rank: int, rank: int,
         spare: list[Sampled]) -> tuple[Sampled, int]:
    """This rank's groups of a step: its share of the pooled kept groups, filled up from
    ``spare`` when the pool is short.

    Args:
        pool: the kept groups of every rank, in one order every rank agrees on.
        per_rank: groups each rank trains.
        rank: this data-parallel rank.
        spare: this rank's own groups to fill with (its last round's), at least ``per_rank``.

    Returns:
        ``(groups joined, how many at the end are filler)``.
    """
    mine = pool[rank * per_rank:(rank + 1) * per_rank]
    filler = per_rank - len(mine)
    return Sampled.join(mine + spare[:filler]), filler
