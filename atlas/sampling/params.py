"""Sampling parameters: what a request asks of sampling and stopping. Plain values, no torch: the control
plane (atlas.state) records them in the trace and must import without a tensor library."""

from __future__ import annotations

import attrs

DEFAULT_SEED = 0


def _check_temperature(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 100.0:
        raise ValueError(f"temperature must be in [0, 100], got {value}")


def _check_top_p(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _check_top_k(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {value}")


def _check_max_tokens(_inst: object, _attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"max_tokens must be >= 1, got {value}")


def _check_logprobs(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= 20:
        raise ValueError(f"top_logprobs must be in [0, 20], got {value}")


@attrs.frozen
class SamplingParams:
    """What a request asks of sampling and stopping. Plain values only: it is logged in the trace."""

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_json(self) -> dict:
        d = attrs.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> SamplingParams:
        return cls(**d)
