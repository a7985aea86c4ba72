"""`TpBackend`: the CUDA backend's data plane split over `tp` ranks (torch.distributed), one scheduler.

Rank 0 owns the engine (the control plane, the journal, the trace) and a TpBackend; every other rank runs
`worker_loop` over its own TpBackend. Each call rank 0's engine makes into the data plane that computes
(`execute`, `forward`, `forward_hidden`) is first broadcast as a command (the StepPlan or the chunks,
pickled, over the gloo control group), then every rank runs it: the same orders, the same groups in the same
order, the same collectives. Per-sequence bookkeeping (slots, positions, PLE context) is the CudaBackend's,
identical on every rank because every rank ran the same commands; the tensors (weights, KV heads, GDN heads'
conv and recurrent state) are the rank's shard. Only rank 0 samples (every rank holds the gathered logits; the
other ranks' StepResults are dropped). Capabilities are the CUDA backend's (no verify, ring or prefix
snapshots), so the engine refuses those configurations at start, as it does for "cuda".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from atlas.backends.base import ChunkLike
from atlas.backends.cuda.batch import GroupShape
from atlas.backends.cuda.ple import ple_context_update
from atlas.backends.cuda.runner import CudaBackend
from atlas.backends.cuda.tuning import EAGER
from atlas.backends.parallel.comm import Comm
from atlas.backends.parallel.layers import VocabParallelHead, tp_forward_group
from atlas.backends.parallel.shard import TpLayout, local_spec, shard_weights, vocab_range
from atlas.config import Capacities
from atlas.model.loaded import LoadedModel
from atlas.model.spec import ModelSpec
from atlas.plan import SeqWork, StepPlan, StepResult

STOP = ("stop",)


class TpBackend(CudaBackend):
    """A CudaBackend on one rank's shard. Build it with `TpBackend.from_full` (slice a whole model in memory) or
    `TpBackend.from_shard` (a shard read by atlas.backends.parallel.load.load_shard)."""

    def __init__(self, full_spec: ModelSpec, shard: dict[str, torch.Tensor], model: LoadedModel, layout: TpLayout,
                 comm: Comm, **kwargs: Any) -> None:
        if kwargs.get("cuda_graphs"):
            # capturing NCCL collectives in the decode graphs is not built: eager decode under TP
            raise ValueError("cuda_graphs=True is not supported under tensor parallelism (cuda_graphs False)")
        kwargs["cuda_graphs"] = False
        self.full_spec, self.layout, self.comm = full_spec, layout, comm
        self.first_id = vocab_range(full_spec, layout)[0]
        local = LoadedModel(name=model.name, spec=local_spec(full_spec, layout), weights=shard,
                            tokenizer=model.tokenizer, fingerprint=model.fingerprint, dtype=model.dtype)
        if kwargs.get("mtp_drafter"):
            raise ValueError("mtp_drafter=True is not supported under tensor parallelism (the drafter is not sharded: "
                             "use the n-gram drafter)")
        kwargs.setdefault("name", f"cuda-tp{layout.tp}")
        default = "tuning" not in kwargs
        super().__init__(local, **kwargs)
        if default:  # tp_forward_group is the layer stack (no regions): the reference, prefill MoE as CudaBackend's
            self.tuning = attrs.evolve(EAGER, moe_kernels=self.gdn_kernel is not None)
        # every `hidden @ weights["lm_head.weight"].T` of the CudaBackend becomes the vocab-parallel product
        self.weights["lm_head.weight"] = VocabParallelHead(  # type: ignore[assignment]
            self.weights["lm_head.weight"], full_spec.vocab_size, comm)

    @classmethod
    def from_full(cls, model: LoadedModel, layout: TpLayout, comm: Comm, **kwargs: Any) -> TpBackend:
        return cls(model.spec, shard_weights(model.spec, model.weights, layout), model, layout, comm, **kwargs)

    @classmethod
    def for_capacities(cls, model: LoadedModel, caps: Capacities, *, layout: TpLayout, comm: Comm,  # type: ignore[override]
                       dtype: torch.dtype | None = None, **kwargs: Any) -> TpBackend:
        """CudaBackend.for_capacities on rank's shard. snapshot_bytes is left unchecked (0): Capacities derive
        the whole model's ring slot, a rank holds its heads' share of it."""
        return cls.from_full(model, layout, comm, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size,
                             dtype=dtype, max_batch_size=caps.max_batch_size, max_blocks_per_seq=caps.kv_blocks_per_seq,
                             ring_slots=caps.ring_slots, verify_width=caps.verify_width, **kwargs)

    # -- the math: CudaBackend's hooks, on the shard, with collectives --------------------------------

    def _run_group(self, packed: torch.Tensor, shape: GroupShape) -> torch.Tensor:
        """CudaBackend._run_group with the rank's forward (tp_forward_group) in place of forward_group."""
        grp = self._group(packed, shape)
        hidden = tp_forward_group(self.spec, self.weights, self.pools, grp, self.layout, self.comm, self.first_id,
                                  eager_moe=shape.width > 1 and not shape.pending and self.prefill_moe == "grouped",
                                  gdn_kernel=self.gdn_kernel)
        if self.pools.ple_context_len:
            ple_context_update(self.pools, grp)
        return hidden

    def _sample(self, work: Sequence[SeqWork], logits: dict[int, torch.Tensor]) -> dict:
        if self.layout.rank == 0:
            return super()._sample(work, logits)
        # a worker's StepResult is dropped: no sampling of plain rows, no device->host copy. (Verify rows are
        # judged in run_verifies on every rank, from the same gathered logits: every rank commits the same count.)
        return {}

    # -- one scheduler: rank 0's calls are broadcast, then run everywhere -----------------------------

    def _command(self, command: tuple[Any, ...]) -> Any:
        if self.layout.rank == 0:
            self.comm.broadcast_command(command)
        return self.run_command(command)

    def run_command(self, command: tuple[Any, ...]) -> Any:
        """Run one command on this rank (rank 0 after broadcasting it, a worker after receiving it)."""
        kind, *args = command
        method = _COMMANDS.get(kind)
        if method is None:
            raise ValueError(f"unknown tensor-parallel command {kind!r} ({', '.join(_COMMANDS)})")
        self._depth += 1  # calls CudaBackend makes inside (forward -> forward_hidden) are not broadcast again
        try:
            return method(self, *args)
        finally:
            self._depth -= 1

    def execute(self, plan: StepPlan) -> StepResult:
        return self._command(("execute", plan))

    def forward(self, chunks: Sequence[ChunkLike]) -> list[torch.Tensor]:
        return self._command(("forward", [_plain(c) for c in chunks]))

    def forward_hidden(self, chunks: Sequence[ChunkLike]) -> list[torch.Tensor]:
        if self._inside:  # CudaBackend.forward calls it: already broadcast
            return CudaBackend.forward_hidden(self, chunks)
        return self._command(("forward_hidden", [_plain(c) for c in chunks]))

    def release(self, seq_id: int) -> None:
        if self._inside:  # run_orders inside execute
            return CudaBackend.release(self, seq_id)
        return self._command(("release", seq_id))

    def reset(self, seq_id: int) -> None:
        if self._inside:
            return CudaBackend.reset(self, seq_id)
        return self._command(("reset", seq_id))

    _depth = 0
    last_error: str | None = None  # a worker's last failed command (rank 0 reported the same)

    @property
    def _inside(self) -> bool:
        return self._depth > 0

    def close(self) -> None:
        """Rank 0: tell every worker to leave its loop."""
        if self.layout.rank == 0 and self.layout.tp > 1:
            self.comm.broadcast_command(STOP)


