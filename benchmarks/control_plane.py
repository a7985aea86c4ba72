"""Control-plane throughput: schedule + apply + invariants + digest + SQLite trace, no tensors.

    .venv/bin/python benchmarks/control_plane.py [--steps N] [--batches 1,64,256] [--no-trace | --memory-sink]
        [--clock process] [--stamps 51] [--no-batch-columns] [--drafts N] [--smoke]
    .venv/bin/python benchmarks/control_plane.py --prefill 2048 [--repeat 20] [--clock process] [--stamps 51]

A fixed-token backend (honest cursors, no compute) stands in for the model, so the figure is the cost
the engine adds to every decode step. It prints sequence-steps per second (one sequence advanced by
one step) at each batch size, with the trace on, the trace's bytes per sequence-step, and the control
plane's time per decode step: the engine's wall time outside Backend.execute (issue 15's measure), after one
"host speed" line: a fixed Python workload's time, so figures from two machines can be compared.
--memory-sink: the events kept in memory (RecordingSink), as atlas.bench_measure's H200 decode rows keep them (their
control-plane share has no SQLite trace in it).
--prefill N: instead, the engine's time outside execute for one N-token request's step (its arrival, plan, apply and
finish), as atlas.bench_measure.bench_prefill times it on the H200 (offline.generate with max_tokens 1, a RecordingSink,
the wall from the call to its first progress stamp); the median of --repeat requests (default 20) after 3 warm-ups.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from atlas.backends.base import Capabilities
from atlas.backends.null import ByteTokenizer
from atlas.calibrate import host_speed
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.plan import BackendCursors, SeqOutcome, StepPlan, StepResult
from atlas.replay.store import TraceWriter
from atlas.sampling.params import SamplingParams

# --clock process: this process's CPU time instead of wall time (on a box other jobs load, the wall clock moves by
# up to 2x between runs of the same code; the CPU time much less; the engine is single-threaded)
CLOCK = time.perf_counter


class FixedTokenBackend:
    """Returns token 65 for every sampled sequence and reports honest cursors; does nothing else."""

    name = "fixed"
    capabilities = Capabilities()

    def __init__(self, stamps: int = 0) -> None:
        self._fed: dict[int, int] = {}
        self.seconds = 0.0  # wall time inside execute: the data plane's share, left out of the control plane's
        # --stamps N: N honest per-layer stamps a sequence (the 2.7B config has 51), shared per position as the CUDA
        # stamp reader shares a healthy sequence's BackendCursors, so the engine's cursor check walks real stamps
        self._names = tuple(("kv" if i % 4 == 0 else "gdn", i) for i in range(stamps))
        self._shared: dict[int, BackendCursors] = {}

    def _cursors(self, n: int) -> BackendCursors:
        if not self._names:
            return BackendCursors(n, n, n, n, 0)
        cur = self._shared.get(n)
        if cur is None:
            cur = self._shared[n] = BackendCursors(n, n, n, n, 0, tuple((k, layer, n) for k, layer in self._names))
            mark = getattr(cur, "uniform", None)  # as the CUDA reader marks a shared one (absent before issue 13's)
            if mark is not None:
                mark()
        return cur

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = CLOCK()
        result = self._execute(plan)
        self.seconds += CLOCK() - t0
        return result

    def _execute(self, plan: StepPlan) -> StepResult:
        fed = self._fed
        for seq_id in plan.release:
            fed.pop(seq_id, None)
        for seq_id in plan.reset:
            fed.pop(seq_id, None)
        outcomes = []
        for w in plan.work:
            n = fed.get(w.seq_id, 0) + len(w.tokens)
            fed[w.seq_id] = n
            outcomes.append(SeqOutcome(w.seq_id, self._cursors(n), 65 if w.sample else None))
        return StepResult(plan.step, tuple(outcomes))

    def cursors(self, seq_id: int) -> BackendCursors:
        return self._cursors(self._fed.get(seq_id, 0))


def measure(batch: int, steps: int, trace_dir: Path | None, stamps: int = 0, columns: bool = True,
            memory_sink: bool = False, drafts: int = 0) -> tuple[float, float | None, float]:
    """(sequence-steps/s, trace bytes per sequence-step, control-plane us per step outside execute). `drafts`:
    speculation on with that many drafts at most, a scripted drafter and the CUDA backend's cost table, under which
    no draft count pays at these batches: the lane's cost on a step it drafts nothing."""
    prompt_len, max_seq_len = 16, 16 + steps + 8
    spec: dict = {}
    if drafts:
        from atlas.backends.cuda.costs import verify_costs

        spec = dict(num_drafts=drafts, drafter="scripted", verify_costs=verify_costs(drafts, compiled=True))
    config = EngineConfig(max_seq_len=max_seq_len, max_batch_size=batch, prefill_chunk_tokens=max(batch * prompt_len, 64),
                          block_size=16, **spec)
    sink: TraceWriter | RecordingSink | None = RecordingSink() if memory_sink else None
    path = None
    if trace_dir is not None and not memory_sink:
        path = trace_dir / f"bench-{batch}-{time.perf_counter_ns()}.db"  # a fresh trace per run
        sink = TraceWriter(path, run={"engine_version": "bench", "git_revision": None, "model": "none",
                                      "model_fingerprint": "none", "backend": "fixed", "seed": None,
                                      "config": config.to_json(), "capacities": {}})
    backend = FixedTokenBackend(stamps)
    extra: dict = {}
    if drafts:
        from atlas.engine.drafters.scripted import ScriptedDrafter

        backend.capabilities = Capabilities(verify=True, per_row_qsa_verify=True, max_verify_width=drafts + 1)
        extra["drafter"] = ScriptedDrafter(lambda req: [65] * req.k)
    engine = Engine(backend, tokenizer=ByteTokenizer(), config=config, sink=sink, **extra)
    if hasattr(engine.state, "batch_cache"):  # --no-batch-columns: the objects alone (atlas.state.batch_columns)
        engine.state.batch_cache = columns
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + i % 200] * prompt_len, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    engine.step()  # the prefill step: not part of the decode figure
    backend.seconds = 0.0
    t0 = CLOCK()
    seq_steps = 0
    for _ in range(steps):
        seq_steps += len(engine.state.running)
        engine.step()
    engine.close()  # includes the final flush
    elapsed = CLOCK() - t0
    bytes_per = None
    if path is not None:
        size = sum(os.path.getsize(p) for p in path.parent.glob(path.name + "*"))
        bytes_per = size / seq_steps
    return seq_steps / elapsed, bytes_per, (elapsed - backend.seconds) / steps * 1e6


