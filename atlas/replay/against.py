"""Replay against the current code: re-drive a trace's recorded inputs through today's engine, report the
first divergent event as a field-level diff, and say what became of the recorded failure.

A run's failure is its first InvariantViolated event (the machine and the message name it; the fields are
the values) or, failing that, its first engine fault that no one injected (fatal or not, named by the
exception type). Injected faults are inputs: they are re-driven, never a failure. Outcomes:
- "failure gone": the recorded run failed and today's does not;
- "still there": today's run fails the same way (same machine and message, or same fault);
- "new failure": today's run fails another way (whether or not the recorded one did);
- "passes": neither run fails (a divergence, if any, is a behaviour change, not a failure).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from atlas.config import Capacities
from atlas.engine.drafters.base import DraftRequest
from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.registry import engine_for_run
from atlas.replay.reader import check_config, read_run
from atlas.replay.run_rows import RunRecord
from atlas.replay.sqlite_file import where
from atlas.replay.store import EventRecord
from atlas.replay.verify import Divergence, compare, redrive
from atlas.state.control import ControlState

FAILURE_GONE = "failure gone"
STILL_THERE = "still there"
NEW_FAILURE = "new failure"
PASSES = "passes"


@attrs.frozen
class Failure:
    kind: str  # "invariant" | "fault"
    machine: str  # the invariant's machine, or "fatal" / "step_error" for a fault
    message: str  # the invariant's message, or the exception type of the fault
    index: int  # the event index it names (the violating event), or the fault's event
    detail: str = ""

    def same_as(self, other: Failure | None) -> bool:
        return other is not None and (self.kind, self.machine, self.message) == (other.kind, other.machine,
                                                                                 other.message)

    def describe(self) -> str:
        what = "invariant violated in" if self.kind == "invariant" else "engine fault"
        return f"{what} {self.machine}: {self.message} at event {self.index}" + (
            f" ({self.detail})" if self.detail else "")


def failure_of(events: Iterable[tuple[int, str, dict[str, Any]]]) -> Failure | None:
    """The run's failure among (index, kind, payload) events, or None: its invariant violation (what stopped
    the engine; a fault before it is often its cause, but the violation names the broken promise), else its
    first engine fault that no one injected."""
    fault = None
    for index, kind, p in events:
        if kind == "invariant_violated":
            fields = ", ".join(f"{k}={v}" for k, v in p["fields"].items())
            return Failure("invariant", p["machine"], p["message"], p["event_index"], fields)
        if kind == "engine_faulted" and not p["injected"] and fault is None:
            error = p["error"]
            exc_type = error.split(":", 1)[0] if ":" in error else error
            fault = Failure("fault", "fatal" if p["fatal"] else "step_error", exc_type, index, error)
    return fault


def recorded_failure(recorded: list[EventRecord]) -> Failure | None:
    return failure_of((r.index, r.kind, r.payload) for r in recorded)


def actual_failure(rows: list[tuple[int, int, Any, str]]) -> Failure | None:
    return failure_of((index, e.kind, json.loads(e.payload_json())) for index, _step, e, _digest in rows)


def field_diff(expected: Any, actual: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted field, expected, actual) for every differing leaf of two payloads."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in list(expected) + [k for k in actual if k not in expected]:
            out += field_diff(expected.get(key), actual.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if expected == actual else [(prefix or "payload", expected, actual)]


def describe_divergence(d: Divergence) -> str:
    lines = [f"first divergence at event {d.index} (step {d.expected_step}): {d.why}"]
    if d.expected_kind != d.actual_kind:
        lines.append(f"  kind: expected {d.expected_kind}, actual {d.actual_kind}")
    else:
        lines.append(f"  kind: {d.expected_kind}")
    if d.expected_payload is not None and d.actual_payload is not None and d.expected_kind == d.actual_kind:
        for name, exp, act in field_diff(d.expected_payload, d.actual_payload):
            lines.append(f"  {name}: expected {json.dumps(exp)}, actual {json.dumps(act)}")
    else:
        lines.append(f"  expected payload: {json.dumps(d.expected_payload)}")
        lines.append(f"  actual payload:   {json.dumps(d.actual_payload)}")
    if d.expected_step != d.actual_step:
        lines.append(f"  step: expected {d.expected_step}, actual {d.actual_step}")
    lines.append(f"  digest: expected {d.expected_digest}, actual {d.actual_digest}")
    return "\n".join(lines)


@attrs.frozen
class AgainstReport:
    run: RunRecord
    events_expected: int
    events_replayed: int
    divergence: Divergence | None
    recorded: Failure | None
    actual: Failure | None
    note: str = ""

    @property
    def outcome(self) -> str:
        if self.actual is None:
            return FAILURE_GONE if self.recorded is not None else PASSES
        if self.recorded is not None and self.actual.same_as(self.recorded):
            return STILL_THERE
        return NEW_FAILURE

    def describe(self) -> str:
        lines = [f"replayed {self.events_replayed} events against the current code "
                 f"(trace: {self.events_expected})"]
        lines.append(describe_divergence(self.divergence) if self.divergence else
                     f"identical: {self.events_replayed} events replayed, every payload and digest matches")
        lines.append(f"recorded: {self.recorded.describe() if self.recorded else 'no failure'}")
        lines.append(f"today:    {self.actual.describe() if self.actual else 'no failure'}")
        lines.append(f"outcome: {self.outcome}")
        return "\n".join(lines)


class RecordedDrafter:
    """Proposes, for a sequence at a token count, the drafts the trace's run verified there: a scripted
    drafter's choices re-driven (a script is code, not in the trace; its choices are)."""

    name = "recorded"

    def __init__(self, choices: dict[tuple[int, int], tuple[int, ...]]) -> None:
        self.choices = choices

    def propose(self, request: DraftRequest) -> tuple[int, ...]:
        return self.choices.get((request.seq_id, len(request.tokens)), ())[: request.k]


