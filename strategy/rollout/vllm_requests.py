"""What one vLLM engine is asked and what it answers, on any engine layer (in-rank or a Ray
actor): the requests of the ranks it serves (``EnginePeers``: gathered from the ranks one engine
spans, each rank keeping its own rows), their sampling settings, the engine stepped to their
completions (``run_requests``: a ``StepGate`` may stop it between two steps for a sync in
flight), and the completions put back beside the prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from strategy.rollout.partial import StepGate


def sampling_params(generation_config: GenerationConfig, seeds: list[int]) -> list[Any]:
    """One ``vllm.SamplingParams`` per row: greedy or sampled as ``generation_config`` says,
    ``max_new_tokens`` at most, stopping at its end ids alone."""
    from vllm import SamplingParams  # the optional extra: imported only once the engine runs

    eos = generation_config.eos_token_id
    stop = None if eos is None else [eos] if isinstance(eos, int) else list(eos)
    sample = bool(generation_config.do_sample)
    settings = dict(max_tokens=generation_config.max_new_tokens, ignore_eos=True,
                    stop_token_ids=stop, logprobs=0, detokenize=False,
                    skip_special_tokens=False, temperature=0.0)
    if sample:
        settings.update(temperature=float(generation_config.temperature or 1.0),
                        top_p=float(generation_config.top_p or 1.0),
                        top_k=int(generation_config.top_k or 0))
    return [SamplingParams(seed=seed, **settings) for seed in seeds]


def run_requests(llm: Any, prompts: list[list[int]], seeds: list[int],
                 generation_config: GenerationConfig, gate: StepGate | None = None
                 ) -> tuple[list[list[int]], list[list[float]], list[int] | None]:
    """Each prompt's completion tokens and their log-probs from ``llm``, one seed per row, the
    engine stepped here (as ``LLM.generate`` does); a ``gate`` may stop it between two steps
    for a sync (``strategy.rollout.partial``): then, third, each row's count of tokens sampled
    before it (None: no sync in flight)."""
    engine, done = llm.llm_engine, {}
    try:
        if gate is not None:  # a sync asked for before it began goes first
            gate.between_steps(lambda: None)
        llm.enqueue([{"prompt_token_ids": row} for row in prompts],
                    sampling_params(generation_config, seeds), use_tqdm=False)
        while engine.has_unfinished_requests():
            if gate is not None:
                gate.between_steps(lambda: sampled_so_far(engine))
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
    finally:
        if gate is not None:
            gate.end()
    ids = sorted(done, key=int)  # the order they were asked in (as ``LLM.generate`` sorts)
    outputs = [done[i] for i in ids]
    tokens = [list(out.token_ids) for out in outputs]
    logprobs = [[step[token].logprob for step, token in zip(out.logprobs, out.token_ids)]
                for out in outputs]
    split = None
    if gate is not None and gate.held:  # a request absent from the split had ended before it
        split = [0 if gate.split is None else gate.split.get(i, len(row))
                 for i, row in zip(ids, tokens)]
    return tokens, logprobs, split


def sampled_so_far(engine: Any) -> dict[str, int]:
    """Each unfinished request's count of tokens sampled (vLLM's output processor keeps them
    per request, by the id its output carries)."""
    return {state.external_req_id or key: len(state.detokenizer.output_token_ids)
            for key, state in engine.output_processor.request_states.items()}


def late_tokens(tokens: list[list[int]], split: list[int] | None,
                rows: slice) -> tuple[int, int] | None:
    """``rows``' tokens sampled after a sync in flight, and all their tokens (None: none)."""
    if split is None:
        return None
    return sum(len(t) - b for t, b in zip(tokens, split[rows])), sum(len(t) for t in tokens)


def with_completions(input_ids: torch.Tensor, tokens: list[list[int]],
                     pad: int | None) -> torch.Tensor:
    """What ``generate`` returns: the prompts, then each row's completion padded after its end."""
    pad = pad or 0
    width = max((len(t) for t in tokens), default=0)
    new = torch.tensor([t + [pad] * (width - len(t)) for t in tokens], dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device).reshape(len(tokens), width)], 1)


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Left-padded prompts as token lists, padding dropped."""
    return [row[keep.bool()].tolist() for row, keep in zip(input_ids.cpu(), attention_mask.cpu())]


@dataclass(frozen=True)
class Requests:
    """What one engine generates: its ranks' prompts and seeds in rank order, and where this
    rank's rows start among them."""

    prompts: list[list[int]]
    seeds: list[int]
    start: int = 0


class EnginePeers:
    """The ranks one engine spans (``--vllm_tensor_parallel_size``: consecutive ranks, one
    process group each, made by every rank alike). Every rank of an engine hands it the same
    requests: each rank's rows are gathered and each takes its own results back."""

    def __init__(self, tp: int) -> None:
        self.size, self.group, self.index = tp, None, 0
        if tp == 1:
            return
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        for first in range(0, world, tp):  # every rank enters every new_group
            group = torch.distributed.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                self.group, self.index = group, rank - first

    def share(self, prompts: list[list[int]], seeds: list[int]) -> Requests:
        """The engine's requests: this rank's alone, or all its ranks' (collective on them)."""
        if self.group is None:
            return Requests(prompts, seeds)
        parts: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(parts, (prompts, seeds), group=self.group)
        start = sum(len(p) for p, _ in parts[:self.index])
        return Requests([row for p, _ in parts for row in p], [s for _, ss in parts for s in ss],
                        start)

    def spread(self, value: Any) -> Any:
        """The engine's first rank's ``value``, on each of its ranks (collective on them)."""
        if self.group is None:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]


def draw_seeds(rows: int, generator: torch.Generator | None = None) -> list[int]:
    """One vLLM seed per row from ``generator`` (None: the global one, the caller's seeded)."""
    return torch.randint(0, 2**31 - 1, (rows,), generator=generator).tolist()
