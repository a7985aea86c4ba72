"""Per-step cost of the keyed sampler (atlas.sampling.keyed.sample) against a plain argmax, at decode batch sizes.

    python3 benchmarks/sampling.py [--device cpu|cuda] [--vocab 65536] [--batches 1,16,64] [--smoke]
                                   [--no-graph] [--torch-ops] [--json PATH]

Cases per batch: `argmax` (what a greedy decode step costs today), the keyed sampler on all-greedy rows,
temperature 0.8 (no sort), temperature 0.8 + top_p 0.95 (the sort path), + top_k 50 + min_p 0.05, and
temperature 0.8 + top_p 0.95 with 5 top logprobs. On CUDA every case is captured in a CUDA graph (as the
decode step replays it; --no-graph times eager launches) and timed by CUDA events; the draw is the fused
kernel atlas_kernels.keyed_sample unless --torch-ops (ATLAS_SAMPLER_KERNEL=0: the torch reference ops, to see
what the fusion buys). On the CPU times are by
perf_counter. Times are medians in ms per step. `host rows` is the host's share: packing the B rows'
parameters (RowBatch.of), which the GPU path pays on the CPU before its one host->device copy. The goal of issue 15 ("seeded sampling within 5% of greedy
ms/step") compares `sampled - argmax` here with the greedy decode step of `benchmarks/gpu_run.sh`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from atlas.sampling.keyed import RowBatch, Rows, logprobs, sample
from atlas.sampling.params import SamplingParams

CASES: dict[str, SamplingParams | None] = {
    "argmax": None,
    "keyed greedy": SamplingParams(),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "t0.8 top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "t0.8 top_p top_k 50 min_p": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05),
    "t0.8 top_p + 5 logprobs": SamplingParams(temperature=0.8, top_p=0.95, logprobs=True, top_logprobs=5),
}


def step_fn(logits: torch.Tensor, params: SamplingParams | None, step: list[int]) -> Callable[[], torch.Tensor]:
    """One decode step's sampling of every row (seed per row, the position advancing every step on the host
    as the engine's would). The packed rows reach the device with one copy, as in the CUDA backend."""
    b = logits.shape[0]
    if params is None:
        return lambda: logits.argmax(dim=-1)
    rows_params = [SamplingParams(**{**params.to_json(), "seed": 1000 + i}) for i in range(b)]

    def run() -> torch.Tensor:
        rows = RowBatch.of(rows_params, [step[0] + i for i in range(b)]).to(logits.device)
        tokens = sample(logits, rows)
        if params.logprobs:
            logprobs(logits, tokens, params.top_logprobs)
        return tokens

    return run


def time_cpu(fn: Callable[[], torch.Tensor], reps: int, step: list[int]) -> float:
    fn()
    times = []
    for _ in range(reps):
        step[0] += 1
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def time_cuda(fn: Callable[[], torch.Tensor], reps: int, graph: bool, logits: torch.Tensor,
              params: SamplingParams | None) -> float:
    if graph:  # captured like the decode step: the rows are a static input the host refreshes per step
        b = logits.shape[0]
        p = params or SamplingParams()
        batch = RowBatch.of([SamplingParams(**{**p.to_json(), "seed": 1000 + i}) for i in range(b)], list(range(b)),
                            pin=True)
        static = batch.packed.to(logits.device)

        def body() -> torch.Tensor:
            if params is None:
                return logits.argmax(dim=-1)
            tokens = sample(logits, Rows.unpack(static, batch.sampled, batch.filtered))
            if params.logprobs:
                logprobs(logits, tokens, params.top_logprobs)
            return tokens

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()

        def fn() -> None:  # the replayed step: refresh the rows, replay
            static.copy_(batch.packed, non_blocking=True)
            g.replay()

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--dtype", default=None, help="logits dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, two reps: checks the script runs")
    ap.add_argument("--no-graph", action="store_true", help="CUDA: time eager launches, not a graph replay")
    ap.add_argument("--torch-ops", action="store_true", help="CUDA: the torch reference ops, not the fused kernel")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.torch_ops:
        os.environ["ATLAS_SAMPLER_KERNEL"] = "0"  # read at the first draw
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    vocab, batches = args.vocab, [int(b) for b in args.batches.split(",")]
    reps = args.reps or (20 if dev.type == "cpu" else 200)
    if args.smoke:
        vocab, batches, reps = 4096, [1, 4], 2
    print(f"# keyed sampler, vocab {vocab}, logits {dtype}, device {dev}"
          f"{'' if dev.type == 'cpu' else (' eager' if args.no_graph else ' CUDA graph')}"
          f"{' torch ops' if args.torch_ops or dev.type == 'cpu' else ' fused kernel'}, median of {reps}, ms/step")
    results = []
    for b in batches:
        logits = (torch.randn(b, vocab, generator=torch.Generator().manual_seed(b)) * 3).to(dev, dtype)
        base = None
        for name, params in CASES.items():
            step = [100]
            fn = step_fn(logits, params, step)
            ms = (time_cpu(fn, reps, step) if dev.type == "cpu"
                  else time_cuda(fn, reps, not args.no_graph, logits, params))
            base = ms if base is None else base
            results.append({"batch": b, "vocab": vocab, "case": name, "ms": ms, "over_argmax_ms": ms - base})
            print(f"batch {b:3d}  {name:28s} {ms:9.4f} ms   (+{ms - base:.4f} over argmax)", flush=True)
        rows = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(b)]
        ms = time_cpu(lambda rows=rows: RowBatch.of(rows, list(range(len(rows)))), reps, [0])
        results.append({"batch": b, "vocab": vocab, "case": "host rows", "ms": ms})
        print(f"batch {b:3d}  {'host rows (RowBatch.of)':28s} {ms:9.4f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
