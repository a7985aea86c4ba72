"""One torch thread policy for every command, `atlas.LLM` and the benchmarks.

The order: an explicit `--threads N` (or `threads=N`), else `OMP_NUM_THREADS` when it is set (a user who set it
meant it), else the measured default for the path: `EXACT_DEFAULT` for the exact token-by-token CPU path (what
the engine, replay and `atlas.LLM` run) and `CHUNK_DEFAULT` for the whole-chunk path (benchmarks only).

Measured on the 2-core machine this project runs on, shared with other agents' jobs (backend-level
timings of CpuBackend.forward, then whole commands), atlas-tiny unless said:
- the exact path feeds one token at a time, so every matmul is a matrix-vector product of a few microseconds and a
  second thread only adds a barrier per op that waits for a core another job holds. Threads 1 vs 2, interleaved,
  3 rounds at load 2.1-2.6: exact prefill 115/147/123 vs 10/142/123 tok/s, decode 120/140/117 vs 20/132/120; a
  hidden-512 variant: prefill 46/71/76 vs 12/72/66, decode 41/75/75 vs 66/70/51. Two threads won one of twelve
  pairs (66 vs 41) and lost 4-11x whenever the other core was taken;
- the whole-chunk path (benchmarks only) runs one [256, H] GEMM per op: 1597/2086/2069 vs 79/1859/1965 prefill
  tok/s on atlas-tiny, 986/1005/1056 vs 87/1175/1140 on the hidden-512 variant: at best +12%, at worst 11x slower.
- whole commands, default threads before (torch's 2) and after (1), interleaved, 3 rounds at load 7-9, 3-9 and
  2-3: `atlas generate` of 270 tokens 122/205/66 s -> 21/14/8 s; `replay verify` of a served trace (16
  requests, 330 events) >900 (killed)/>900/354 s -> 78/60/27 s; `benchmarks/cpu_model.py` 633/424/28 s ->
  78/32/36 s (on the quietest round 2 threads were no worse: the gain is the collapse avoided, not speed).
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
