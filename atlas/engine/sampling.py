"""Sampling: parameters, and the keyed sampler shared by every backend.

Randomness is keyed by (request seed, position) so a request's tokens never depend on what else is in
the batch, on chunking, or on the order of requests, and a replay reproduces them exactly.
"""

from __future__ import annotations

import attrs
import torch

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


def _check_min_p(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {value}")


def _check_repetition_penalty(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    if not value > 0.0:
        raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {value}")


def _check_min_tokens(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"min_tokens must be >= 0, got {value}")


# added after traces were first recorded: left out of to_json at their defaults, so an old trace's
# request_arrived params replay as recorded
_LATER_FIELDS = {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "include_stop_str_in_output": False,
                 "skip_special_tokens": True}


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
    # the sampling math for these two lives with the sampler (atlas/sampling/, issue 12's helper)
    min_p: float = attrs.field(default=0.0, validator=_check_min_p)
    repetition_penalty: float = attrs.field(default=1.0, validator=_check_repetition_penalty)
    # no EOS / stop token / stop string ends the request within its first min_tokens tokens (stopping.py;
    # the engine also bans the stop tokens from being sampled there)
    min_tokens: int = attrs.field(default=0, validator=_check_min_tokens)
    # text only, but stop strings are matched on this text, so they can change where a request ends:
    # recorded with the rest (vLLM's fields of the same names)
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
        return cls(**d)


def _generator(seed: int, position: int) -> torch.Generator:
    # splitmix-style mixing so (seed, position) pairs that differ by one land far apart
    key = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 63) - 1)
    g = torch.Generator(device="cpu")
    g.manual_seed(key)
    return g


def uniform_for(seed: int, position: int) -> float:
    """The one uniform draw in [0, 1) that sampling the token at `position` consumes."""
    return float(torch.rand((), generator=_generator(seed, position), dtype=torch.float64))


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after temperature, top-k and top-p, in float64 on the CPU: [vocab]."""
    x = logits.detach().to(device="cpu", dtype=torch.float64) / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = torch.where(x < kth, torch.tensor(float("-inf"), dtype=x.dtype), x)
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep_sorted = (cum - sorted_p) < params.top_p  # keep the smallest prefix reaching top_p
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Sample the token for `position` (its index in the sequence) from one row of logits [vocab].

    Greedy takes the lowest index among ties, so it is deterministic on every backend. Otherwise one
    uniform keyed by (seed, position) is inverted through the filtered CDF (float64, CPU), which makes
    the choice independent of batch composition and exactly reproducible on replay.
    """
    if params.greedy:
        return int(torch.argmax(logits.detach().to("cpu", torch.float64)).item())
    probs = filtered_probs(logits, params)
    u = uniform_for(params.seed, position)
    cdf = torch.cumsum(probs, dim=-1)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype)).item())
    idx = min(idx, probs.numel() - 1)
    while probs[idx] == 0.0 and idx > 0:  # never land on a filtered-out token through rounding
        idx -= 1
    return idx


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under the raw model distribution, and the `top` best alternatives."""
    lp = torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=-1)
    alts: tuple[tuple[int, float], ...] = ()
    if top:
        v, i = torch.topk(lp, top)
        alts = tuple((int(a), float(b)) for a, b in zip(i.tolist(), v.tolist(), strict=True))
    return float(lp[token]), alts
