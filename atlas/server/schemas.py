"""Request bodies of the OpenAI-compatible API, validated strictly, and their translation to SamplingParams.

Field names and types follow OpenAI's API (plus vLLM's common extensions: top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens). Types are strict:
"5" is not an integer and true is not a number. Every field is honoured or refused with a 400 naming it:
unknown fields too (`extra="forbid"`), and the vLLM/OpenAI fields the engine cannot honour get a message
saying so (UNSUPPORTED). The one field accepted and ignored is `user`, which vLLM ignores too (its protocol:
"NOTE this will be ignored by vLLM").
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from atlas.sampling.params import BIAS_RANGE, SEED_BOUND, SamplingParams
from atlas.server.errors import APIError, bad_request

MAX_INT32 = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_PROMPTS = 128  # prompts in one completions request (lm-eval's --batch_size sends that many); each is a request
MAX_CHOICES = MAX_PROMPTS  # prompts times n: each choice is its own engine request

StopField = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
M = TypeVar("M", bound=BaseModel)


# fields other servers accept that this one cannot honour: named in the 400, so the client learns why
UNSUPPORTED = frozenset({
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs", "use_beam_search", "length_penalty",
    "early_stopping", "typical_p", "logits_processors", "truncate_prompt_tokens",
    "bad_words", "allowed_token_ids", "spaces_between_special_tokens", "functions", "tools", "tool_choice",
    "function_call", "parallel_tool_calls", "tool_calls", "tool_call_id", "reasoning_effort", "audio",
    "modalities", "prediction", "store", "metadata", "service_tier", "web_search_options", "priority",
    "min_completion_tokens", "chat_template", "chat_template_kwargs", "documents", "echo_prompt",
})


class FieldRefused(ValueError):
    """A validator's refusal of `field` (the 400's param), where the check spans fields (a model validator)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    # an unknown field is refused, never ignored: a client that sends one expects it to do something
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False  # a usage chunk (summed over the choices) before [DONE]
    continuous_usage_stats: bool | None = False  # and the usage so far on every chunk (vLLM's extension)


