"""One torch thread policy for every command, `atlas.LLM` and the benchmarks.

The order: an explicit `--threads N` (or `threads=N`), else `OMP_NUM_THREADS` when it is set (a user who set it
meant it), else the measured default for the path: `EXACT_DEFAULT` for the exact token-by-token CPU path (what
the engine, replay and `atlas.LLM` run) and `CHUNK_DEFAULT` for the whole-chunk path (benchmarks only).

Measured on the 2-core machine this project runs on, shared with other agents' jobs (load 2.5-3.5), atlas-tiny:
- the exact path feeds one token at a time, so every matmul is a matrix-vector product of a few microseconds and
  a second thread only adds a barrier per op that waits for a core the other jobs hold: `benchmarks/cpu_model.py`
  exact prefill 9.9 tok/s with torch's default 2 threads against 126 tok/s with 1 (decode 141 tok/s with 1; 2
  threads measured negative: the timings were dominated by stalls), and `atlas generate` of 270 tokens 4.8-50 s
  with 2 threads against 4.7-4.9 s with 1;
- the whole-chunk path's prefill is one [256, H] GEMM per op, large enough to split, yet 2 threads gave 2218
  prefill tok/s against 2186 with 1 (within the noise) and decode 117 against 127: not worth the oversubscription.
Rerun `benchmarks/cpu_model.py --threads N` on a bigger, idle machine before raising either default.
"""

from __future__ import annotations

import os

EXACT_DEFAULT = 1
CHUNK_DEFAULT = 1


class ThreadsError(ValueError):
    """`--threads` (or OMP_NUM_THREADS) is not a positive integer."""


def resolve_threads(threads: int | None = None, *, exact: bool = True, environ: dict | None = None) -> int:
    """The thread count to use: explicit, else OMP_NUM_THREADS, else the measured default for the path."""
    if threads is not None:
        if threads < 1:
            raise ThreadsError(f"--threads must be >= 1, got {threads}; 1 is the measured best on a small machine")
        return int(threads)
    env = os.environ if environ is None else environ
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ThreadsError(f"OMP_NUM_THREADS must be a positive integer, got {raw!r}; unset it or pass --threads N")
        return value
    return EXACT_DEFAULT if exact else CHUNK_DEFAULT


def apply_threads(threads: int | None = None, *, exact: bool = True) -> int:
    """Resolve the policy and size torch's intra-op pool with it; returns the count."""
    import torch

    n = resolve_threads(threads, exact=exact)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
