"""What a request asks of sampling and stopping: plain values, logged in the trace. Torch-free, so the control
plane (atlas.state) imports it without importing torch."""

from __future__ import annotations

import functools

import attrs

DEFAULT_SEED = 0
SEED_BOUND = 2**64  # the API's seeds are in [0, 2^64): one request seed per 64-bit key, none aliasing another
# a temperature in (0, TEMPERATURE_FLOOR) is greedy (vLLM's _SAMPLING_EPS is the same 1e-5): the sampler divides
# the logits by T, and at T >= 1e-5 logits / T stays finite in float32 for every |logit| < 3.4e33; below 2.2e-308
# it overflows even float64 (inf - inf is nan: a garbage draw). Such a row is packed with temperature 0
TEMPERATURE_FLOOR = 1e-5
PENALTY_RANGE = 2.0  # frequency_penalty and presence_penalty are in [-2, 2] (OpenAI's range)
BIAS_RANGE = 100.0  # a logit_bias value is in [-100, 100] (OpenAI's range)

# fields added after traces were first recorded: to_json leaves them out at their defaults, so an old
# trace's request payload replays byte for byte (the replay compares every event payload)
_LATER_FIELDS = {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "prompt_logprobs": None,
                 "include_stop_str_in_output": False, "skip_special_tokens": True, "snapshot_points": (),
                 "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": ()}


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` (0, 1, ...) of a request asking n > 1 choices with `seed`: choice 0 keeps the seed
    (so the first of n is the n = 1 answer), the others splitmix64(seed + choice * 0x9E3779B97F4A7C15) in [0, 2^64):
    distinct from each other (a bijection of distinct words), and the same on every run and every replay."""
    if choice == 0:
        return seed
    z = (seed + choice * 0x9E37_79B9_7F4A_7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return z ^ (z >> 31)


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


def _check_penalty(_inst: object, attr: attrs.Attribute, value: float) -> None:
    if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
        raise ValueError(f"{attr.name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 disables it), got {value}")


def _bias(value: object) -> tuple[tuple[int, float], ...]:
    items = value.items() if isinstance(value, dict) else value  # type: ignore[attr-defined]
    return tuple(sorted((int(t), float(b)) for t, b in items))  # type: ignore[union-attr]


def _check_bias(_inst: object, _attr: attrs.Attribute, value: tuple[tuple[int, float], ...]) -> None:
    tokens = [t for t, _ in value]
    if len(set(tokens)) != len(tokens) or any(t < 0 for t in tokens):
        raise ValueError(f"logit_bias must map distinct token ids >= 0 to a bias, got {list(value)}")
    for t, b in value:
        if not -BIAS_RANGE <= b <= BIAS_RANGE:
            raise ValueError(f"logit_bias of token {t} must be in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}], got {b}")


def _check_min_tokens(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"min_tokens must be >= 0, got {value}")


def _check_max_tokens(_inst: object, _attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"max_tokens must be >= 1, got {value}")


def _check_points(_inst: object, _attr: attrs.Attribute, value: tuple[int, ...]) -> None:
    if any(p < 1 for p in value) or list(value) != sorted(set(value)):
        raise ValueError(f"snapshot_points must be increasing prompt positions >= 1, got {list(value)}")


def _ints(value: object) -> tuple[int, ...]:
    return tuple(int(v) for v in value)  # type: ignore[attr-defined]


def _check_logprobs(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= 20:
        raise ValueError(f"top_logprobs must be in [0, 20], got {value}")


@attrs.frozen
class SamplingParams:
    """What a request asks of sampling and stopping. Plain values only: it is logged in the trace.

    The sampler's order (atlas.sampling.keyed): logit_bias added to the raw logits, the repetition penalty, the
    frequency and presence penalties, banned tokens, then temperature, then min_p and top_k (both thresholds on
    the same ordering, so they commute), then top_p over what those kept, renormalised."""

    # 0 = greedy, and so is any temperature below TEMPERATURE_FLOOR (1e-5)
    temperature: float = attrs.field(default=0.0, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    top_k: int = attrs.field(default=0, validator=_check_top_k)
    # None: clamp to what capacity leaves, and end with `length` when it runs out.
    max_tokens: int | None = attrs.field(default=None, validator=_check_max_tokens)
    # any int, used mod 2^64 (atlas.sampling.hashing.seed64); the API takes [0, 2^64) only. No validator: replay
    # validates one request's params and reuses them for those differing only in the seed (atlas.replay.arrivals)
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
    # prompt positions where the prefix cache should keep a recurrent snapshot (prefill chunks end there): the
    # server sets the chat's message boundaries (the end of the system prompt and of each earlier turn), where
    # the next chat or turn branches off. Positions at or past the prompt's end are ignored
    snapshot_points: tuple[int, ...] = attrs.field(default=(), converter=_ints, validator=_check_points)
    # OpenAI semantics, on the tokens generated so far (not the prompt): the logit of token t is lowered by
    # frequency_penalty * count(t) + presence_penalty * [count(t) > 0], after the repetition penalty
    frequency_penalty: float = attrs.field(default=0.0, validator=_check_penalty)
    presence_penalty: float = attrs.field(default=0.0, validator=_check_penalty)
    # (token id, bias) pairs sorted by id, added to the raw logits before everything else (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias, validator=_check_bias)

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @functools.cached_property
    def reads_history(self) -> bool:
        """The sampled token depends on the tokens before it (a repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @functools.cached_property  # once per params object: the decode paths ask it of every row
    def adjusted(self) -> bool:
        """The sampler needs inputs beyond the packed rows (atlas.sampling.keyed.RowBatch): the history, or a
        logit_bias. Such a row is sampled eagerly (not from a captured graph) and is not speculated."""
        return self.reads_history or bool(self.logit_bias)

    def to_json(self) -> dict:
        d = attrs.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["snapshot_points"] = list(self.snapshot_points)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        for name, default in _LATER_FIELDS.items():
            if d[name] == default or (isinstance(default, tuple) and tuple(d[name]) == default):
                del d[name]
        return d

    @classmethod
    def from_json(cls, d: dict) -> SamplingParams:
        return cls(**d)  # fields a payload lacks (one recorded before they existed) take their defaults
