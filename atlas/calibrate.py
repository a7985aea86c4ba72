"""The host's own speed, for comparing control-plane figures across machines (no torch: the control-plane benchmark
runs without it, as the engine does)."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import numpy as np


def host_speed(clock: Callable[[], float] = time.perf_counter, rounds: int = 5) -> float:
    """Microseconds (best of `rounds`, by `clock`) of a fixed pure-Python and small-numpy workload shaped like a
    decode step's control plane (attribute reads and stores on slotted objects, tuple and dict building, a few small
    numpy calls over 64 rows): printed beside the figures, so a figure from another machine (the GPU host read ~3x
    this box's for the same code) can be told apart from a change of the code."""
    @attrs.define(slots=True)
    class Row:
        seq_id: int
        position: int
        token: int = 0

    rows = [Row(i, 100 + i) for i in range(64)]
    column = np.arange(64, dtype=np.int64)
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        for _ in range(200):
            for r in rows:
                r.position += 1
                r.token = r.position & 0xFF
            ids = tuple(r.seq_id for r in rows)
            index = {sid: i for i, sid in enumerate(ids)}
            column = (column * 31 + 7) & 0xFFFF
            if min(index) < 0 or int(column.sum()) < 0:
                raise AssertionError("unreachable")
        best = min(best, (clock() - t0) / 200 * 1e6)
    return best
