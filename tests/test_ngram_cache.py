"""The PLE n-gram row cache's bookkeeping (no model), its row sources (the memory-mapped checkpoint), and the
capacities that size it (ngram_cache_slots, ple_scratch_rows: derived, floors, overrides)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas.config import EngineConfig, check_ple_capacities, derive_capacities
from atlas.errors import CapacityError
from atlas.model import load_model
from atlas.model.ngram_cache import CachedTable, RowCache
from atlas.model.ngram_rows import MmapRows, TensorRows, lazy_tables, ngram_budget
from atlas.model.tiny import save


def test_free_slots_first_then_least_recently_used_lower_slot_first() -> None:
    cache = RowCache(4)
    assert cache.assign(np.array([40, 10, 30, 20])).slots.tolist() == [3, 0, 2, 1]  # misses take slots by row
    got = cache.assign(np.array([10]))  # row 10 (slot 0) touched: slots 1-3 are now the least recent
    assert got.slots.tolist() == [0] and not len(got.fill_rows)
    got = cache.assign(np.array([[50, 60], [50, 10]]))
    assert got.slots.tolist() == [[1, 2], [1, 0]]  # slots 1 and 2 (rows 20, 30): LRU, lower slot first
    assert got.fill_slots.tolist() == [1, 2] and got.fill_rows.tolist() == [50, 60]
    assert sorted(got.evicted.tolist()) == [20, 30]
    assert cache.lookup(np.array([60, 40])).tolist() == [2, 3]
    with pytest.raises(KeyError):
        cache.lookup(np.array([20]))
    assert (cache.stats.lookups, cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (8, 2, 6, 2)


def test_one_call_over_the_slots_names_both_numbers() -> None:
    cache = RowCache(8)
    cache.assign(np.arange(8))
    with pytest.raises(CapacityError, match=r"9 distinct n-gram rows .* 8 slots \(ngram_cache_slots"):
        cache.assign(np.arange(100, 109))
    cache.assign(np.arange(100, 108).repeat(3))  # duplicates count once


def _reference_lru(slots: int, calls: list[list[int]]) -> list[list[int]]:
    """A plain-Python model of the policy: free slots in order, then least recently used, lower slot first."""
    row_of: list[int | None] = [None] * slots
    used = [0] * slots
    out = []
    for tick, rows in enumerate(calls, start=1):
        where = {r: s for s, r in enumerate(row_of) if r is not None}
        for r in set(rows) & set(where):
            used[where[r]] = tick
        for r in sorted(set(rows) - set(where)):
            free = [s for s in range(slots) if row_of[s] is None]
            victim = free[0] if free else min((s for s in range(slots) if used[s] < tick), key=lambda s: (used[s], s))
            row_of[victim], used[victim] = r, tick
            where[r] = victim
        out.append([where[r] for r in rows])
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12).flatmap(lambda s: st.tuples(
    st.just(s), st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=s), min_size=1, max_size=25))))
def test_slots_follow_the_reference_policy_and_always_hold_their_rows(case) -> None:
    slots, calls = case
    cache = RowCache(slots)
    contents = np.full(slots, -1)
    for rows, want in zip(calls, _reference_lru(slots, calls), strict=True):
        got = cache.assign(np.array(rows))
        contents[got.fill_slots] = got.fill_rows
        assert got.slots.tolist() == want
        assert contents[got.slots].tolist() == rows  # every slot handed out holds the row asked for


def test_cached_table_is_the_table_across_eviction() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(500, 6, generator=gen).to(torch.bfloat16)
    cached = CachedTable(TensorRows(table), slots=24, scratch_rows=6, convert=lambda t: t.float())
    for _ in range(40):
        ids = torch.randint(0, 500, (int(torch.randint(1, 7, (1,), generator=gen)), 4), generator=gen)
        assert torch.equal(cached[ids], table[ids].float())
    assert cached.cache.stats.evictions > 0
    with pytest.raises(CapacityError, match=r"PLE: 7 tokens exceed the 6 .*ple_scratch_rows"):
        cached[torch.zeros(7, 4, dtype=torch.long)]


def test_mmap_rows_read_the_checkpoint(tmp_path) -> None:
    root = save(tmp_path / "tiny")
    whole = load_model(root)
    lazy = load_model(root, ngram_budget=0)
    tables = lazy_tables(root, whole.spec)
    assert set(tables) == set(lazy.ngram_rows) == {k for k in whole.weights if k.endswith("ngram_embedding.weight")}
    assert not set(lazy.ngram_rows) & set(lazy.weights)
    assert lazy.fingerprint == whole.fingerprint  # hashed from the file as if loaded
    for name, rows in tables.items():
        assert isinstance(rows, MmapRows) and rows.shape == tuple(whole.weights[name].shape)
        pick = np.array([0, rows.shape[0] - 1, 7, rows.shape[0] // 2, 7])  # across the split_ngram_parts shards
        assert torch.equal(rows.gather(pick).to(whole.dtype), whole.weights[name][torch.from_numpy(pick)])
    assert load_model(root, ngram_budget="1G").ngram_rows == {}


def test_budget_knob() -> None:
    assert ngram_budget("512M") == 512 << 20 and ngram_budget("2GiB") == 2 << 30 and ngram_budget(0) == 0
    assert ngram_budget(environ={"ATLAS_NGRAM_BUDGET": "1k"}) == 1024
    assert ngram_budget(environ={}) == 16 << 30
    with pytest.raises(CapacityError, match="ATLAS_NGRAM_BUDGET='lots'"):
        ngram_budget(environ={"ATLAS_NGRAM_BUDGET": "lots"})


def test_capacities_derive_the_cache_and_scratch() -> None:
    spec = load_model("atlas-tiny").spec
    heads = spec.ple.num_heads
    caps = derive_capacities(EngineConfig(max_batch_size=4, prefill_chunk_tokens=100), spec)
    assert (caps.ngram_heads, caps.ple_scratch_rows, caps.ngram_cache_slots) == (heads, 100, 512)  # 400 -> 2^9
    assert caps.table()["ngram_cache_slots"] == 512
    caps = derive_capacities(EngineConfig(prefill_chunk_tokens=100, ngram_cache_slots=400, ple_scratch_rows=150), spec)
    assert (caps.ngram_cache_slots, caps.ple_scratch_rows) == (400, 150)
    with pytest.raises(CapacityError, match=r"ngram_cache_slots 399 is below its derived floor 400"):
        derive_capacities(EngineConfig(prefill_chunk_tokens=100, ngram_cache_slots=399), spec)
    with pytest.raises(CapacityError, match=r"ple_scratch_rows 99 is below its derived floor 100"):
        derive_capacities(EngineConfig(prefill_chunk_tokens=100, ple_scratch_rows=99), spec)
    assert derive_capacities(EngineConfig(), None).ngram_cache_slots == 0  # no PLE, no cache
    check_ple_capacities(caps)
    with pytest.raises(CapacityError, match=r"ple_scratch_rows 99 is below its floor max_batch_tokens 100"):
        check_ple_capacities(attrs.evolve(caps, ple_scratch_rows=99))
    with pytest.raises(CapacityError, match=rf"ngram_cache_slots 10 is below its floor {100 * heads}"):
        check_ple_capacities(attrs.evolve(caps, ngram_cache_slots=10))


def test_the_seeds_widest_chunk_fits_the_derived_cache() -> None:
    """The seed's defect D-3: an 8,193-token chunk pins 8,193 x 16 rows, which 65,536 fixed slots could not hold; the
    slots derived from the same budget hold it, and a second such chunk evicts the first."""
    spec = {"layer_types": ["linear_attention"], "ple_layer_ids": [0], "ngram_size": 3, "heads_per_ngram": 8}
    caps = derive_capacities(EngineConfig(max_batch_size=1, prefill_chunk_tokens=8193), spec)
    assert (caps.ple_scratch_rows, caps.ngram_heads, caps.ngram_cache_slots) == (8193, 16, 262_144)
    rows = np.random.default_rng(0).choice(20_000_000 * 16, size=(2, 8193, 16), replace=False)
    with pytest.raises(CapacityError, match=r"131088 distinct n-gram rows in one call exceed the row cache's 65536"):
        RowCache(65_536).assign(rows[0])
    cache = RowCache(caps.ngram_cache_slots)
    for chunk in (rows[0], rows[1], rows[1][:100], rows[0]):
        got = cache.assign(chunk)
        assert np.array_equal(cache.row_of[got.slots], chunk)
    # the second chunk overflows the free slots by 32 (the first chunk's least recent rows go); the first chunk back
    # misses exactly those 32, evicting 32 of the second's rows the third call did not touch
    assert (cache.stats.evictions, cache.stats.misses) == (64, 2 * 131_088 + 32)
