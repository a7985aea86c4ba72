"""Typed row offsets, and the checks where an offset becomes an address.

A prefill chunk that continues a sequence starts at a row offset: the position of its first token, which the
KV block table turns into a flat slot, the paged kernels into a page and an in-page row, a state pool into a
pointer. A `RowOffset` is such an offset, told apart from a token count (how many rows) and from a byte
offset: adding or subtracting a count moves it (still a RowOffset), the difference of two offsets is a count,
and it does not multiply (a byte address is `offset.bytes(pitch)`, explicit). The engine's planner gives every
chunk it plans a RowOffset start (atlas.engine.planner), the backends pass it on (a hand-built chunk's int is
read as one), and each place it becomes an address checks it there (`slot_of`, `check_rows`; the paged attention wrapper and its CPU reference check the
rows their block tables must cover, `check_table_covers`).

The fault this guards against (a continuation chunk's operand at an offset computed in the wrong unit, aligned
for the first chunk only) is silent on the first chunk and fatal or wrong on the later ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_new, _add, _sub = int.__new__, int.__add__, int.__sub__


class RowOffset(int):
    """A row offset into one sequence's rows (a position used as an address). Immutable, an int for reading."""

    __slots__ = ()

    def __new__(cls, value: int) -> RowOffset:
        if isinstance(value, RowOffset):
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"a row offset is an integer >= 0, got {value!r}")
        return super().__new__(cls, value)

    @classmethod
    def at(cls, position: int) -> RowOffset:
        """The offset of a position the caller knows is an int >= 0 (the planner's cursors): no checks (~0.1 us)."""
        return _new(cls, position)

    def __add__(self, rows: Any) -> Any:  # type: ignore[override]
        if type(rows) is RowOffset:
            raise TypeError(f"row offsets {int(self)} and {int(rows)} do not add (an offset plus a count does)")
        value = _add(self, rows)
        if value is NotImplemented:  # a tensor, a float: theirs to handle (an int's result)
            return NotImplemented
        return _new(RowOffset, value) if value >= 0 else value

    __radd__ = __add__  # type: ignore[assignment]

    def __sub__(self, other: Any) -> Any:  # type: ignore[override]
        value = _sub(self, other)
        if value is NotImplemented or type(other) is RowOffset:
            return value  # two offsets: a count of rows
        return _new(RowOffset, value) if value >= 0 else value  # before row 0 is no row (a bound, a sentinel)

    def __mul__(self, other: Any) -> Any:  # type: ignore[override]
        raise TypeError(f"row offset {int(self)} times {other!r}: a byte address is offset.bytes(pitch)")

    __rmul__ = __mul__  # type: ignore[assignment]

    def bytes(self, pitch: int) -> int:
        """The byte offset of this row in a buffer whose rows are `pitch` bytes apart."""
        return int(self) * pitch

    def __repr__(self) -> str:
        return f"RowOffset({int(self)})"

    def __str__(self) -> str:  # f-strings and messages read it as the number
        return int.__repr__(self)


def check_rows(start: int, rows: int, table_blocks: int, block_size: int, *, what: str = "chunk") -> None:
    """Rows [start, start + rows) must lie inside a block table of `table_blocks` blocks of `block_size`. `start`
    is a RowOffset on the engine's path (tests/test_chunk_offsets.py checks every chunk arrives so); a bare int
    (a test's or a tool's hand-built chunk) is read as one, anything else is refused."""
    if isinstance(start, bool) or not isinstance(start, int):
        raise TypeError(f"{what}: a chunk's start {start!r} is not a row offset")
    if start < 0 or rows < 0:
        raise ValueError(f"{what}: rows [{start}, {start + rows}) start before row 0")
    if start + rows > table_blocks * block_size:
        raise ValueError(f"{what}: block table has {table_blocks} blocks; rows [{start}, {start + rows}) need "
                         f"{-(-(start + rows) // block_size)} of block_size {block_size}")


def slot_of(table: Sequence[int], row: int, block_size: int) -> int:
    """The flat KV slot of `row` through `table`: block table[row // block_size], row row % block_size in it."""
    check_rows(row, 1, len(table), block_size, what=f"row {row}")
    return table[row // block_size] * block_size + row % block_size


def check_table_covers(table_width: int, block_size: int, max_rows: int, *, what: str) -> None:
    """A kernel's block tables [B, table_width] must address every row up to `max_rows` (the host's bound on a
    sequence's rows): a row past the table would read or write another sequence's page."""
    if max_rows > table_width * block_size:
        raise ValueError(f"{what}: rows up to {max_rows} but the block tables address {table_width} blocks of "
                         f"{block_size} ({table_width * block_size} rows)")

