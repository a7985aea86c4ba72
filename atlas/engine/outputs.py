"""What the engine hands back to its callers (LLM.generate, the server), one record per request per step."""

from __future__ import annotations

import attrs

from atlas.state.machines import FinishReason


@attrs.frozen
class RequestOutput:
    """New tokens for one request since its last output, and whether it finished."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[float, ...] = ()
    new_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    finish_detail: str | None = None  # why: "eos", "stop string '...'", "max_tokens 16", error text...
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    # text since the last output: never a partial UTF-8 character, never a prefix of a stop string that
    # could still complete; on a stop string the text ends before it
    new_text: str = ""
    # with the request's first output when it asked for them: one (logprob, top alternatives) per prompt
    # position, position 0's logprob None (nothing precedes it)
    prompt_logprobs: tuple[tuple[float | None, tuple[tuple[int, float], ...]], ...] | None = None
