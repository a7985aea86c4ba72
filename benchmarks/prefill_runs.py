"""Every run of a prefill, per Tuning variant and prompt length: where a median hides a slow replay or capture.

    python3 benchmarks/prefill_runs.py [--variants default,eager] [--tokens 2048,8192] [--repeat 4]
    python3 benchmarks/prefill_runs.py --smoke        # the CPU backend, atlas-tiny, 64 tokens (a clone's check)

Not a test: it prints figures. Its question (issue 15.3): prefill graphs take a 2,048-token prefill from 52.8 to
41.7 ms on the H200, but took the 8,192-token one to 352.9 ms against 174.7 ms with the regions eager. `atlas bench gpu` reports one median a length; this prints each fresh prompt's wall and
execute ms in order (the first run compiles; with prefill_graphs the second is the capture and the rest replays;
the bench's median leaves out these warm-up runs), the peak device memory, on the benchmark config with random bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIG = Path(__file__).resolve().parent / "configs" / "qwen4exp-2p7b.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="default,eager")
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--graph", action="store_true", help="also split a replayed chunk's execute: its graph alone "
                        "(CUDA events), the sum of its kernels (profiler) and the host part around them")
    args = parser.parse_args()
    import torch

    from atlas.bench_measure import bench_prefill

    if args.smoke:
        from atlas.model import load_model

        torch.set_num_threads(1)
        result = bench_prefill(load_model("atlas-tiny"), tokens=64, repeat=2, backend="cpu")
        print(f"cpu atlas-tiny 64 tokens: runs ms {' '.join(f'{r:.1f}' for r in result['runs'])}")
        return
    from atlas.backends.cuda.random_model import random_model
    from atlas.backends.cuda.tuning import TUNINGS as VARIANTS

    model = random_model(json.loads(CONFIG.read_text()), device="cuda", dtype=torch.bfloat16, seed=0)
    for name in args.variants.split(","):
        for tokens in map(int, args.tokens.split(",")):
            torch.cuda.reset_peak_memory_stats()
            try:
                r = bench_prefill(model, tokens=tokens, repeat=args.repeat, tuning=VARIANTS[name])
            except Exception as error:  # one failing variant must not lose the others' rows
                print(f"{name} {tokens}: ERROR {type(error).__name__}: {error}", flush=True)
                torch.cuda.empty_cache()
                continue
            if args.graph:
                graph_split(model, name, tokens)
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"{name} {tokens} tokens: median {r['ms']:.1f} ms of the last {args.repeat}; runs ms "
                  + " ".join(f"{w:.1f}" for w in r["runs"]) + "; execute ms "
                  + " ".join(f"{e:.1f}" for e in r["execute_runs"]) + f"; peak {peak:.1f} GiB", flush=True)
            torch.cuda.empty_cache()


def graph_split(model: object, name: str, tokens: int) -> None:
    """Where a replayed prefill chunk's execute goes: the graph's replay alone (CUDA events, 5 replays), the sum of
    its kernels' device time (torch.profiler over one replay): replay - kernels is the gaps between the graph's
    kernels, execute - replay the host's part (packing, copies, the logits' read)."""
    import statistics

    import torch

    from atlas.backends.cuda.tuning import TUNINGS as VARIANTS
    from atlas.bench_measure import run_steps, timed_engine

    engine, timed = timed_engine(model, batch=1, max_seq_len=tokens + 16, chunk=tokens, tuning=VARIANTS[name])
    g = torch.Generator().manual_seed(2)
    for _ in range(3):  # compile, capture, one replay
        timed.calls.clear()
        run_steps(engine, [torch.randint(0, model.spec.vocab_size, (tokens,), generator=g).tolist()], max_tokens=1)
    execute = timed.calls[0][2]
    graphs = getattr(timed.inner, "prefill_graphs", None)
    if graphs is None or not graphs._graphs:
        print(f"{name} {tokens}: no prefill graph was captured (prefill_graphs none)", flush=True)
        engine.close()
        return
    graph = next(iter(graphs._graphs.values())).graph
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    replay = statistics.median(times)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    print(f"{name} {tokens} graph split: execute {execute:.2f} ms, graph replay alone {replay:.2f} ms, its "
          f"{len(kernels)} kernels {busy:.2f} ms (gaps {replay - busy:.2f} ms, "
          f"{(replay - busy) / max(len(kernels), 1) * 1e3:.2f} us a kernel), host part {execute - replay:.2f} ms",
          flush=True)
    # the host part, function by function: one more replayed prompt's engine call (arrival, step, finish) under
    # cProfile, then under torch.profiler (host ops and every kernel outside the graph)
    import cProfile
    import io
    import pstats

    prompt = torch.randint(0, model.spec.vocab_size, (tokens,), generator=g).tolist()
    profile = cProfile.Profile()
    profile.enable()
    run_steps(engine, [prompt], max_tokens=1)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    print(text.getvalue(), flush=True)
    prompt = torch.randint(0, model.spec.vocab_size, (tokens,), generator=g).tolist()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_steps(engine, [prompt], max_tokens=1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
