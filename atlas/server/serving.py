"""What the generation routes (atlas.server.generate) work with: the serving context create_app builds once (the
engine loop, the tokenizer and chat template, the request checks that need them) and one request's generation as
its RequestOutputs build it (text, usage, logprobs, how it ended)."""

from __future__ import annotations

import random
from typing import Any, Literal

import attrs

from atlas.engine.outputs import FinishReason, RequestOutput
from atlas.sampling.params import SamplingParams
from atlas.server.chat import ChatTemplate, encode_chat
from atlas.server.engine_loop import EngineLoop
from atlas.server.errors import APIError, bad_request, engine_error
from atlas.server.logprobs import chat_logprobs, completion_logprobs
from atlas.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

Kind = Literal["completion", "chat"]


@attrs.define
class ServingContext:
    """What the generation routes need, built once by create_app."""

    engine_loop: EngineLoop
    model_name: str
    tokenizer: Any
    chat_template: ChatTemplate
    max_seq_len: int
    vocab_size: int | None
    fault_injection: bool = False
    seeds: random.Random | None = None  # `atlas serve --seed`: the sequence requests without a seed draw from

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest, **changes: Any) -> SamplingParams:
        """The body's SamplingParams; without a seed in the body, the next seed of the server's sequence when it
        has one (the request's seed is recorded with its arrival either way, so a replay reproduces it)."""
        params = body.sampling_params()
        if body.seed is None and self.seeds is not None:
            changes["seed"] = self.seeds.getrandbits(63)
        return attrs.evolve(params, **changes) if changes else params

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def encode(self, text: str, *, param: str) -> list[int]:
        _check_unicode(text, param)
        return list(self.tokenizer.encode(text))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model '{model[:64]}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def check_token_ids(self, token_ids: list[int], *, param: str) -> None:
        if self.vocab_size is not None and any(t >= self.vocab_size for t in token_ids):
            bad = max(token_ids)
            raise bad_request(f"{param}: token id {bad} is outside the vocabulary of {self.vocab_size}",
                              param=param)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        return self.chat_template.render(_plain(messages), add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        """Message content is text: a special token's string inside it stays text (no role spoofing)."""
        plain = _plain(messages)
        for m in plain:
            _check_unicode(m["content"], "messages")
        return encode_chat(self.tokenizer, self.chat_template, plain, add_generation_prompt=add_generation_prompt)

    def message_boundaries(self, messages: list[ChatMessage], prompt: list[int]) -> tuple[int, ...]:
        """Where the chat's earlier messages end in `prompt` (the system prompt's end, each earlier turn's):
        the points where other chats and the next turn branch off, so the prefix cache keeps a recurrent
        snapshot there (SamplingParams.snapshot_points). A boundary the template does not render as a prefix
        of the whole (a template that rewrites earlier turns) is left out."""
        points = []
        for i in range(max(1, len(messages) - MAX_BOUNDARIES), len(messages)):
            head = encode_chat(self.tokenizer, self.chat_template, _plain(messages[:i]), add_generation_prompt=False)
            if 0 < len(head) < len(prompt) and prompt[:len(head)] == head:
                points.append(len(head))
        return tuple(sorted(set(points)))


MAX_BOUNDARIES = 8  # the last message boundaries a chat request marks (each costs one more tokenisation)


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param}: contains invalid Unicode (a lone surrogate)", param=param) from None


def _plain(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]


class Generation:
    """A request's tokens and text so far, built from its RequestOutputs."""

    def __init__(self, ctx: ServingContext, params: SamplingParams, request_id: str) -> None:
        self.ctx = ctx
        self.params = params
        self.request_id = request_id
        self.text = ""  # the engine's text deltas: cut at stop strings, never a partial character
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish: RequestOutput | None = None
        self.prompt_logprobs: Any = None  # with the first output, when the request asked for them
        # a whole (non-streamed) answer's tokens, logprobs and alternatives
        self.token_ids: list[int] = []
        self.token_logprobs: list[float] = []
        self.tops: list[Any] = []
        self.first_of_prompt = True  # n > 1: the usage counts each prompt's tokens once (fanout.summed_usage)

    def absorb(self, out: RequestOutput) -> str:
        """Take one output; returns its new text."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        if out.finished:
            self.finish = out
        self.text += out.new_text
        return out.new_text

    def failure(self) -> APIError | None:
        """The error this request ended with, if it did not end with stop or length."""
        assert self.finish is not None
        reason = self.finish.finish_reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            return None
        if reason == FinishReason.CANCELLED:
            return APIError(500, "the request was cancelled before it finished", code="cancelled")
        return engine_error(self.finish.finish_detail, self.request_id)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def logprobs(self, kind: Kind, token_ids: Any, logprobs: Any, top: Any, text_offset: int) -> dict | None:
        if not self.params.logprobs:
            return None
        if kind == "chat":
            return chat_logprobs(self.ctx.decode, token_ids, logprobs, top)
        return completion_logprobs(self.ctx.decode, token_ids, logprobs, top, self.params.top_logprobs,
                                   text_offset)
