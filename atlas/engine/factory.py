"""Building an Engine: model + backend + capacities + (optionally) a trace whose run row lets a replay
rebuild exactly this engine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from atlas.config import Capacities, EngineConfig, derive_capacities, resolve_drafter_context

if TYPE_CHECKING:
    from atlas.engine.engine import Engine
    from atlas.engine.records import EventSink

TINY_MODEL = "atlas-tiny"


def open_trace(trace: str, *, model: str, fingerprint: str, backend: str, config: EngineConfig,
               caps: Capacities) -> EventSink:
    from atlas import __version__
    from atlas.replay.store import TraceWriter, git_revision

    return TraceWriter(trace, run={
        "engine_version": __version__, "git_revision": git_revision(), "model": model,
        "model_fingerprint": fingerprint, "backend": backend, "seed": None,
        "config": config.to_json(), "capacities": caps.table(),
    })


def build_engine(cls: type[Engine], model: str, backend: str, config: EngineConfig | None, trace: str | None,
                 **kwargs: Any) -> Engine:
    config = config or EngineConfig()
    if backend == "cpu":  # build_engine_for_loaded resolves the drafter-context switch
        from atlas.model import load_model

        return build_engine_for_loaded(cls, load_model(model), model=model, config=config, trace=trace, **kwargs)
    if backend.startswith("cuda"):  # cuda, cuda-fp32, cuda-invariant, cuda-fp32-invariant
        from atlas.backends.cuda.factory import build_cuda_engine
        from atlas.model import load_model

        return build_cuda_engine(cls, load_model(model), model=model, backend=backend, config=config, trace=trace,
                                 **kwargs)
    if backend != "null":
        raise ValueError(f"unknown backend {backend!r} (cpu, cuda[-fp32][-invariant], null)")
    config = resolve_drafter_context(config)
    from atlas.backends.null import ByteTokenizer, NullBackend

    model_name = TINY_MODEL if model == TINY_MODEL else Path(model).name
    fingerprint = f"null:{model_name}"
    caps = derive_capacities(config, None)
    sink = kwargs.pop("sink", None)
    if trace is not None:
        sink = open_trace(trace, model=model, fingerprint=fingerprint, backend=backend, config=config, caps=caps)
    engine = cls(NullBackend(), tokenizer=ByteTokenizer(), config=config, capacities=caps, model_name=model_name,
                 sink=sink, **kwargs)
    engine.model_fingerprint = fingerprint
    return engine


def build_engine_for_loaded(cls: type[Engine], loaded: Any, *, model: str, config: EngineConfig | None,
                            trace: str | None, dtype: Any = None, **kwargs: Any) -> Engine:
    from atlas.backends.cpu import CpuBackend

    config = resolve_drafter_context(config or EngineConfig())  # once, at start, before the trace's run row
    caps = derive_capacities(config, loaded.spec, activation_bytes=(dtype or loaded.dtype).itemsize)
    # speculative decoding: per-token intermediates for verifies of caps.verify_width rows, and the MTP
    # drafter's rows when it drafts
    data_plane = CpuBackend(loaded, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size, dtype=dtype,
                            ring_slots=caps.ring_slots, verify_width=caps.verify_width,
                            mtp_drafter=caps.drafter_rows > 0)
    sink = kwargs.pop("sink", None)
    if trace is not None:
        sink = open_trace(trace, model=model, fingerprint=loaded.fingerprint, backend="cpu", config=config,
                          caps=caps)
    engine = cls(data_plane, tokenizer=loaded.tokenizer, config=config, capacities=caps, spec=loaded.spec,
                 model_name=loaded.name, sink=sink, **kwargs)
    engine.model_fingerprint = loaded.fingerprint
    return engine
