"""The CPU backend's verify cost model, measured: a speculative step's time over a plain decode step's, per draft
count, for the draft-count policy (atlas.engine.drafters.policy). The backend runs sequences one after another,
so the ratio is the same at every batch: one row, measured at batch 1.

Each is timed on a scratch sequence (its own KV pool, never the engine's): a decode is a one-row forward, its
logits and the drafter's one appended key; a step of k drafts is the (k + 1)-row verify pass, its k + 1 logits,
the drafter's commit pass (half the drafts kept, plus the first draft's row) and its k - 1 further drafts.
Alternated, the median of `reps` after one unmeasured round, in this process's CPU time (the wall clock
of a shared machine counts the other processes too).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from atlas.backends.cpu.decoder import forward_chunk, forward_rows
from atlas.backends.cpu.state import KvPool, SequenceState
from atlas.sampling.params import SamplingParams

_CONTEXT = 32  # scratch tokens before the measured step
# a whole engine step (verify, drafting, commit, the engine's own work) over a plain decode step, for 1..8 drafts,
# on atlas-mini: TPOT with k drafts x tokens per verify / TPOT off, every step verifying k drafts, the mean of two
# runs of (on the shared 2-core dev box, other work beside it; the two runs' k = 2 entries were 1.72 and 1.97)
#   OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mini_tpot.py --backend cpu --batches 1 \
#       --drafts 1,2,3,4,5,6,7,8 --static --repeats 5   (and --repeats 7)
# The CPU backend's default cost model: fixed, so the policy's choices are a function of the run's inputs alone
STEP_COSTS = (1.50, 1.84, 2.13, 2.34, 2.52, 2.74, 3.03, 3.37)


def measure_verify_costs(backend: Any, num_drafts: int, reps: int = 3) -> tuple[tuple[int, tuple[float, ...]], ...]:
    spec, w, dtype, drafter = backend.spec, backend.weights, backend.dtype, backend.drafter
    width = num_drafts + 1
    blocks = -(-(_CONTEXT + width + 1) // 16)
    kv = KvPool(spec, blocks, 16, dtype)
    table = tuple(range(blocks))
    ids = torch.arange(_CONTEXT + width + 1) % (spec.vocab_size - 4) + 4
    hidden, state = forward_chunk(spec, w, kv, SequenceState.empty(spec, dtype), ids[:_CONTEXT], 0, table)
    draft = None
    if drafter is not None:
        draft = drafter.empty()
        drafter.append(draft, 0, ids[:_CONTEXT].tolist(), hidden)
    greedy = SamplingParams(temperature=0.0)

    def decode() -> None:
        h, _ = forward_chunk(spec, w, kv, state, ids[_CONTEXT : _CONTEXT + 1], _CONTEXT, table)
        backend.logits_from_hidden(h[-1])
        if draft is not None:
            drafter.append(draft, _CONTEXT, ids[_CONTEXT : _CONTEXT + 1].tolist(), h)
            drafter.rewind(draft, _CONTEXT)

    def step(k: int) -> Callable[[], None]:
        def run() -> None:
            h, _ = forward_rows(spec, w, kv, state, ids[_CONTEXT : _CONTEXT + k + 1], _CONTEXT, table)
            backend.logits_from_hidden(h)
            if draft is not None:
                kept = k // 2 + 1
                drafter.append(draft, _CONTEXT, ids[_CONTEXT : _CONTEXT + kept].tolist(), h[:kept], then=5)
                drafter.propose(draft, 5, k, greedy)
                drafter.rewind(draft, _CONTEXT)
        return run

    runs = [decode, *(step(k) for k in range(1, num_drafts + 1))]
    times: list[list[float]] = [[] for _ in runs]
    for rep in range(reps + 1):
        for run, out in zip(runs, times, strict=True):
            t0 = time.process_time()
            run()
            if rep:
                out.append(time.process_time() - t0)
    base = statistics.median(times[0])
    return ((1, tuple(round(statistics.median(t) / base, 3) for t in times[1:])),)
