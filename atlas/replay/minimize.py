"""Minimising a failing trace: fewer requests, shorter prompts and budgets, fewer cancellations and faults,
fewer steps, while replaying it still fails the same way (same invariant machine and message, or same fault).

A trace's inputs become a `Program`: each input stamped with the step it arrived at. `run_program` drives a
program through a fresh engine (inputs at their steps; when the engine idles before the next input's step,
that input comes at once, so shortening a run never strands its inputs). `minimize` shrinks greedily: it
tries every candidate edit, keeps the first that still fails the same way with a smaller run, and repeats
until no edit helps. The run stops at its failure, so the steps past it go by themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.errors import AdmissionError, EngineDead, QueueFull
from atlas.registry import engine_for_run
from atlas.replay.against import Failure, actual_failure, recorded_failure
from atlas.replay.reader import check_config, read_run
from atlas.replay.run_rows import RunRecord
from atlas.replay.sqlite_file import where
from atlas.replay.store import EventRecord, TraceWriter
from atlas.sampling.params import SamplingParams
from atlas.state.events import Event

Rows = list[tuple[int, int, Event, str]]


@attrs.frozen
class Input:
    step: int
    kind: str  # "arrive" | "cancel" | "fault"
    request_id: str | None
    prompt: tuple[int, ...] = ()
    params: dict[str, Any] = attrs.Factory(dict)  # SamplingParams.to_json()
    stream: bool = False
    fault: str = ""  # "step_error" | "fatal"

    def size(self) -> int:
        return 1 + len(self.prompt) + (self.params.get("max_tokens") or 0) + self.step


Program = tuple[Input, ...]


def program_of(recorded: list[EventRecord]) -> Program:
    """The inputs of a recorded run, each at the step it was recorded at."""
    out = []
    for r in recorded:
        p = r.payload
        if r.kind == "request_arrived":
            params = dict(p["params"])
            if params.get("max_tokens") is None:  # the budget the engine gave it, made explicit
                params["max_tokens"] = p["max_new"]
            out.append(Input(r.step, "arrive", p["request_id"], tuple(p["prompt"]), params, p["stream"]))
        elif r.kind == "request_cancelled":
            out.append(Input(r.step, "cancel", p["request_id"]))
        elif r.kind == "fault_injected":
            out.append(Input(r.step, "fault", p["request_id"], fault=p["fault"]))
    return tuple(out)


def _drive(engine: Engine, i: Input) -> None:
    if i.kind == "arrive":
        try:
            engine.add_request(i.request_id or "", i.prompt, SamplingParams.from_json(i.params), stream=i.stream)
        except (AdmissionError, QueueFull):
            pass  # an edit made it inadmissible: the run goes on without it
    elif i.kind == "cancel":
        engine.cancel(i.request_id or "")
    else:
        engine.inject_fault(i.fault, i.request_id)  # type: ignore[arg-type]


def run_program(engine: Engine, program: Program, max_steps: int = 10_000) -> None:
    """Drive `program` through `engine` until everything finished, the engine died, or `max_steps`."""
    pending = sorted(program, key=lambda i: i.step)
    at = 0
    try:
        for _ in range(max_steps):
            while at < len(pending) and (pending[at].step <= engine.state.step or not engine.has_unfinished()):
                _drive(engine, pending[at])
                at += 1
            if at == len(pending) and not engine.has_unfinished():
                return
            engine.step()
    except EngineDead:
        return


def rows_of(run: RunRecord, program: Program, build: Callable[..., Engine] = engine_for_run,
            **engine_kwargs: Any) -> Rows:
    sink = RecordingSink()
    engine = build(run, sink, **engine_kwargs)
    try:
        run_program(engine, program)
    finally:
        engine.close()
    return sink.rows


def candidates(program: Program) -> Iterator[Program]:
    """Smaller programs, the boldest edits first: drop an input, then shrink or shorten one."""
    n = len(program)
    for k in reversed(range(n)):
        yield program[:k] + program[k + 1:]
    for k, i in enumerate(program):
        edits: list[Input] = []
        if i.step:
            edits += [attrs.evolve(i, step=0), attrs.evolve(i, step=i.step // 2), attrs.evolve(i, step=i.step - 1)]
        if i.kind == "arrive":
            p, budget = i.prompt, i.params.get("max_tokens") or 1
            if len(p) > 1:
                edits += [attrs.evolve(i, prompt=p[: len(p) // 2]), attrs.evolve(i, prompt=p[len(p) // 2:]),
                          attrs.evolve(i, prompt=p[:-1]), attrs.evolve(i, prompt=p[1:])]
            if budget > 1:
                edits += [attrs.evolve(i, params={**i.params, "max_tokens": m})
                          for m in (1, budget // 2, budget - 1)]
                # the same length in fewer steps: generated tokens moved into the prompt (one prefill chunk
                # feeds many tokens, a decode one)
                edits += [attrs.evolve(i, prompt=p + (p[-1],) * d, params={**i.params, "max_tokens": budget - d})
                          for d in sorted({budget - 1, budget // 2})]
            if i.stream:
                edits.append(attrs.evolve(i, stream=False))
        for e in edits:
            yield program[:k] + (e,) + program[k + 1:]


@attrs.frozen
class Minimized:
    program: Program
    rows: Rows
    failure: Failure
    runs: int  # candidate programs replayed
    events_before: int
    requests_before: int

    @property
    def requests(self) -> int:
        return sum(1 for i in self.program if i.kind == "arrive")


def minimize_program(run: RunRecord, program: Program, target: Failure, *,
                     build: Callable[..., Engine] = engine_for_run, max_runs: int = 2000,
                     **engine_kwargs: Any) -> Minimized:
    """Shrink `program` while its run still fails like `target`. Progress is measured by (events, total
    input size): every accepted edit lowers it, so the search ends."""
    def key(prog: Program, rows: Rows) -> tuple[int, int]:
        return len(rows), sum(i.size() for i in prog)

    best = program
    best_rows = rows_of(run, best, build, **engine_kwargs)
    first = actual_failure(best_rows)
    if first is None or not first.same_as(target):
        raise ValueError(f"the program does not fail like the trace ({target.describe()}); today: "
                         f"{first.describe() if first else 'no failure'}")
    before = len(best_rows)
    runs = 1
    improved = True
    while improved and runs < max_runs:
        improved = False
        for cand in candidates(best):
            runs += 1
            rows = rows_of(run, cand, build, **engine_kwargs)
            failure = actual_failure(rows)
            if failure is not None and failure.same_as(target) and key(cand, rows) < key(best, best_rows):
                best, best_rows, improved = cand, rows, True
                break
            if runs >= max_runs:
                break
    final = actual_failure(best_rows)
    assert final is not None
    return Minimized(best, best_rows, final, runs, before, sum(1 for i in program if i.kind == "arrive"))


def write_trace(path: str | Path, run: RunRecord, rows: Rows) -> None:
    """A new trace holding `run`'s header and the events of a replay of it."""
    writer = TraceWriter(path, run={name: getattr(run, name) for name in (
        "engine_version", "git_revision", "model", "model_fingerprint", "backend", "seed", "config", "capacities")})
    try:
        for index, step, e, digest in rows:
            writer.append(index, step, e, digest)
    finally:
        writer.close()


def minimize(path_or_url: str | Path, out: str | Path, run_id: int | None = None, *,
             build: Callable[..., Engine] = engine_for_run, max_runs: int = 2000,
             **engine_kwargs: Any) -> Minimized:
    """Minimise the failing run of a trace under today's code and write the result to `out`."""
    run, recorded = read_run(path_or_url, run_id)
    check_config(run, where(path_or_url))
    target = recorded_failure(recorded)
    if target is None:
        raise ValueError("the trace records no failure: nothing to minimise")
    result = minimize_program(run, program_of(recorded), target, build=build, max_runs=max_runs, **engine_kwargs)
    result = attrs.evolve(result, events_before=len(recorded))
    write_trace(out, run, result.rows)
    return result
