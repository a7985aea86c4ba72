"""roll_tokens' unrolled form for long token lists (atlas.hashing._LONG and up): the loop's integer, every case."""

from __future__ import annotations

import random

import numpy as np
import pytest

from atlas import hashing
from atlas.hashing import MASK64, fnv_powers, roll_tokens
from atlas.state.column_arrivals import token_hashes


def _loop(h: int, tokens: list) -> int:  # the specified recurrence, written out
    for t in tokens:
        h = (h * 0x100000001B3 + t + 1) & MASK64
    return h


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 200, 2048, 5000])
def test_long_token_lists_hash_as_the_loop_does(n: int) -> None:
    rng = random.Random(n)
    for h in (0, 1, MASK64, rng.getrandbits(64)):
        tokens = [rng.randrange(0, 262_144) for _ in range(n)]
        assert roll_tokens(h, tokens) == _loop(h, tokens)
        assert roll_tokens(h, tuple(tokens)) == _loop(h, tokens)
        assert roll_tokens(h, iter(tokens)) == _loop(h, tokens)  # an iterator: the loop
    edge = [-1, 0, 2**63 - 1, -(2**63), 2**64 - 1 - 2**63] * 20  # int64's ends (a negative's t + 1 wraps as the loop's)
    assert roll_tokens(7, edge) == _loop(7, edge)
    big = [2**63, 2**64 - 1] * 40  # uint64: numpy's own dtype, still the loop's integer
    assert roll_tokens(7, big) == _loop(7, big)
    numpy_ints = list(np.arange(100, dtype=np.int32))
    assert roll_tokens(3, numpy_ints) == _loop(3, [int(t) for t in numpy_ints])


def test_what_numpy_cannot_hold_as_64_bit_integers_takes_the_loop() -> None:
    huge = [2**64 + 5] * 70  # past 64 bits: object dtype, the loop (mod 2^64 as ever)
    assert roll_tokens(0, huge) == _loop(0, huge)
    mixed = [-1, 2**63] * 40  # neither int64 nor uint64
    assert roll_tokens(0, mixed) == _loop(0, mixed)
    with pytest.raises(TypeError):  # a float among the tokens: refused as the loop refuses it, not truncated
        roll_tokens(0, [1] * 70 + [1.5])
    with pytest.raises(TypeError):
        roll_tokens(0, ["1"] * 70)


def test_the_unrolled_form_is_taken_from_the_threshold_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = hashing.fnv_powers
    monkeypatch.setattr(hashing, "fnv_powers", lambda n: calls.append(n) or real(n))
    roll_tokens(0, [1] * (hashing._LONG - 1))
    roll_tokens(0, [1] * hashing._LONG)
    assert calls == [hashing._LONG]


def test_the_powers_table_grows_and_cannot_be_written() -> None:
    p = fnv_powers(3)
    assert [int(x) for x in p] == [1, 0x100000001B3, (0x100000001B3**2) & MASK64]
    long = fnv_powers(10_000)
    assert int(long[9_999]) == pow(0x100000001B3, 9_999, 1 << 64)
    with pytest.raises(ValueError):
        long[0] = 5
    # the replay's arrivals use the same table: every prompt's hash as the loop's
    prompts = [[5, 6, 7], list(range(300)), [9]]
    flat = np.array([t for p in prompts for t in p], dtype=np.int64)
    got = token_hashes(flat, np.array([len(p) for p in prompts]))
    assert [int(x) for x in got] == [_loop(0, p) for p in prompts]
