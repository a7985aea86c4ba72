"""Offline generation over the engine: many prompts in, one result per prompt out (LLM.generate, the CLI)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from atlas.engine.engine import Engine
from atlas.engine.outputs import FinishReason
from atlas.errors import QueueFull
from atlas.sampling.params import SamplingParams


@attrs.frozen
class Generation:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str  # cut before a stop string when one ended the request
    finish_reason: FinishReason
    finish_detail: str | None


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    progress: Callable[[int, int], None] | None = None,
    request_prefix: str = "gen",
) -> list[Generation]:
    """Run every prompt to completion, admitting as the waiting queue allows; results in prompt order.

    `progress(done_requests, total)` is called after every step."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
    ids = [f"{request_prefix}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    text: dict[str, list[str]] = {rid: [] for rid in ids}
    ended: dict[str, tuple[FinishReason, str | None]] = {}
    admitted = 0
    while len(ended) < len(ids):
        while admitted < len(ids):
            try:
                engine.add_request(ids[admitted], prompts[admitted], per_prompt[admitted])
            except QueueFull:
                break
            admitted += 1
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            text[out.request_id].append(out.new_text)
            if out.finished:
                ended[out.request_id] = (out.finish_reason, out.finish_detail)
        if progress is not None:
            progress(len(ended), len(ids))
    return [
        Generation(rid, tuple(map(int, prompts[i])), tuple(tokens[rid]), "".join(text[rid]), *ended[rid])
        for i, rid in enumerate(ids)
    ]
