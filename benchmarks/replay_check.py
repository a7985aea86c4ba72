"""State-only replay speed: `atlas replay check` over a large generated trace (null backend, 64 sequences at a time).

    .venv/bin/python benchmarks/replay_check.py [--requests 256] [--max-tokens 200] [--trace PATH] [--clock process]
        [--json] [--no-runs] [--smoke]

Records the trace once (cached at --trace), then times check_state_only: reading the events from SQLite,
upcasting, applying each to the state machines, checking the invariants it touched and its digest. Step events
and arrivals are recorded in codec 1 (atlas.replay.codec; a trace cached by older code may keep JSON arrivals,
which still check, at ~222 against ~189 M instructions); --json times a copy of the same
run with every payload as JSON text (how traces were stored before codec 1: what an older trace costs to check). --no-runs applies every event
one at a time (no runs of step pairs at once: atlas.state.column_runs).

On a loaded machine the instruction count is the figure to compare: callgrind collecting inside one check after a warm-up check, toggled on a builtin nothing in the check
calls (SamplingParams' validator calls `sorted`), e.g. with this as check.py:

    import sys; from functools import reduce; from atlas.replay.verify import check_state_only
    check_state_only(sys.argv[1]); reduce(lambda a, b: check_state_only(sys.argv[1]), [0, 1])

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce .venv/bin/python check.py T
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.replay.reader import TraceReader
from atlas.replay.verify import check_state_only
from atlas.sampling.params import SamplingParams


def record(path: Path, requests: int, max_tokens: int) -> None:
    config = EngineConfig(max_seq_len=1024, max_batch_size=64, prefill_chunk_tokens=512, block_size=16)
    engine = build_engine("atlas-tiny", backend="null", config=config, trace=str(path))
    for i in range(requests):
        engine.add_request(f"r{i}", [(i * 13 + k) % 256 for k in range(32 + i % 64)],
                           SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.close()


def _stored(reader: TraceReader, run_id: int) -> list[tuple]:
    """The rows as stored (payload text or bytes), to say which format the trace holds."""
    with reader.db.connect() as conn:
        return list(conn.connection.driver_connection.execute(
            "SELECT idx, step, kind, version, payload, digest FROM events WHERE run_id = ?", (run_id,)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--trace", type=Path, default=Path("/tmp/atlas_replay_check_bench.db"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="time with the wall clock (default) or this process's CPU time (a loaded machine)")
    parser.add_argument("--json", action="store_true", help="check a copy of the trace with JSON payloads (pre-codec 1)")
    parser.add_argument("--no-runs", action="store_true", help="every event one at a time (no runs of step pairs)")
    parser.add_argument("--smoke", action="store_true", help="8 requests of 16 tokens in a fresh temp trace (CI)")
    args = parser.parse_args()
    if args.smoke:
        import tempfile

        args.requests, args.max_tokens, args.repeat = 8, 16, 1
        args.trace = Path(tempfile.mkdtemp(prefix="atlas-replay-check-")) / "smoke.db"
    if not args.trace.exists():
        record(args.trace, args.requests, args.max_tokens)
    if args.json:  # the same run with JSON payloads: export to JSON lines, import (import writes JSON text rows)
        import tempfile

        from atlas.replay.jsonl import export_jsonl, import_jsonl

        copy = args.trace.with_name(args.trace.stem + "-json.db")
        if not copy.exists():
            lines = Path(tempfile.mkdtemp(prefix="atlas-replay-check-")) / "run.jsonl"
            export_jsonl(args.trace, lines)
            import_jsonl(lines, copy)
        args.trace = copy
    if args.no_runs:
        from atlas.replay import verify

        verify.MIN_RUN = 10**9  # type: ignore[misc]
    reader = TraceReader(args.trace)
    run = reader.run()
    t = time.perf_counter()
    recorded = list(reader.events(run.run_id))
    read_s = time.perf_counter() - t
    stored = _stored(reader, run.run_id)
    steps = sum(1 for _, _, kind, _, payload, _ in stored if kind.startswith("step_") and isinstance(payload, bytes))
    arrivals = sum(1 for _, _, kind, _, payload, _ in stored if kind == "request_arrived" and isinstance(payload, bytes))
    reader.close()
    events = len(recorded)
    # one StepPlanned and one StepExecuted per step, each moving every sequence in the batch: a
    # per-sequence transition is what one event per token would have been
    transitions = sum(len(r.payload["seqs"]) for r in recorded if r.kind == "step_planned") * 2 + sum(
        1 for r in recorded if r.kind not in ("step_planned", "step_executed"))
    best = float("inf")
    clock = time.process_time if args.clock == "process" else time.perf_counter
    for _ in range(args.repeat):
        t = clock()
        report = check_state_only(args.trace)
        best = min(best, clock() - t)
        assert report.problem is None, report
    print(f"{events} events ({args.trace}, {args.trace.stat().st_size / 1e6:.1f} MB, {steps} step payloads and {arrivals} arrivals in codec 1), "
          f"{transitions} per-sequence transitions: state-only check {best:.2f} s (reading {read_s:.2f} s), "
          f"{events / best:,.0f} events/s, {transitions / best:,.0f} per-sequence transitions/s")


if __name__ == "__main__":
    main()
