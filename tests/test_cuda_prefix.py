"""Prefix caching on the CUDA backend as on the CPU: on by default for a cuda serve, and (on a GPU) the CPU backend's
multi-turn case (tests/test_prefix_sessions.py) through the default arrangement: every warm turn hits, adopts the
drafter's carry, resumes past the previous prompt, and gives a cold run's tokens."""

from __future__ import annotations

import pytest
import torch
from test_prefix_sessions import check_no_leaks, config, run_script

from atlas.backends.cuda.tuning import Tuning
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.state.events import CarryAdopted, PrefixCacheHit


def test_a_cuda_serve_caches_prefixes_unless_told_not_to() -> None:
    import atlas.server.serve as serve_module

    real = serve_module.registry_build
    built: list = []

    def on_cpu(model, backend, config, *, trace=None, backend_options=None, seed=None):  # type: ignore[no-untyped-def]
        built.append(config)
        return real(model, backend, config, trace=trace, seed=seed,
                    backend_options={**(backend_options or {}), "device": "cpu", "cuda_graphs": False})

    serve_module.registry_build = on_cpu
    try:
        for flag, want in ((None, True), (False, False)):
            engine = serve_module.engine_for_serving(None, backend="cuda-fp32", max_seq_len=64, max_batch_size=2,
                                                     prefix_caching=flag)
            engine.close()
            assert built[-1].enable_prefix_caching is want
    finally:
        serve_module.registry_build = real


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_one_session_hits_and_adopts_every_warm_turn_through_the_default_arrangement() -> None:
    """tests/test_prefix_sessions.py's case on cuda-fp32 with the default arrangement named (fp32 alone would take
    the eager reference): compiled regions, the routed and attention kernels, prefill graphs."""
    tiny = load_model("atlas-tiny")
    engine = build_engine("atlas-tiny", "cuda-fp32", config(True, 2), loaded=tiny, sink=RecordingSink(),
                          full_audit=True, backend_options={"tuning": Tuning()})
    script = [(0, 0, False, [40, 41, 42], False), (0, 2, True, [43, 44], False), (0, 1, False, [45], False)]
    run_script(engine, script, [list(range(10, 40)), [5] * 6, [6] * 6])  # each turn a cold run's tokens
    check_no_leaks(engine)
    events = [e for _, _, e, _ in engine.sink.rows]  # type: ignore[union-attr]
    hits = [e for e in events if isinstance(e, PrefixCacheHit)]
    assert len(hits) == 2 and all(h.position >= 30 for h in hits)
    assert len([e for e in events if isinstance(e, CarryAdopted)]) == 2
