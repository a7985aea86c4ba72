"""The CUDA backend's n-gram row cache (atlas.backends.cuda.ngram): on the CPU device here (graphs off), on the
GPU under the `cuda` mark. Tokens through a cache smaller than the table are the whole table's: plain steps, the
wide and the row-by-row verify (n-gram drafts), the padded batch-invariant decode; one transfer a step at most."""

from __future__ import annotations

import pytest
import torch

from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

PROMPTS = [list(range(10, 50)), [7, 8, 9] * 9, list(range(200, 203))]
PARAMS = [SamplingParams(max_tokens=20, ignore_eos=True),
          SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=12, ignore_eos=True)]


@pytest.fixture(scope="module")
def mini():
    torch.set_num_threads(1)
    return load_model("atlas-mini"), load_model("atlas-mini", ngram_budget=0)


def _run(model, backend: str, config: EngineConfig, **options):
    engine = build_engine("atlas-mini", backend, config, loaded=model, sink=RecordingSink(), backend_options=options)
    try:
        return [r.token_ids for r in generate(engine, PROMPTS, PARAMS)], engine.backend, engine.stats()
    finally:
        engine.close()


CASES = [
    ("cuda-fp32", EngineConfig(max_seq_len=256, max_batch_size=3, prefill_chunk_tokens=12), {}),
    ("cuda-fp32", EngineConfig(max_seq_len=256, max_batch_size=3, prefill_chunk_tokens=12, num_drafts=2,
                               drafter="ngram"), {}),  # row-by-row verify: the host packs the slots
    ("cuda", EngineConfig(max_seq_len=256, max_batch_size=3, prefill_chunk_tokens=12, num_drafts=2,
                          drafter="ngram"), {}),  # bf16, the wide verify: ids through the remap
    ("cuda-fp32-invariant", EngineConfig(max_seq_len=256, max_batch_size=3, prefill_chunk_tokens=12), {}),
]


@pytest.mark.parametrize("backend,config,options", CASES, ids=["fp32", "fp32-verify-rows", "bf16-verify-wide",
                                                              "invariant"])
def test_device_cache_is_the_whole_table(mini, backend, config, options) -> None:
    whole, lazy = mini
    want, full, _ = _run(whole, backend, config, device="cpu", **options)
    assert full.ngram_cache is None
    got, cached, stats = _run(lazy, backend, config, device="cpu", **options)
    assert got == want
    cache = cached.ngram_cache
    assert cache.slots == 64 and cache.slots < min(s.shape[0] for s in cache.sources)  # 12 x 4 heads -> 64
    assert cache.stats.evictions > 0 and cache.stats.hits > 0
    assert 0 < cache.transfers <= stats.step  # one transfer a step at most (none when every row hits)
    if config.num_drafts:
        assert stats.spec_verify_steps > 0


def test_ids_read_through_the_remap_are_the_slots_the_host_assigned(mini) -> None:
    """ple.ngram_ids_from (the eager group's and the compiled prologue's ids) with the cache's remap gives, for
    every id, the slot the host's fill assigned to that row, and the slot holds the row's embedding."""
    from atlas.backends.cuda.ple import ngram_ids_from
    from atlas.backends.cuda.runner import CudaBackend
    from atlas.config import derive_capacities

    _, lazy = mini
    ple = lazy.spec.ple
    caps = derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=4, prefill_chunk_tokens=16), lazy.spec,
                             activation_bytes=4)
    backend = CudaBackend.for_capacities(lazy, caps, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(2)
    for _ in range(6):
        ctx = torch.randint(0, 4096, (4, ple.context_len), generator=gen)
        tokens = torch.randint(0, 4096, (4, 4), generator=gen)
        plain = ngram_ids_from(ctx, tokens, ple, [t[:3] for t in backend._ple_tables_dev])
        backend.ngram_cache.fill([plain[p].reshape(-1).numpy() for p in range(plain.shape[0])], tokens.numel())
        slots = ngram_ids_from(ctx, tokens, ple, backend._ple_tables_dev)
        for p, name in enumerate(backend.ngram_cache.names):
            want = backend.ngram_cache.caches[p].lookup(plain[p].numpy())
            assert torch.equal(slots[p], torch.from_numpy(want))
            rows = lazy.ngram_rows[name].gather(plain[p].reshape(-1).numpy()).float()
            assert torch.equal(backend.weights[name][slots[p].reshape(-1)], rows)
    assert backend.ngram_cache.stats.evictions > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_device_cache_on_the_gpu(mini) -> None:
    whole, lazy = mini
    config = EngineConfig(max_seq_len=256, max_batch_size=3, prefill_chunk_tokens=12, num_drafts=2, drafter="ngram")
    for backend in ("cuda", "cuda-invariant"):  # graphs, compiled decode regions, the wide verify
        want, _, _ = _run(whole, backend, config)
        got, cached, stats = _run(lazy, backend, config)
        assert got == want and cached.ngram_cache.stats.evictions > 0
        assert 0 < cached.ngram_cache.transfers <= stats.step
