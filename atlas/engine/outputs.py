"""What the engine hands back to its callers (LLM.generate, the server), one record per request per step."""

from __future__ import annotations

from enum import Enum

import attrs


class FinishReason(str, Enum):  # noqa: UP042 (str() stays "FinishReason.STOP"; .value is the wire form)
    STOP = "stop"  # EOS, a stop string or stop token, or a deliberate hard stop (with its detail)
    LENGTH = "length"  # max_tokens, or the capacity left, ran out
    ERROR = "error"  # the engine failed this request; never reported as stop or length
    CANCELLED = "cancelled"  # the client went away (not an OpenAI finish_reason; never sent to a client)


class AdmissionError(ValueError):
    """A request refused before anything ran (HTTP 400). The message names the knob and the numbers."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """The waiting queue is at its bound (EngineConfig.max_waiting): try again later (HTTP 503/429)."""


class EngineDead(RuntimeError):
    """The engine hit a fatal fault; nothing more can run in this process."""


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
