"""The PLE n-gram row cache: a bounded set of slots in front of an n-gram table too large to hold whole.

`RowCache` is the bookkeeping alone (pure, deterministic, numpy; no tensors, no model): `assign(rows)` gives
every requested row a slot, pinning all of one call's rows at once, and says which slots must be filled from
the table (the misses) and which rows that evicts. Eviction is least-recently-used at call granularity, ties
broken by the lower slot; free slots are taken first, in order. The same sequence of calls gives the same
slots on every run and every backend, so a cache never changes a token: a slot's contents are always exactly
the table's row it holds.

`CachedTable` puts it in front of a row source (atlas.model.ngram_rows: the memory-mapped checkpoint) with
the slots as a tensor; the CPU backend indexes it like the table itself. The CUDA backend keeps its slots on
the device and uses `RowCache` the same way (atlas.backends.cuda.ngram).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from atlas.errors import CapacityError


@attrs.frozen
class Assignment:
    """One `assign` call's answer: `slots` (the shape of the requested rows), and the slots to fill now with
    the rows they hold from now on (`fill_slots`, `fill_rows`, ordered by row) and the rows evicted for them."""

    slots: np.ndarray
    fill_slots: np.ndarray
    fill_rows: np.ndarray
    evicted: np.ndarray


@attrs.define
class CacheStats:
    lookups: int = 0  # rows requested, duplicates within a call counted once
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class RowCache:
    """Which table row each of `slots` slots holds (see the module docstring)."""

    def __init__(self, slots: int, *, knob: str = "ngram_cache_slots") -> None:
        if slots < 1:
            raise CapacityError(f"{knob} must be >= 1, got {slots}")
        self.slots = slots
        self.knob = knob
        self.row_of = np.full(slots, -1, dtype=np.int64)  # the row each slot holds, -1 when free
        self.used = np.zeros(slots, dtype=np.int64)  # the call that last touched each slot (0: never)
        self._keys = np.empty(0, dtype=np.int64)  # resident rows, sorted
        self._vals = np.empty(0, dtype=np.int64)  # their slots
        self._filled = 0  # slots 0 .. _filled - 1 have held a row (free slots are taken in order first)
        self._tick = 0
        self.stats = CacheStats()

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """The slots of resident rows (no bookkeeping); a row that is not resident is an error."""
        rows = np.asarray(rows, dtype=np.int64)
        at = np.searchsorted(self._keys, rows.ravel())
        at = np.minimum(at, max(len(self._keys) - 1, 0))
        if not len(self._keys) or not np.array_equal(self._keys[at], rows.ravel()):
            raise KeyError("n-gram rows looked up that the cache does not hold (assign them first)")
        return self._vals[at].reshape(rows.shape)

    def assign(self, rows: np.ndarray) -> Assignment:
        """Slots for `rows` (any shape of row ids), all resident together when this returns."""
        rows = np.asarray(rows, dtype=np.int64)
        unique, inverse = np.unique(rows, return_inverse=True)
        if len(unique) > self.slots:
            raise CapacityError(f"{len(unique)} distinct n-gram rows in one call exceed the row cache's {self.slots} "
                                f"slots ({self.knob}: it must hold max_batch_tokens x n-gram heads)")
        self._tick += 1
        at = np.searchsorted(self._keys, unique)
        clipped = np.minimum(at, max(len(self._keys) - 1, 0))
        hit = (self._keys[clipped] == unique) if len(self._keys) else np.zeros(len(unique), dtype=bool)
        slot_of = np.empty(len(unique), dtype=np.int64)
        slot_of[hit] = self._vals[clipped[hit]]
        self.used[slot_of[hit]] = self._tick
        missing = unique[~hit]
        victims = self._victims(len(missing))
        evicted = self.row_of[victims]
        evicted = evicted[evicted >= 0]
        slot_of[~hit] = victims
        self.row_of[victims] = missing
        self.used[victims] = self._tick
        if len(evicted):  # the resident index stays sorted: out at the evicted rows' places, in at the new rows'
            gone = np.searchsorted(self._keys, evicted)
            self._keys, self._vals = np.delete(self._keys, gone), np.delete(self._vals, gone)
        if len(missing):  # (`missing` is sorted: np.unique's order)
            at = np.searchsorted(self._keys, missing)
            self._keys, self._vals = np.insert(self._keys, at, missing), np.insert(self._vals, at, victims)
        n = len(unique)
        self.stats.lookups += n
        self.stats.hits += n - len(missing)
        self.stats.misses += len(missing)
        self.stats.evictions += len(evicted)
        return Assignment(slot_of[inverse].reshape(rows.shape), victims, missing, evicted)

    def _victims(self, count: int) -> np.ndarray:
        """`count` slots for the call's new rows (which take them in row order): never-used slots in order, then
        the least recently used, lower slot first among equals; none of them touched by the current call (assign
        checked the call fits)."""
        fresh = min(count, self.slots - self._filled)
        taken = np.arange(self._filled, self._filled + fresh, dtype=np.int64)
        self._filled += fresh
        self.used[taken] = self._tick  # (assign marks them too; here so the partition below cannot pick them)
        rest = count - fresh
        if rest <= 0:
            return taken
        # the rest-th smallest last use: every slot below it, then the lowest slots equal to it
        kth = np.partition(self.used, rest - 1)[rest - 1]
        below = np.flatnonzero(self.used < kth)
        below = below[np.argsort(self.used[below], kind="stable")]  # least recent first, lower slot among equals
        equal = np.flatnonzero(self.used == kth)[: rest - len(below)]
        return np.concatenate([taken, below, equal])


class CachedTable:
    """An n-gram table served through a `RowCache`: `table[ids]` gathers the rows `ids` [n, heads] name, as
    indexing the whole table would, reading missed rows from `source` (anything with `gather(rows) ->
    Tensor`, `shape`) into the slots. `scratch_rows`: the most tokens one call may carry (ple_scratch_rows)."""

    def __init__(self, source: Any, slots: int, scratch_rows: int, convert: Any) -> None:
        self.source = source
        self.cache = RowCache(slots)
        self.scratch_rows = scratch_rows
        self.convert = convert  # the rows' dtype conversion, as the whole table's load would do it
        self.shape = tuple(source.shape)
        self.rows: torch.Tensor | None = None  # the slots [slots, dim], made on the first miss

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] > self.scratch_rows:
            raise CapacityError(f"PLE: {ids.shape[0]} tokens exceed the {self.scratch_rows} this layer was sized for "
                                "(ple_scratch_rows; its floor is max_batch_tokens)")
        got = self.cache.assign(ids.numpy())
        if len(got.fill_rows):
            rows = self.convert(self.source.gather(got.fill_rows))
            if self.rows is None:
                self.rows = torch.zeros((self.cache.slots, rows.shape[1]), dtype=rows.dtype)
            self.rows[torch.from_numpy(got.fill_slots)] = rows
        assert self.rows is not None
        return self.rows[torch.from_numpy(got.slots)]


def cached_tables(model: Any, dtype: torch.dtype, slots: int, scratch_rows: int,
                  budget: int | str | None = None) -> dict[str, CachedTable]:
    """The CPU backend's row caches, by table name (empty when every table is served whole): see
    atlas.model.ngram_rows.row_sources. Rows are converted as loading the whole table would (to the model's
    dtype, then the backend's), so a cached row is bitwise the whole table's."""
    from atlas.model.ngram_rows import row_sources

    sources = row_sources(model, dtype.itemsize, budget)
    if sources and (slots < 1 or scratch_rows < 1):
        raise CapacityError("an n-gram table served through the row cache needs ngram_cache_slots and "
                            "ple_scratch_rows (build the backend with for_capacities)")

    def convert(rows: torch.Tensor) -> torch.Tensor:
        return rows.to(model.dtype).to(dtype)

    return {name: CachedTable(src, slots, scratch_rows, convert) for name, src in sources.items()}
