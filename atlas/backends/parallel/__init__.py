"""Tensor and expert parallelism over torch.distributed: shard rules (shard), collectives (comm), the per-rank
forward (layers), the backend and worker loop (backend), sharded safetensors loading (load)."""

from atlas.backends.parallel.backend import TpBackend, worker_loop
from atlas.backends.parallel.comm import Comm
from atlas.backends.parallel.shard import TpLayout, local_spec, shard_weights

__all__ = ["Comm", "TpBackend", "TpLayout", "local_spec", "shard_weights", "worker_loop"]
