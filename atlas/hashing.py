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


def roll_tokens(h: int, tokens: Iterable[int]) -> int:
    """The sequence's rolling token hash (a multiply-add over 64 bits, FNV's prime), kept incrementally for
    the digest: h' = h * 0x100000001B3 + t + 1 (mod 2^64) per token."""
    for t in tokens:
        h = (h * 0x100000001B3 + t + 1) & MASK64
    return h
