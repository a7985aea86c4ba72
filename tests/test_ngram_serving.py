"""Serving a model whose n-gram tables exceed the n-gram budget: the CPU backend reads them through a row cache
smaller than the table (from the memory-mapped checkpoint for atlas-mini), and every token is the whole table's,
across eviction, batched or token by token, and on replay."""

from __future__ import annotations

import pytest
import torch

from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.engine.records import RecordingSink
from atlas.errors import CapacityError
from atlas.model import load_model
from atlas.model.ngram_rows import MmapRows, TensorRows
from atlas.registry import build_engine
from atlas.replay.verify import verify
from atlas.sampling.params import SamplingParams

# a step of at most 8 tokens: 8 x 4 n-gram heads = 32 slots a PLE layer, against ~8,200 rows of atlas-mini's tables
CONFIG = EngineConfig(max_seq_len=256, max_batch_size=2, prefill_chunk_tokens=8)
PROMPTS = [list(range(10, 50)), [7, 8, 9] * 9]
PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)]


@pytest.fixture(scope="module")
def mini():
    torch.set_num_threads(1)
    return load_model("atlas-mini"), load_model("atlas-mini", ngram_budget=0)


def _tokens(model, name: str, trace=None, **options) -> tuple[list[tuple[int, ...]], object]:
    engine = build_engine(name, "cpu", CONFIG, trace=trace, loaded=model,
                          sink=None if trace else RecordingSink(), backend_options=options)
    try:
        return [r.token_ids for r in generate(engine, PROMPTS, PARAMS)], engine.backend
    finally:
        engine.close()


@pytest.mark.parametrize("exact", [True, False])
def test_mini_through_the_mmap_cache_is_the_whole_table(mini, exact) -> None:
    whole, lazy = mini
    want, full = _tokens(whole, "atlas-mini", exact=exact)
    assert not full.ngram_caches
    got, cached = _tokens(lazy, "atlas-mini", exact=exact)
    assert got == want
    for name, table in cached.ngram_caches.items():
        assert isinstance(table.source, MmapRows)
        assert table.cache.slots == 32 < table.shape[0]
        assert table.cache.stats.evictions > 0 and table.cache.stats.hits > 0
        assert cached.weights[name] is table and name not in lazy.weights


def test_tiny_over_the_budget_is_cached_and_replays(tmp_path, monkeypatch) -> None:
    tiny = load_model("atlas-tiny")
    want, _ = _tokens(tiny, "atlas-tiny")
    trace = tmp_path / "cached.db"
    got, cached = _tokens(tiny, "atlas-tiny", trace=str(trace), ngram_budget=0)
    assert got == want
    assert cached.ngram_caches and all(isinstance(t.source, TensorRows) for t in cached.ngram_caches.values())
    assert all(t.cache.stats.evictions > 0 for t in cached.ngram_caches.values())
    assert verify(trace).identical  # replayed with the tables whole
    monkeypatch.setenv("ATLAS_NGRAM_BUDGET", "0")
    assert verify(trace).identical  # and through the cache again


def test_a_cache_below_its_floor_is_refused_at_load() -> None:
    tiny = load_model("atlas-tiny")
    with pytest.raises(CapacityError, match=r"ngram_cache_slots 31 is below its derived floor 32"):
        build_engine("atlas-tiny", "cpu", EngineConfig(max_batch_size=2, prefill_chunk_tokens=8,
                                                       ngram_cache_slots=31), loaded=tiny)


def test_a_cache_at_its_exact_floor_serves_chunks_of_the_whole_budget() -> None:
    """Whole chunks (exact=False) of max_batch_tokens tokens, each pinning up to 16 x 4 rows of 64 slots, prompts
    longer than two chunks: no step runs out of slots and every token is the whole table's."""
    tiny = load_model("atlas-tiny")
    config = EngineConfig(max_seq_len=128, max_batch_size=2, prefill_chunk_tokens=16, ngram_cache_slots=64)
    prompts = [list(range(40, 73)), list(range(100, 117))]
    params = [SamplingParams(max_tokens=10, ignore_eos=True)] * 2
    out = []
    for budget in (None, 0):
        engine = build_engine("atlas-tiny", "cpu", config, loaded=tiny, sink=RecordingSink(),
                              backend_options={"exact": False, "ngram_budget": budget})
        out.append([r.token_ids for r in generate(engine, prompts, params)])
        caches = engine.backend.ngram_caches
        engine.close()
    assert out[0] == out[1] and all(len(t) == 10 for t in out[1])
    assert all(t.cache.slots == 64 and t.cache.stats.evictions > 0 for t in caches.values())
