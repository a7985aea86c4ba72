"""The content-loop watchdog on byte-tokenised text, checked the way the engine runs it: after every
generated token. Legitimate repetition (numbers, markdown tables, coordinate arrays) never triggers it with
the defaults; real loops do, at the place where the second copy of the pattern opens."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atlas.engine.watchdog import LoopVerdict, WatchdogConfig, detect_loop


def first_verdict(text: str, config: WatchdogConfig = WatchdogConfig()) -> tuple[int, LoopVerdict] | None:
    """The first step (tokens generated) at which the watchdog fires, and its verdict."""
    tokens = list(text.encode())
    for n in range(1, len(tokens) + 1):
        verdict = detect_loop(tokens[:n], config)
        if verdict is not None:
            return n, verdict
    return None


LEGITIMATE = {
    "a list of numbers": ", ".join(str(i) for i in range(400)),
    "a markdown table": "| name | value | unit |\n|---|---|---|\n"
                        + "".join(f"| item{i} | {i * 3} | kg |\n" for i in range(40)),
    "a wide table separator": "| " + " | ".join(["a"] * 60) + " |\n|" + "---|" * 60 + "\n| 1 |",
    "identical table rows": "| a | b | c |\n|---|---|---|\n" + "| 0 | 0 | 0 |\n" * 16 + "| 1 | 2 | 3 |\n",
    "an array of coordinates": "[" + ", ".join(f"[{i % 7}.5, {(i * 3) % 11}.25]" for i in range(120)) + "]",
    "an array of zero points": "points = [" + "[0, 0], " * 30 + "[1, 2]]\n",
    "a zero vector": "v = [" + "0.0, " * 40 + "1.0]\n",
    "a ruler": "=" * 80 + "\nTitle\n" + "=" * 80 + "\n",
}


@pytest.mark.parametrize("name", sorted(LEGITIMATE))
def test_legitimate_repetition_never_triggers(name: str) -> None:
    assert first_verdict(LEGITIMATE[name]) is None


def test_a_looping_sentence_triggers_where_its_second_copy_opens() -> None:
    intro = "Sure, here is the answer you asked for:\n"
    loop = "The answer is 42. "
    found = first_verdict(intro + loop * 30)
    assert found is not None
    step, verdict = found
    assert verdict.period == len(loop)
    assert verdict.opens_at == len(intro) + len(loop)  # the first copy is kept
    assert verdict.span >= WatchdogConfig().min_span and step <= len(intro) + 16 * len(loop)


@pytest.mark.parametrize("text, period", [("ha" * 200, 2), ("x" * 300, 1), ("I am sorry, I cannot. " * 20, 22)])
def test_short_and_long_loops_trigger_with_their_fundamental_period(text: str, period: int) -> None:
    found = first_verdict(text)
    assert found is not None and found[1].period == period


def test_thresholds_are_configurable() -> None:
    strict = WatchdogConfig(max_period=8, min_repeats=3, min_span=12, window=64)
    assert first_verdict("[0, 0], " * 3, strict) is not None  # what the defaults tolerate, a strict one flags
    assert first_verdict("The answer is 42. " * 30, strict) is None  # period 18 > max_period 8
    with pytest.raises(ValueError, match="window"):
        WatchdogConfig(min_span=100, window=50)


@settings(max_examples=60, deadline=None)
@example(prefix=[0], pattern=[0] * 10, copies=40)  # the loop runs past the window: bounded by it
@given(prefix=st.lists(st.integers(0, 255), max_size=40), pattern=st.lists(st.integers(0, 255), min_size=1,
       max_size=10), copies=st.integers(2, 40))
def test_verdict_is_exactly_the_periodic_suffix(prefix: list[int], pattern: list[int], copies: int) -> None:
    config = WatchdogConfig(max_period=10, min_repeats=3, min_span=12, window=400)
    tokens = prefix + pattern * copies
    verdict = detect_loop(tokens, config)
    if verdict is None:
        # then no period <= 10 repeats over the required span at the end
        for p in range(1, 11):
            run = 0
            while run + p < min(len(tokens), config.window) and tokens[-1 - run] == tokens[-1 - run - p]:
                run += 1
            assert run + p < max(12, 3 * p)
        return
    p, start = verdict.period, len(tokens) - verdict.span
    assert all(tokens[i] == tokens[i - p] for i in range(start + p, len(tokens)))
    lo = max(0, len(tokens) - config.window)
    assert start == lo or tokens[start - 1] != tokens[start - 1 + p]  # maximal within the window
    assert verdict.opens_at == start + p and verdict.span >= max(12, 3 * p)
