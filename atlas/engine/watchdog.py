"""The content-loop watchdog: a pure, deterministic test of whether a sequence's recent tokens loop.

A loop is a suffix of the generated tokens that repeats one pattern exactly: for some period p in
[1, max_period], the last `span` tokens satisfy t[i] == t[i - p], with span >= min_repeats * p and
span >= min_span, looking only inside the last `window` tokens. Tokens in, verdict out: no clock, no
state, so a replay reaches the same verdict at the same step.

The defaults tolerate legitimate repetition. Exact periodic repetition is what a loop looks like, but
short runs of it are normal text: a row of `| --- |` cells, `0, 0, 0` in a vector, a repeated table row.
Requiring 8 repeats AND 256 tokens of one pattern means a byte-level markdown separator of 60 columns
(240 bytes), sixteen identical 14-byte table rows (224) or thirty identical 2-D points `[0, 0], ` (240)
pass, while a sentence looping until it covers 256 tokens does not (tests/test_watchdog_detection.py checks
both sides on byte-tokenised text, at every step of the generation).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


def _positive(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"watchdog {attr.name} must be >= 1, got {value}")


@attrs.frozen
class WatchdogConfig:
    max_period: int = attrs.field(default=64, validator=_positive)  # longest pattern that counts as a loop
    min_repeats: int = attrs.field(default=8, validator=_positive)  # copies of the pattern, at least
    min_span: int = attrs.field(default=256, validator=_positive)  # looping tokens, at least
    window: int = attrs.field(default=768, validator=_positive)  # how far back the watchdog looks

    def __attrs_post_init__(self) -> None:
        if self.window < self.min_span:
            raise ValueError(f"watchdog window {self.window} is below min_span {self.min_span}: "
                             "no loop could ever be seen")


@attrs.frozen
class LoopVerdict:
    """A loop of `period` tokens covering the last `span` generated tokens.

    `opens_at` is the index (in the generated tokens) of the first token of the second copy: keeping the
    first copy and re-steering there removes the loop while keeping what may have been meant once."""

    period: int
    span: int
    opens_at: int


def detect_loop(generated: Sequence[int], config: WatchdogConfig = WatchdogConfig()) -> LoopVerdict | None:
    """The shortest-period loop at the end of `generated`, or None."""
    n = len(generated)
    if n < config.min_span:
        return None
    lo = max(0, n - config.window)
    for p in range(1, config.max_period + 1):
        if n - lo <= p:
            break
        # run: how many trailing positions i (within the window) satisfy t[i] == t[i - p]
        i = n - 1
        while i - p >= lo and generated[i] == generated[i - p]:
            i -= 1
        span = (n - 1 - i) + p  # the matched positions plus the first copy they repeat
        if span > p and span >= config.min_span and span >= config.min_repeats * p:
            start = n - span
            return LoopVerdict(period=p, span=span, opens_at=start + p)
    return None
