"""CUDA graphs for decode groups: one graph per `GroupShape` (batch bucket x key-block bucket x whether
QSA selection runs), replayed with a static input buffer.

Capture runs the forward for real, so it is warmed up and captured on an all-padding input (scratch state
slots, the scratch KV block): no live sequence's state is touched. The QSA-selected path is captured like
the dense one (it has no host synchronisation), so no decode falls back to eager because of QSA.

The keyed sampler (atlas.sampling.keyed) is captured too, one graph per (decode shape, sampler mode), reading
the decode graph's static logits and a static [B, COLUMNS] buffer of packed per-row parameters: a sampled
decode step is two replays, one host->device copy of the rows and one device->host copy of the tokens.
All-greedy steps use the argmax captured with the forward and run no sampler graph.

Prefill chunks (Tuning.prefill_graphs = "recurring") take the same machinery, a DecodeGraphs of their own over the
runner's prefill function: `Recurring` decides which chunk shapes are worth a capture (one fed before, at most
PREFILL_GRAPHS of them), and the runner copies a replay's outputs out at once (two chunks of one shape in a step
replay the same graph).

A wide verify's commit (selecting each slot's kept row) is captured per verify shape too (`CommitGraphs`), over the
static kept tensors of that shape's verify graph, padded with scratch slots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from atlas.backends.cuda.batch import GroupShape
from atlas.sampling.keyed import COLUMNS, RowBatch, Rows, sample


def bucket(n: int, smallest: int = 1) -> int:
    """The power of two >= n (at least `smallest`): shapes a graph is captured for."""
    b = smallest
    while b < n:
        b *= 2
    return b


PREFILL_GRAPHS = 16  # prefill chunk shapes captured at most (each holds its static input and outputs)


class Recurring:
    """The prefill chunk shapes replayed from a graph: a shape is captured the second time it is fed (a one-off
    prompt length never pays a capture's two warm-up runs), until `cap` shapes are held; then the rest run eagerly."""

    def __init__(self, cap: int = PREFILL_GRAPHS) -> None:
        self.cap = cap
        self.seen: Counter = Counter()
        self.graphed: set = set()

    def take(self, shape: GroupShape) -> bool:
        if shape in self.graphed:
            return True
        self.seen[shape] += 1
        if self.seen[shape] >= 2 and len(self.graphed) < self.cap:
            self.graphed.add(shape)
            return True
        return False


@attrs.define
class _Captured:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor  # static input [B, columns] int64
    logits: torch.Tensor  # static output [B, vocab]
    greedy: torch.Tensor  # static output [B] argmax


@attrs.define
class _CapturedSampler:
    graph: torch.cuda.CUDAGraph
    rows: torch.Tensor  # static input [B, COLUMNS] int64: the packed per-row parameters
    tokens: torch.Tensor  # static output [B] int64


class DecodeGraphs:
    """`run(packed, shape) -> logits [B, vocab]` captured per shape and replayed."""

    def __init__(self, run: Callable[[torch.Tensor, GroupShape], torch.Tensor], device: torch.device) -> None:
        self._run = run
        self._device = device
        self._graphs: dict[GroupShape, _Captured] = {}
        self._samplers: dict[tuple[GroupShape, str], _CapturedSampler] = {}
        self._pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time: one memory pool

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(self, shape: GroupShape, padding: torch.Tensor) -> _Captured:
        packed = padding.to(self._device)
        stream = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):  # warm-up off the capture: allocator and autotuning settle
            for _ in range(2):
                self._run(packed, shape)
        torch.cuda.current_stream(self._device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._run(packed, shape)
            greedy = torch.argmax(logits, dim=-1)
        captured = _Captured(graph, packed, logits, greedy)
        self._graphs[shape] = captured
        return captured

    def replay(self, shape: GroupShape, packed_host: torch.Tensor, padding: Callable[[GroupShape], torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, vocab], argmax [B]) of the rows in packed_host, from the graph for `shape`; `padding(shape)`
        packs the all-padding input a first capture runs on (called only then: a batch-64 step packed 64 scratch
        rows it never used)."""
        captured = self._graphs.get(shape) or self.capture(shape, padding(shape))
        captured.packed.copy_(packed_host, non_blocking=packed_host.is_pinned())
        captured.graph.replay()
        return captured.logits, captured.greedy

    def sample(self, shape: GroupShape, batch: RowBatch) -> torch.Tensor:
        """The keyed sampler's tokens [B] (device) for the logits the graph for `shape` last produced; `batch`
        holds one packed row per graph row (padding rows greedy)."""
        captured = self._graphs[shape]
        if not batch.sampled:
            return captured.greedy
        key = (shape, batch.mode)
        sampler = self._samplers.get(key) or self._capture_sampler(key, captured.logits, batch)
        sampler.rows.copy_(batch.packed, non_blocking=batch.packed.is_pinned())
        sampler.graph.replay()
        return sampler.tokens

    def _capture_sampler(self, key: tuple[GroupShape, str], logits: torch.Tensor, batch: RowBatch
                         ) -> _CapturedSampler:
        rows = torch.zeros(logits.shape[0], COLUMNS, dtype=torch.int64, device=self._device)
        rows.copy_(batch.packed)
        stream = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                sample(logits, Rows.unpack(rows, batch.sampled, batch.filtered))
        torch.cuda.current_stream(self._device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            tokens = sample(logits, Rows.unpack(rows, batch.sampled, batch.filtered))
        self._samplers[key] = sampler = _CapturedSampler(graph, rows, tokens)
        return sampler


def commit_inputs(batch: int, slots: Sequence[int], rows: Sequence[int], scratch: Sequence[int]) -> torch.Tensor:
    """A commit graph's static input [2, batch] (host int64): the committed slots and their kept rows (1-based), padded
    with scratch slots keeping row 1 (a scratch slot's state is nobody's: writing it is harmless)."""
    pad = batch - len(slots)
    if pad < 0:
        raise ValueError(f"{len(slots)} commits for a verify group of {batch} rows")
    return torch.tensor([[*slots, *scratch[:pad]], [*rows, *[1] * pad]], dtype=torch.int64)


class CommitGraphs:
    """The wide verify's commit selection (DevicePools.inter_load from the kept tensors: a gather and a write a state,
    ~85 launches for a 2.7B model) captured per verify shape and replayed as one launch. Each reads the static kept
    tensors of its shape's verify graph (the runner's _kept_out[shape], in pools.kept when it replays)."""

    def __init__(self, pools: Any, device: torch.device) -> None:
        self._pools, self._device = pools, device
        self._graphs: dict[GroupShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __len__(self) -> int:
        return len(self._graphs)

    def load(self, shape: GroupShape, slots: Sequence[int], rows: Sequence[int]) -> None:
        """state[slots[b]] = the state after rows[b] rows of the verify last replayed for `shape`, with its stamps."""
        host = commit_inputs(shape.batch, slots, rows, self._pools.scratch_slots)
        graph, inputs = self._graphs.get(shape) or self._capture(shape)
        inputs.copy_(host.pin_memory(), non_blocking=True)
        graph.replay()

    def _capture(self, shape: GroupShape) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # warmed up and captured on scratch slots only (the warm-up runs for real)
        inputs = commit_inputs(shape.batch, [], [], self._pools.scratch_slots).to(self._device)
        stream = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._pools.inter_load(inputs[0], inputs[1])
        torch.cuda.current_stream(self._device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._pools.inter_load(inputs[0], inputs[1])
        self._graphs[shape] = (graph, inputs)
        return graph, inputs
