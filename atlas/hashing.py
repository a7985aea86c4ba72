"""The specified hashes Atlas persists in traces (trace schema 2; docs/TRACE.md).

Everything that reaches a trace is a named, stable function of bytes, never Python's `hash()` (a CPython
implementation detail that changed in 3.8 and may change again):

- `hash64(person, data)`: BLAKE2b (hashlib, RFC 7693) with an 8-byte digest and a per-use personalisation
  string, read as a little-endian unsigned 64-bit integer;
- token ids are hashed as little-endian signed 64-bit integers (`token_bytes`);
- prefix-cache block keys chain: `block_key(parent, tokens) = hash64(b"atlas.block", parent_le64 ||
  token_bytes(tokens))`, the empty prefix being `ROOT`; a recurrent snapshot's key is
  `snapshot_key(chain, tail) = hash64(b"atlas.snapshot", chain_le64 || token_bytes(tail))`;
- the in-flight plan's share of the state digest is `ints_key(b"atlas.plan", rows)` over its integer rows.

The per-event state digest itself mixes integers with splitmix64's finaliser (`mix64`), incrementally per
sequence (atlas.state.control): a fixed function of integers, so it too is the same in every process.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence

import numpy as np

MASK64 = (1 << 64) - 1
ROOT = 0x5BD1E995  # the chain key of the empty prefix
_LITTLE = sys.byteorder == "little"


def token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("q", tokens)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def hash64(person: bytes, data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(), "little")


def hash64_after(person: bytes, head: bytes) -> Callable[[bytes], int]:
    """tail -> hash64(person, head + tail), with `head` absorbed once (BLAKE2b's state copied for each tail: the
    same digest as hashing head + tail in one call)."""
    absorbed = hashlib.blake2b(head, digest_size=8, person=person)

    def finish(tail: bytes) -> int:
        h = absorbed.copy()
        h.update(tail)
        return int.from_bytes(h.digest(), "little")

    return finish


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """The chain key of a full block of `tokens` whose prefix has chain key `parent`."""
    return hash64(b"atlas.block", parent.to_bytes(8, "little") + token_bytes(tokens))


def snapshot_key(chain: int, tail: Sequence[int]) -> int:
    """The key of a recurrent snapshot ending `len(tail)` tokens into the block after chain key `chain`."""
    return hash64(b"atlas.snapshot", chain.to_bytes(8, "little") + token_bytes(tail))


def ints_key(person: bytes, rows: Iterable[Sequence[int]]) -> int:
    """A key over rows of integers: each row is its length, then its values (so rows cannot run together)."""
    flat: list[int] = []
    for row in rows:
        flat.append(len(row))
        flat.extend(row)
    return hash64(person, token_bytes(flat))


def mix64(h: int) -> int:
    """splitmix64's finaliser: spreads every input bit over the whole word."""
    h &= MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
    return h ^ (h >> 31)


FNV = 0x100000001B3  # roll_tokens' multiplier (FNV-1's 64-bit prime)
# from this many tokens roll_tokens takes numpy's one dot product (64 tokens: 5.8 against 3.8 us; a 2,048-token prompt
# 195 against 30 us, timeit on the 2-core box): a prompt's arrival hashes every token of it
_LONG = 64
_powers = np.ones(1, dtype=np.uint64)  # FNV^0 .. FNV^(n-1) mod 2^64, grown on demand (fnv_powers)


def fnv_powers(n: int) -> np.ndarray:
    """FNV^0 .. FNV^(n-1) mod 2^64 (uint64; numpy's integer products wrap mod 2^64). A read-only view of a table
    kept for the process."""
    global _powers
    if len(_powers) < n:
        p = np.full(max(n, 2 * len(_powers)), np.uint64(FNV), dtype=np.uint64)
        p[0] = 1
        _powers = np.cumprod(p, dtype=np.uint64)
        _powers.flags.writeable = False
    return _powers[:n]


def roll_tokens(h: int, tokens: Iterable[int]) -> int:
    """The sequence's rolling token hash (a multiply-add over 64 bits, FNV's prime), kept incrementally for
    the digest: h' = h * 0x100000001B3 + t + 1 (mod 2^64) per token.

    A list or tuple of _LONG or more tokens is summed at once, the recurrence unrolled: h * FNV^n + sum (t_i + 1) *
    FNV^(n-1-i) (mod 2^64), the same integer (tested against the loop). Anything numpy does not hold as 64-bit
    integers (a float, a string, an int past 64 bits) takes the loop, which computes or refuses it as before."""
    if type(tokens) in (list, tuple) and len(tokens) >= _LONG:  # type: ignore[arg-type]
        values = np.array(tokens)
        if values.dtype.kind in "iu" and values.ndim == 1:
            terms = values.astype(np.uint64) + np.uint64(1)  # an int64's two's complement: t mod 2^64
            n = len(terms)
            return (h * pow(FNV, n, 1 << 64) + int(np.dot(terms, fnv_powers(n)[::-1]))) & MASK64
    for t in tokens:
        h = (h * FNV + t + 1) & MASK64
    return h
