"""Columnar steps (atlas.state.columns, `ControlState.columnar`, what `replay check` runs): the same digest after
every event, the same typed state once flushed, and the same refusal or violation (machine, message, fields) as
the scalar path, on a null-engine run whose steps go through the columns."""

from __future__ import annotations

import attrs
import pytest
from fixtures import null_workload

from atlas.config import Capacities
from atlas.engine.records import RecordingSink
from atlas.errors import InvariantViolation, TransitionRefused
from atlas.state import steps
from atlas.state.control import ControlState
from atlas.state.events import Event, StepExecuted, StepPlanned
from atlas.state.invariants import audit, check_invariants

REQUESTS = 24  # more than steps.VECTOR_MIN at once, prompts of 1-3 blocks, finishes spread over the run


def _recorded() -> tuple[Capacities, list[Event], list[str]]:
    sink = RecordingSink()
    caps = null_workload.run(REQUESTS, lambda i: 12 + i % 9, sink=sink)
    return caps, [e for _, _, e, _ in sink.rows], [d for _, _, _, d in sink.rows]


@pytest.fixture(scope="module")
def recorded() -> tuple[Capacities, list[Event], list[str]]:
    return _recorded()


def _run(caps: Capacities, events: list[Event], columnar: bool) -> tuple[ControlState, list[str], tuple | None]:
    """Apply every event with the invariants after each; the digests and the first failure (kind, fields)."""
    state = ControlState.create(caps)
    state.columnar = columnar
    digests = []
    for index, e in enumerate(events):
        try:
            check_invariants(state, state.apply(e), index)
        except TransitionRefused as exc:
            return state, digests, ("refused", index, exc.machine, exc.why, exc.fields)
        except InvariantViolation as exc:
            return state, digests, ("violation", index, exc.machine, exc.message, exc.fields)
        digests.append(state.digest())
    return state, digests, None


def _fields(state: ControlState) -> dict[int, tuple]:
    return {s.seq_id: (list(s.cursor.tokens), s.cursor.computed, s.cursor.token_hash, s.qsa.ingested,
                       list(s.blocks), s.fingerprint) for s in state.seqs.values()}


def test_columns_give_the_recorded_digests_and_the_typed_state(recorded) -> None:  # type: ignore[no-untyped-def]
    caps, events, recorded_digests = recorded
    used = []
    real_gather = steps.StepColumns.gather

    def gather(*args):  # type: ignore[no-untyped-def]
        cols = real_gather(*args)
        used.append(cols is not None)
        return cols

    steps.StepColumns.gather = gather  # type: ignore[method-assign]
    try:
        state, digests, failure = _run(caps, events, columnar=True)
    finally:
        steps.StepColumns.gather = real_gather  # type: ignore[method-assign]
    assert failure is None and any(used)  # the run did go through the columns
    assert digests == recorded_digests
    cut = _middle_steps(events)[1]  # a step planned, not executed
    scalar, _, _ = _run(caps, events[:cut], columnar=False)
    half, _, _ = _run(caps, events[:cut], columnar=True)
    assert half.columns is not None  # mid-batch: the objects lag until flushed
    half.flush_columns()
    assert _fields(half) == _fields(scalar) and half.digest() == scalar.digest()
    audit(half, 0)


def _mutated(events: list[Event], index: int, **changes: object) -> list[Event]:
    return events[:index] + [attrs.evolve(events[index], **changes)] + events[index + 1:]


def _middle_steps(events: list[Event]) -> tuple[int, int]:
    """A StepPlanned / StepExecuted pair of a full batch in the run's middle (the columns hold it)."""
    for i in range(len(events) // 3, len(events) - 1):
        e, before = events[i], events[i - 2]
        if (type(e) is StepPlanned and type(events[i + 1]) is StepExecuted and type(before) is StepPlanned
                and type(events[i - 1]) is StepExecuted and len(e.seqs) >= steps.VECTOR_MIN and not e.admitted
                and before.seqs == e.seqs):
            return i, i + 1
    raise AssertionError("no full step in the run's middle")


@pytest.mark.parametrize("how", ["fed past the tokens", "no fed", "missing token", "block past the tokens"])
def test_columns_refuse_and_name_as_the_scalar_path(recorded, how: str) -> None:  # type: ignore[no-untyped-def]
    caps, events, _ = recorded
    p, x = _middle_steps(events)
    plan, done = events[p], events[x]
    assert isinstance(plan, StepPlanned) and isinstance(done, StepExecuted)
    j = len(plan.seqs) // 2
    if how == "fed past the tokens":
        broken = _mutated(events, p, fed=plan.fed[:j] + (plan.fed[j] + 5,) + plan.fed[j + 1:])
    elif how == "no fed":
        broken = _mutated(events, p, fed=plan.fed[:j] + (0,) + plan.fed[j + 1:])
    elif how == "missing token":
        broken = _mutated(events, x, tokens=done.tokens[:j] + (-1,) + done.tokens[j + 1:])
    else:  # two more blocks for one sequence: the plan is valid, the state it leaves breaks an invariant
        state, _, _ = _run(caps, events[:p], columnar=False)
        free = sorted(state.pool.free)[-2:]  # the plan's own rows take the lowest
        rows = [r for r in plan.alloc if r[0] != plan.seqs[j]]
        broken = _mutated(events, p, alloc=(*rows, (plan.seqs[j], *free)))
    _, column_digests, column_failure = _run(caps, broken, columnar=True)
    _, scalar_digests, scalar_failure = _run(caps, broken, columnar=False)
    assert column_failure is not None and column_failure[1] in (p, x)
    assert column_failure == scalar_failure and column_digests == scalar_digests