_COMMANDS: dict[str, Any] = {
    "execute": CudaBackend.execute,
    "forward": CudaBackend.forward,
    "forward_hidden": CudaBackend.forward_hidden,
    "release": CudaBackend.release,
    "reset": CudaBackend.reset,
}


class _Chunk:
    """A picklable chunk (SeqWork or any ChunkLike reduced to its four fields)."""

    __slots__ = ("seq_id", "tokens", "start", "block_table")

    def __init__(self, seq_id: int, tokens: tuple[int, ...], start: int, block_table: tuple[int, ...]) -> None:
        self.seq_id, self.tokens, self.start, self.block_table = seq_id, tokens, start, block_table

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.seq_id, self.tokens, self.start, self.block_table)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.seq_id, self.tokens, self.start, self.block_table = state


def _plain(c: ChunkLike) -> _Chunk:
    return _Chunk(int(c.seq_id), tuple(int(t) for t in c.tokens), int(c.start), tuple(int(b) for b in c.block_table))


def worker_loop(backend: TpBackend) -> int:
    """Ranks 1..tp-1: run every command rank 0 broadcasts until it says stop; how many were run. An error in a
    command is the same error rank 0 meets (same state, same command, checked before any collective), so the
    worker drops it and waits for the next command, as rank 0's engine goes on to the next step."""
    if backend.layout.rank == 0:
        raise ValueError("worker_loop runs on ranks 1..tp-1; rank 0 owns the engine")
    done = 0
    while True:
        command = backend.comm.broadcast_command()
        if command == STOP:
            return done
        try:
            backend.run_command(command)
        except Exception as exc:  # rank 0 meets and reports the same error
            backend.last_error = f"{type(exc).__name__}: {exc}"
        done += 1
