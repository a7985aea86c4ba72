"""The CUDA backend's host work in a decode step, measured without a GPU (issue 15: on the H200 ~1 ms of a
batch-64 step's `execute` is host work before the graph launch and after its token copy, none of it overlapped).

    OMP_NUM_THREADS=1 python benchmarks/backend_host.py [--batches 1,16,64] [--steps 180] [--seeded] [--profile] [--general]
    OMP_NUM_THREADS=1 valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce \
        --callgrind-out-file=/tmp/cg.out python benchmarks/backend_host.py --batches 64 --steps 20 --callgrind

Not a test: it prints figures. CudaBackend (cuda-fp32 on CPU tensors, atlas-tiny) with its decode graphs stood in
for by a stub whose replay and sampler return static tensors at once: every host step of `execute` runs as on
the GPU (plan checks, the packed group, the sampler rows, the stamp read's launch and read, the outcomes), the
device work does not. Plans are built by hand (no engine: nothing checks the stamps the stub does not move).
Printed per batch: microseconds of process time per `execute` (best of 5 rounds) and, with --profile, the
functions by own time. Its decode steps are steady (atlas/backends/cuda/steady.py); --general runs them the general
way (`backend.steady = None`), the reference path's cost. The figures include the harness's own plan building
(~15 us of a b64 step here: 64 SeqWork objects).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class StubGraphs:
    """DecodeGraphs' interface with no device work: static logits, argmax and tokens of the shape's batch."""

    def __init__(self, backend) -> None:  # type: ignore[no-untyped-def]
        self.backend = backend
        self.out: dict = {}

    def __len__(self) -> int:
        return len(self.out)

    def replay(self, shape, packed_host, padding):  # type: ignore[no-untyped-def]  # padding: a callable
        if shape not in self.out:
            b, vocab, hidden = shape.batch, self.backend.spec.vocab_size, self.backend.spec.hidden_size
            self.out[shape] = (torch.zeros(b, vocab), torch.zeros(b, dtype=torch.int64),
                               torch.zeros(b, hidden), torch.empty(b, packed_host.shape[1], dtype=torch.int64))
        logits, greedy, last, static = self.out[shape]
        static.copy_(packed_host)
        self.backend._hidden_out[shape] = last
        return logits, greedy

    def sample(self, shape, batch):  # type: ignore[no-untyped-def]
        return self.out[shape][1]


def measure(batch: int, steps: int, seeded: bool, profile: bool, callgrind: bool = False, sort: str = "tottime",
            general: bool = False) -> float:
    from atlas.backends.cuda import CudaBackend
    from atlas.model import load_model
    from atlas.plan import SeqWork, StepPlan
    from atlas.sampling.params import SamplingParams

    tiny = load_model("atlas-tiny")
    blocks = -(-(16 + steps * 6) // 16)
    backend = CudaBackend(tiny, num_kv_blocks=blocks * batch + 1, block_size=16, dtype=torch.float32, device="cpu",
                          max_batch_size=batch, cuda_graphs=False, max_blocks_per_seq=blocks)
    backend.graphs = StubGraphs(backend)
    if general:
        backend.steady = None
    # the stamp read's summary is a graph replay on the GPU (device work): computed once per shape here, as a
    # graph's static output (the rows keep their first values, so the read's cursor cache always hits)
    reader, summaries = backend.store.reader, {}
    real_summary = reader._summary

    def summary(hi: int, width: int, *, delta: bool) -> torch.Tensor:
        key = (hi, width)
        if key not in summaries:
            summaries[key] = real_summary(hi, width, delta=delta)
        return summaries[key]

    reader._summary = summary
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i) if seeded else SamplingParams()
              for i in range(batch)]
    tables = [tuple(range(blocks * i, blocks * (i + 1))) for i in range(batch)]
    backend.execute(StepPlan(0, tuple(SeqWork(i, tuple(range(1, 17)), 0, tables[i], True, params[i])
                                      for i in range(batch))))
    position = [16] * batch
    step = 1

    def run(n: int) -> float:
        nonlocal step
        t0 = time.process_time()
        for _ in range(n):
            plan = StepPlan(step, tuple(SeqWork(i, (7,), position[i], tables[i], True, params[i])
                                        for i in range(batch)))
            backend.execute(plan)
            for i in range(batch):
                position[i] += 1
            step += 1
        return (time.process_time() - t0) / n * 1e6

    run(10)
    if callgrind:  # instructions of `steps` steps: valgrind --tool=callgrind --collect-atstart=no
        # --toggle-collect=functools_reduce (nothing in a step calls functools.reduce)
        functools.reduce(lambda a, b: run(steps), [0, 1])
        return 0.0
    per_round = max(1, steps // 6)
    best = min(run(per_round) for _ in range(5))
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        run(per_round)
        prof.disable()
        pstats.Stats(prof).sort_stats(sort).print_stats(24)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--seeded", action="store_true", help="temperature 0.8, top_p 0.95, a seed per row")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--general", action="store_true", help="every step by execute's general path (no steady step)")
    parser.add_argument("--smoke", action="store_true", help="batches 1,4 and 12 steps (CI: it runs to the end)")
    parser.add_argument("--callgrind", action="store_true", help="run --steps steps inside functools.reduce (the "
                        "toggle for valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce)")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.steps = "1,4", 12
    torch.set_num_threads(1)
    print(f"| batch | execute host us / step ({'seeded' if args.seeded else 'greedy'}, process time, best of 5) |")
    print("|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        us = measure(batch, args.steps, args.seeded, args.profile, args.callgrind, general=args.general)
        print(f"| {batch} | {us:.0f} |", flush=True)


if __name__ == "__main__":
    main()
