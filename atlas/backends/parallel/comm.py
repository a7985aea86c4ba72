"""The collectives a tensor-parallel step makes, through torch.distributed, and the plan channel.

Two process groups: the compute group (NCCL on GPUs, gloo on CPUs) carries the all-reduces at the row-parallel
outputs and the vocab-parallel embedding, and the all-gather of the logits; a gloo group carries the commands
rank 0 broadcasts (pickled StepPlans), so a plan never goes through device memory. Every rank makes the same
collectives in the same order (the same groups, layers and ops), which is what keeps ranks in step and a
row's result independent of what else the step runs (each all-reduce sums the same ranks' values elementwise).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist


class Comm:
    """The world's collectives for one rank; tp == 1 makes every collective the identity (no process group)."""

    def __init__(self, tp: int, rank: int, *, control: Any = None) -> None:
        self.tp, self.rank = tp, rank
        self.control = control  # the gloo group for commands (None: the default group is gloo already)
        self.timed = False  # benchmark only: synchronise around each collective and sum its time
        self.seconds = 0.0
        self.calls = 0
        self.command_seconds = 0.0  # rank 0's time broadcasting commands (pickle + two gloo broadcasts), always on

    @classmethod
    def from_world(cls) -> Comm:
        """The initialised default group; a gloo side group for commands when the default is not gloo."""
        backend = dist.get_backend()
        control = None if backend == "gloo" else dist.new_group(backend="gloo")
        return cls(dist.get_world_size(), dist.get_rank(), control=control)

    def _sync(self, t: torch.Tensor) -> None:
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (every rank gets the same bits: the sum of the same values)."""
        if self.tp == 1:
            return t
        t = t.contiguous()
        start = self._start(t)
        dist.all_reduce(t)
        self._stop(t, start)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` concatenated along the last dim, in rank order."""
        if self.tp == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        start = self._start(t)
        dist.all_gather(parts, t)
        self._stop(t, start)
        return torch.cat(parts, dim=-1)

    def _start(self, t: torch.Tensor) -> float:
        if not self.timed:
            return 0.0
        self._sync(t)
        return time.perf_counter()

    def _stop(self, t: torch.Tensor, start: float) -> None:
        if self.timed:
            self._sync(t)
            self.seconds += time.perf_counter() - start
            self.calls += 1

    # -- the command channel (rank 0 -> every rank) ----------------------------------------------------

    def broadcast_command(self, command: Any = None) -> Any:
        """Rank 0 sends `command` (pickled: StepPlans and chunks are attrs values of plain ints); every other
        rank receives and returns it. Two gloo broadcasts: the length, then the bytes (none at tp 1)."""
        if self.tp == 1:
            return command
        start = time.perf_counter()
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        if self.rank == 0:
            self.command_seconds += time.perf_counter() - start
            return command
        return pickle.loads(payload.numpy().tobytes())