def measure_prefill(tokens: int, repeat: int, stamps: int = 0) -> float:
    """The median over `repeat` fresh `tokens`-long prompts of the engine's ms outside execute for the request's step."""
    import random
    import statistics

    from atlas.engine.offline import generate

    config = EngineConfig(max_seq_len=tokens + 16, max_batch_size=1, prefill_chunk_tokens=tokens)
    backend = FixedTokenBackend(stamps)
    engine = Engine(backend, tokenizer=ByteTokenizer(), config=config, sink=RecordingSink())
    rng = random.Random(0)
    outside = []
    for _ in range(repeat + 3):
        prompt = [rng.randrange(1, 250) for _ in range(tokens)]
        backend.seconds = 0.0
        marks = [CLOCK()]
        generate(engine, [prompt], SamplingParams(max_tokens=1, ignore_eos=True),
                 progress=lambda done, total, marks=marks: marks.append(CLOCK()))
        outside.append((marks[1] - marks[0] - backend.seconds) * 1e3)
    engine.close()
    return statistics.median(outside[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--memory-sink", action="store_true",
                    help="events kept in memory (RecordingSink, as the H200 decode rows keep them), no SQLite trace")
    ap.add_argument("--repeat", type=int, default=1, help="runs per batch size; the fastest is shown")
    ap.add_argument("--clock", choices=("wall", "process"), default="wall",
                    help="time with the wall clock (default) or this process's CPU time (a loaded machine)")
    ap.add_argument("--stamps", type=int, default=0,
                    help="per-layer position stamps a sequence reports (51: the 2.7B config's; 0: none, as before)")
    ap.add_argument("--no-batch-columns", action="store_true",
                    help="the engine without its batch columns (atlas.state.batch_columns): the objects alone")
    ap.add_argument("--drafts", type=int, default=0, metavar="N",
                    help="speculation on (N drafts at most) where the cost model drafts nothing: the lane's own cost")
    ap.add_argument("--smoke", action="store_true", help="20 steps at batch 1 and 8: seconds, for CI")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="instead: the engine's ms outside execute for one N-token request (the bench's prefill row)")
    args = ap.parse_args()
    if args.prefill < 0 or args.repeat < 1:
        ap.error(f"--prefill {args.prefill} / --repeat {args.repeat}: a prompt length >= 1 and at least one run")
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter
    if args.smoke:
        args.steps, args.batches = 20, "1,8"
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # quiet the capacity table
    if args.prefill:
        repeat = args.repeat if args.repeat > 1 else 20
        ms = measure_prefill(args.prefill, repeat, args.stamps)
        print(f"prefill {args.prefill} tokens: engine {ms * 1e3:,.0f} us outside execute a request "
              f"(median of {repeat}, {'process' if CLOCK is time.process_time else 'wall'} clock)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = None if args.no_trace else Path(tmp)
        # control plane: the engine's wall time per decode step outside Backend.execute (the fastest run's)
        print(f"host speed: {host_speed(CLOCK):.1f} us a calibration round (a fixed Python workload; the 2-core dev box: "
              "~9; atlas.calibrate.host_speed)")
        print(f"{'batch':>6} {'seq-steps/s':>12} {'us/seq-step':>12} {'trace B/seq-step':>17} "
              f"{'control plane us/step':>22}")
        for batch in (int(b) for b in args.batches.split(",")):
            runs = [measure(batch, args.steps, trace_dir, args.stamps, not args.no_batch_columns, args.memory_sink,
                            args.drafts) for _ in range(args.repeat)]
            rate, bytes_per, _ = max(runs, key=lambda r: r[0])
            plane_us = min(r[2] for r in runs)
            shown = "-" if bytes_per is None else f"{bytes_per:.1f}"
            print(f"{batch:>6} {rate:>12,.0f} {1e6 / rate:>12.2f} {shown:>17} {plane_us:>22,.0f}")
    if args.smoke:  # the --prefill path too, at a small size
        print(f"prefill 256 tokens: engine {measure_prefill(256, 2) * 1e3:,.0f} us outside execute a request")


if __name__ == "__main__":
    main()
