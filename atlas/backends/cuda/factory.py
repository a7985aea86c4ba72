"""Building an Engine on the CUDA backend: refuses, at start, a config asking for what it lacks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from atlas.config import EngineConfig, derive_capacities

if TYPE_CHECKING:
    from atlas.engine.engine import Engine


def check_config(config: EngineConfig) -> None:
    """Refuse, before any request runs, the features the CUDA backend does not support yet."""
    from atlas.backends.cuda.runner import unsupported

    if config.num_drafts:
        raise unsupported("speculative decoding", f"num_drafts=0 (got {config.num_drafts}; --num-drafts 0)")
    if config.ring_slots:
        raise unsupported("the snapshot ring for rollback", f"ring_slots=0 (got {config.ring_slots}; --ring-slots 0)")
    if getattr(config, "enable_prefix_caching", False):
        raise unsupported("prefix caching", "enable_prefix_caching=False (--no-prefix-caching)")


# the backend name is what a trace records, so it names the whole mode and a replay rebuilds the same one:
# "cuda" (bf16, fp32 recurrent state), "-fp32" the parity mode, "-invariant" batch-invariant decode
BACKENDS = ("cuda", "cuda-fp32", "cuda-invariant", "cuda-fp32-invariant")


def parse_backend(name: str) -> tuple[torch.dtype, bool]:
    """(activation dtype, batch invariant) of a CUDA backend name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown CUDA backend {name!r} ({', '.join(BACKENDS)})")
    return (torch.float32 if "-fp32" in name else torch.bfloat16), name.endswith("-invariant")


def build_cuda_engine(cls: type[Engine], loaded: Any, *, model: str, config: EngineConfig | None, trace: str | None,
                      backend: str = "cuda", device: str = "cuda", cuda_graphs: bool | None = None,
                      **kwargs: Any) -> Engine:
    """The engine on the CUDA backend in the mode `backend` names (BACKENDS)."""
    from atlas.backends.cuda.runner import CudaBackend
    from atlas.engine.factory import open_trace

    config = config or EngineConfig()
    check_config(config)
    dtype, invariant = parse_backend(backend)
    caps = derive_capacities(config, loaded.spec, activation_bytes=dtype.itemsize)
    data_plane = CudaBackend(loaded, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size, dtype=dtype,
                             max_batch_size=caps.max_batch_size, device=device, cuda_graphs=cuda_graphs,
                             batch_invariant=invariant, max_blocks_per_seq=caps.kv_blocks_per_seq)
    sink = kwargs.pop("sink", None)
    if trace is not None:
        sink = open_trace(trace, model=model, fingerprint=loaded.fingerprint, backend=backend, config=config, caps=caps)
    engine = cls(data_plane, tokenizer=loaded.tokenizer, config=config, capacities=caps, spec=loaded.spec,
                 model_name=loaded.name, sink=sink, **kwargs)
    engine.model_fingerprint = loaded.fingerprint
    return engine