class ResponseFormat(_Strict):
    # json_object / json_schema need constrained decoding, which this server does not have: refused, never ignored
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _SamplingFields(_Strict):
    """What completions and chat completions share."""

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)  # OpenAI's newer name
    min_tokens: int = Field(default=0, ge=0, le=MAX_INT32)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=MAX_INT32)  # vLLM: -1 or 0 disables it
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    seed: int | None = None  # [0, 2^64): _seed_range
    stop: StopField | list[StopField] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # n choices per prompt, each its own engine request
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-BIAS_RANGE, le=BIAS_RANGE)]] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = Field(default=None, max_length=256)  # accepted and ignored, as vLLM does

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed: int | None) -> int | None:
        if seed is not None and not 0 <= seed < SEED_BOUND:
            raise ValueError(f"must be in [0, 2^64 - 1 = {SEED_BOUND - 1}], got {seed}")
        return seed

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isascii() or not key.isdigit() or int(key) > MAX_INT32:
                raise ValueError(f"keys must be token ids (decimal strings in [0, {MAX_INT32}]), got {key[:32]!r}")
        return bias

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingFields:
        if self.response_format is not None and self.response_format.type != "text":
            raise FieldRefused("response_format", f"type {self.response_format.type!r} is not supported: it needs "
                               "constrained decoding, which this server does not have; only {'type': 'text'} is")
        if self.stream_options is not None and not self.stream:
            raise FieldRefused("stream_options", "is only allowed when stream is true")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        budget = self.requested_max_tokens()
        if budget is not None and self.min_tokens > budget:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {budget}")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)

    def bias_token_ids(self) -> list[int]:
        return [int(k) for k in self.logit_bias or {}]

    def check_min_tokens_room(self, max_seq_len: int, prompt_len: int) -> None:
        """min_tokens must fit in the context the prompt leaves: a 400 naming both numbers."""
        room = max_seq_len - prompt_len
        if self.min_tokens > room:
            raise bad_request(f"min_tokens: {self.min_tokens} exceeds the context left after the prompt, {room} "
                              f"tokens (max_model_len {max_seq_len} - prompt {prompt_len})", param="min_tokens")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        # the newer name wins when both are given, as in OpenAI's API
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; k: the sampled token's logprob and k alternatives."""
        return None

    def sampling_params(self) -> SamplingParams:
        top = self.top_logprobs_count()
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_tokens=self.requested_max_tokens(),
            # no seed: a fresh one, which the trace records with the request, so replay still reproduces it
            seed=self.seed if self.seed is not None else secrets.randbits(63),
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=top is not None,
            top_logprobs=top or 0,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    # a string, token ids, or a list of either (one choice per prompt, `index` in order)
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # echo: the prompt comes back before the completion, with its tokens' logprobs when `logprobs` is set
    # (what lm-evaluation-harness scores loglikelihood and multiple-choice tasks with)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's extension: per-position top-N
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # 1 or n: no beam search or reranking
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompts(self) -> CompletionRequest:
        if self.suffix:
            raise FieldRefused("suffix", "is not supported")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise FieldRefused("best_of", f"{self.best_of} is not supported: best_of must be 1 or equal to n "
                               f"({self.n}); this server returns every choice it samples")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}")
            if self.stream and len(p) > 1:
                raise ValueError(f"stream with {len(p)} prompts is not supported; send one prompt per streamed "
                                 "request")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise FieldRefused("n", f"at most {MAX_CHOICES} choices per request (prompts x n), got "
                               f"{len(self.prompts())} x {self.n}")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        """What the engine must compute for the prompt: echo with logprobs needs the prompt tokens' logprobs
        (and `logprobs` alternatives), prompt_logprobs its own count; the larger of the two."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(wanted) if wanted else None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extension
    # tools only with tool_choice "none" (no tool-call parser here): the model never calls one then, and the
    # definitions are not rendered into the prompt (the chat template has no tools section), as vLLM's
    # --exclude-tools-when-tool-choice-none
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # declared only to be refused: a field a client relies on is never silently ignored
    echo: bool = False
    prompt_logprobs: int | None = None

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.echo or self.prompt_logprobs is not None:
            raise ValueError("echo and prompt_logprobs are supported on /v1/completions only")
        if self.tool_choice is not None and self.tool_choice != "none":
            raise FieldRefused("tool_choice", "only 'none' is supported: this server has no tool-call parser")
        if self.tools and self.tool_choice != "none":
            raise FieldRefused("tools", "are supported only with tool_choice 'none': this server has no tool-call "
                               "parser")
        return self

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # vLLM's field (lm-evaluation-harness sends it): Atlas's tokenizers add no special tokens to a prompt (no
    # BOS), so both values give the same ids
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = Field(default=None, max_length=256)
    tokens: list[TokenId]


def parse_body(schema: type[M], body: Any) -> M:
    """Validate a decoded JSON body, turning the first problem into a 400 that names the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise _as_api_error(exc) from None


_BRANCH_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _as_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False, include_input=False)
    # a union reports one error per branch; the deepest is the most specific (prompt.0: must be >= 0)
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    refused = first.get("ctx", {}).get("error")
    if isinstance(refused, FieldRefused):
        return bad_request(f"{refused.field}: {refused}", param=refused.field, code="unsupported_field")
    loc = [str(part) for part in first.get("loc", ())]
    # a union names its branch in the path (prompt.list[constrained-int].0): keep the field path only
    param = ".".join(p for p in loc if p not in _BRANCH_TAGS and not any(c in p for c in "[-("))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "field required"
    elif first.get("type") == "extra_forbidden":
        name = loc[-1] if loc else ""
        message = ("is not supported by this server, which refuses what it cannot honour" if name in UNSUPPORTED
                   else "unknown field (this server refuses fields it does not know rather than ignore them)")
        return bad_request(f"{param}: {message}", param=param or None, code="unsupported_field")
    return bad_request(f"{param}: {message}" if param else message, param=param or None, code="invalid_value")