def recorded_drafts(run: RunRecord, recorded: list[EventRecord]) -> dict[tuple[int, int], tuple[int, ...]]:
    """(seq_id, token count when planned) -> drafts, from the trace's StepPlanned events."""
    state = ControlState.create(Capacities.from_table(run.capacities))
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    for rec in recorded:
        e = rec.event()
        if rec.kind == "step_planned" and e.drafts:
            for seq_id, drafts in zip(e.seqs, e.drafts, strict=True):
                if drafts and seq_id in state.seqs:
                    out[(seq_id, len(state.seqs[seq_id].cursor.tokens))] = drafts
        try:
            state.apply(e)
        except Exception:  # a refused event changes nothing; the drafts before it are what matter
            pass
    return out


def replay_rows(run: RunRecord, recorded: list[EventRecord], *, build: Callable[..., Engine] = engine_for_run,
                progress: Callable[[int, int], None] | None = None, **engine_kwargs: Any
                ) -> tuple[list[tuple[int, int, Any, str]], str]:
    """Re-drive the recorded inputs through a fresh engine; returns its events and how the replay ended."""
    if run.config.get("drafter") == "scripted" and run.config.get("num_drafts"):
        engine_kwargs.setdefault("drafter", RecordedDrafter(recorded_drafts(run, recorded)))
    sink = RecordingSink()
    engine = build(run, sink, **engine_kwargs)
    try:
        note = redrive(engine, recorded, progress, to_end=True)
    finally:
        engine.close()
    return sink.rows, note


def against(path_or_url: str | Path, run_id: int | None = None, *, build: Callable[..., Engine] = engine_for_run,
            progress: Callable[[int, int], None] | None = None, **engine_kwargs: Any) -> AgainstReport:
    """`progress(events_replayed, events_in_trace)` is called after every replayed step."""
    run, recorded = read_run(path_or_url, run_id)
    check_config(run, where(path_or_url))
    rows, note = replay_rows(run, recorded, build=build, progress=progress, **engine_kwargs)
    return AgainstReport(run, len(recorded), len(rows), compare(recorded, rows, digests=run.digests_comparable),
                         recorded_failure(recorded),
                         actual_failure(rows), note)
