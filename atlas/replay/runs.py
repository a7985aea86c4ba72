"""Runs of step events in a stored trace, for replay check (atlas.state.column_runs applies them).

A run is consecutive codec-1 rows StepPlanned v3, StepExecuted v2, StepPlanned v3, ... whose plans name exactly the
batch the step columns hold, admit nothing, and whose executions have one token per sequence and no verdicts (the
byte layout in atlas.replay.codec). Everything else about them (steps, fed counts, allocations, tails) is checked
by apply_run, which gives the run back to the per-event path when any of it does not hold.
"""

from __future__ import annotations

import struct

import numpy as np

from atlas.replay.codec import CODEC

# fewer pairs than this go event by event: apply_run's fixed cost (~60 numpy calls) is about two pairs' worth of
# the per-event column path (measured on benchmarks/replay_check.py's trace)
MIN_RUN = 3

Row = tuple[int, int, str, int, "str | bytes", str]


def run_end(rows: list[Row], i: int, ids: tuple[int, ...]) -> int:
    """The end (exclusive) of the run of step pairs over the batch `ids` that starts at rows[i] (i itself when
    rows[i] does not start one)."""
    n = len(ids)
    try:
        head = struct.pack("<ii", 0, n) + np.array(ids, dtype="<i4").tobytes()  # len(admitted), len(seqs), seqs
    except (OverflowError, struct.error):  # an id past int32: such plans are stored as JSON anyway
        return i
    stop = 5 + len(head)  # the codec byte and the step come first
    executed = 1 + 4 * (n + 4)  # the codec byte, step, len(tokens), tokens, len(accepted) = 0, len(verdicts) = 0
    j = i
    end = len(rows) - 1
    while j < end:
        _, _, kind, version, p, _ = rows[j]
        if kind != "step_planned" or version != 3 or type(p) is not bytes or p[0] != CODEC or p[5:stop] != head:
            break
        _, _, kind, version, x, _ = rows[j + 1]
        if kind != "step_executed" or version != 2 or type(x) is not bytes or len(x) != executed or x[0] != CODEC:
            break
        j += 2
    return j
