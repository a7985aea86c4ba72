"""The Journal: the one place an event changes the control plane.

    apply(e): state.apply(e) -> invariants on what it touched (every machine with full_audit) -> digest -> sink

A refused transition or a broken invariant is itself recorded (InvariantViolated), the sink is flushed, and
the violation is raised: the control plane can no longer be trusted, so the engine stops.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import structlog

from atlas.engine.records import EventSink
from atlas.errors import InvariantViolation, TransitionRefused
from atlas.state.control import ControlState
from atlas.state.events import Event, InvariantViolated
from atlas.state.invariants import audit, check_invariants

log = structlog.get_logger("atlas.engine")


class Journal:
    def __init__(self, state: ControlState, sink: EventSink | None, *, full_audit: bool = False) -> None:
        self.state = state
        self.sink = sink
        self.full_audit = full_audit
        self.index = 0  # the next event's index in the run
        self.checks = 0  # invariant checks run (one per event)
        self.stepping: int | None = None  # the step being run: events without a step field are stamped with it

    def apply(self, e: Event) -> None:
        index = self.index
        state = self.state
        step = getattr(e, "step", state.step if self.stepping is None else self.stepping)
        violation: InvariantViolation | None = None
        try:
            touched = state.apply(e)
            check_invariants(state, touched, index)
            if self.full_audit:
                audit(state, index)
        except TransitionRefused as exc:
            violation = InvariantViolation(index, exc.machine, exc.why, exc.fields)
        except InvariantViolation as exc:
            violation = exc
        self.checks += 1
        if self.sink is not None:
            self.sink.append(index, step, e, state.digest())
        self.index = index + 1
        if violation is not None:
            self.violation(violation)

    def apply_all(self, events: Iterable[Event]) -> None:
        for e in events:
            self.apply(e)

    def check(self, violation: InvariantViolation | None) -> None:
        """An invariant checked outside the state machines (the data plane's cursors, the backend's result)."""
        if violation is not None:
            self.violation(violation)

    def violation(self, v: InvariantViolation) -> None:
        """Record the violation in the trace, flush, and raise it."""
        log.error("invariant violated", event_index=v.event_index, machine=v.machine, message=v.message)
        fields = json.loads(json.dumps(v.fields, default=str))
        e = InvariantViolated(v.event_index, v.machine, v.message, fields)
        self.state.apply(e)
        if self.sink is not None:
            self.sink.append(self.index, self.state.step, e, self.state.digest())
            self.sink.flush()
        self.index += 1
        raise v

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None
