"""What a request asks of sampling and stopping: plain values, logged in the trace. Torch-free, so the control
plane (atlas.state) imports it without importing torch."""

from __future__ import annotations

import attrs

DEFAULT_SEED = 0

# fields added after traces were first recorded: to_json leaves them out at their defaults, so an old
# trace's request payload replays byte for byte (the replay compares every event payload)
_LATER_FIELDS = {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "prompt_logprobs": None,
                 "include_stop_str_in_output": False, "skip_special_tokens": True}


def _check_temperature(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 100.0:
        raise ValueError(f"temperature must be in [0, 100], got {value}")


def _check_top_p(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _check_top_k(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {value}")


def _check_min_p(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {value}")


def _check_repetition_penalty(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    if not value > 0.0:
        raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {value}")


def _check_min_tokens(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"min_tokens must be >= 0, got {value}")


def _check_max_tokens(_inst: object, _attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"max_tokens must be >= 1, got {value}")


def _check_logprobs(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= 20:
        raise ValueError(f"top_logprobs must be in [0, 20], got {value}")


@attrs.frozen
class SamplingParams:
    """What a request asks of sampling and stopping. Plain values only: it is logged in the trace.

    The sampler's order (atlas.sampling.keyed): repetition penalty on the raw logits, banned tokens, then
    temperature, then min_p and top_k (both thresholds on the same ordering, so they commute), then top_p over
    what those kept, renormalised."""

    temperature: float = attrs.field(default=0.0, validator=_check_temperature)  # 0 = greedy
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    top_k: int = attrs.field(default=0, validator=_check_top_k)
    # None: clamp to what capacity leaves, and end with `length` when it runs out.
    max_tokens: int | None = attrs.field(default=None, validator=_check_max_tokens)
    seed: int = DEFAULT_SEED
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = attrs.field(default=0, validator=_check_logprobs)
    # keep the tokens whose probability is >= min_p times the most likely one's (0 disables it)
    min_p: float = attrs.field(default=0.0, validator=_check_min_p)
    # vLLM semantics: the logit of every token in the prompt or the output so far is divided by the penalty
    # when positive and multiplied by it when negative (1 disables it)
    repetition_penalty: float = attrs.field(default=1.0, validator=_check_repetition_penalty)
    # no stop (EOS, stop tokens, stop strings) before this many output tokens
    min_tokens: int = attrs.field(default=0, validator=_check_min_tokens)
    # prompt-token logprobs (Engine.add_request(prompt_logprobs=N)): None off, N top alternatives (0: the actual
    # token's only); recorded with the params, so a replay computes them again by the same exact forward
    prompt_logprobs: int | None = attrs.field(default=None, validator=attrs.validators.optional(_check_logprobs))
    # text only, but stop strings are matched on this text, so they can change where a request ends: recorded
    # with the rest (vLLM's fields of the same names)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_json(self) -> dict:
        d = attrs.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_json(cls, d: dict) -> SamplingParams:
        return cls(**d)  # fields a payload lacks (one recorded before they existed) take their defaults
