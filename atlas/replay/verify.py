"""Replay a recorded run.

- `verify`: re-drive the recorded inputs (arrivals at their steps, cancellations, injected faults) through a
  fresh engine with the run's config, model and backend, and compare every event and digest with the trace;
  report identical, or the first divergent event with expected vs actual payloads and both digests.
- `check_state_only`: apply the recorded events to the state machines alone (no model, no backend),
  checking every invariant and every digest: a fast audit of a trace.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from atlas.config import Capacities
from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.errors import AdmissionError, EngineDead, InvariantViolation, QueueFull, TransitionRefused
from atlas.registry import engine_for_run
from atlas.replay import codec
from atlas.replay.arrivals import ParamsCache, parse_arrivals
from atlas.replay.digests import LazyDigests
from atlas.replay.reader import bad_row, capacities_of, check_config, first_bad_row, read_run, read_stored
from atlas.replay.run_rows import RunRecord
from atlas.replay.runs import MIN_RUN, run_end
from atlas.replay.sqlite_file import where
from atlas.replay.store import EventRecord
from atlas.sampling.params import SamplingParams
from atlas.state.column_arrivals import apply_arrivals, apply_parsed
from atlas.state.column_batch import finish_in_columns, finish_text_in_columns, plan_in_columns
from atlas.state.column_runs import apply_run
from atlas.state.column_steps import execute_blob
from atlas.state.control import ControlState
from atlas.state.events import EVENT_TYPES, INPUT_KINDS, Event, InvariantViolated
from atlas.state.invariants import check_invariants

Progress = Callable[[int, int], None]
ARRIVED_VERSION = EVENT_TYPES["request_arrived"].version
FINISHED_VERSION = EVENT_TYPES["request_finished"].version
EXECUTED_VERSION = EVENT_TYPES["step_executed"].version
# fewer arrivals than this go one at a time (apply_arrivals' ~25 numpy calls against ~100 K instructions an arrival)
MIN_ARRIVALS = 2


@attrs.frozen
class Divergence:
    index: int
    why: str
    expected_kind: str | None
    expected_step: int | None
    expected_payload: dict[str, Any] | None
    expected_digest: str | None
    actual_kind: str | None = None
    actual_step: int | None = None
    actual_payload: dict[str, Any] | None = None
    actual_digest: str | None = None

    def describe(self) -> str:
        return (f"first divergence at event {self.index}: {self.why}\n"
                f"  expected: step {self.expected_step} {self.expected_kind} {json.dumps(self.expected_payload)} "
                f"digest {self.expected_digest}\n"
                f"  actual:   step {self.actual_step} {self.actual_kind} {json.dumps(self.actual_payload)} "
                f"digest {self.actual_digest}")


@attrs.frozen
class VerifyReport:
    run: RunRecord
    events_expected: int
    events_replayed: int
    divergence: Divergence | None
    fingerprint: str  # the model fingerprint of the replaying engine
    note: str = ""  # how the replay ended, when it ended early

    @property
    def identical(self) -> bool:
        return self.divergence is None

    @property
    def fingerprint_matches(self) -> bool:
        return self.fingerprint == self.run.model_fingerprint


def _drive_input(engine: Engine, rec: EventRecord) -> None:
    p = rec.payload
    if rec.kind == "request_arrived":
        try:
            engine.add_request(p["request_id"], p["prompt"], SamplingParams.from_json(p["params"]),
                               stream=p.get("stream", False))
        except (AdmissionError, QueueFull):
            pass  # refused now though admitted then: the event comparison reports it
    elif rec.kind == "request_cancelled":
        engine.cancel(p["request_id"])
    elif rec.kind == "fault_injected":
        engine.inject_fault(p["fault"], p["request_id"])
    else:
        raise ValueError(f"not an input event: {rec.kind}")


def _requests_in_flight(engine: Engine) -> bool:
    """A request still waiting, running or with an output not yet taken (not mere releases)."""
    return bool(engine.state.seqs or engine.book.pending)


def redrive(engine: Engine, recorded: list[EventRecord], progress: Progress | None = None, *,
            to_end: bool = False, max_steps: int = 100_000) -> str:
    """Feed the recorded inputs to `engine` where they happened and step it until the run's end (`to_end`:
    until every request finished, however long the trace was). Returns how the replay ended.

    An input is driven when the replay has produced exactly as many events as preceded it in the trace: the
    input's position in the event stream, not only its step stamp, since a step can emit events (a fired
    fault) without advancing the step counter."""
    inputs = [r for r in recorded if r.kind in INPUT_KINDS]
    sink = engine.sink
    produced = (lambda: len(sink.rows)) if isinstance(sink, RecordingSink) else (lambda: engine.journal.index)
    i = 0
    for _ in range(max_steps):
        try:
            while i < len(inputs) and inputs[i].index <= produced():
                _drive_input(engine, inputs[i])
                i += 1
            if i == len(inputs) and (not engine.has_unfinished() or produced() >= len(recorded)
                                     and (not to_end or not _requests_in_flight(engine))):
                # past the trace's end with every request done, only housekeeping is left (the release step
                # of a finished sequence, which a run that stopped once its requests ended never took)
                return "ended"
            if produced() > len(recorded) and not to_end:
                return "the replay ran past the trace's end"
            before = produced()
            engine.step()
        except EngineDead as exc:
            return f"engine dead: {exc}"
        if progress is not None:
            progress(min(produced(), len(recorded)), len(recorded))
        if produced() == before and not engine.has_unfinished():
            if i < len(inputs):  # idle before the next input's place in the trace: the run diverged earlier
                return f"idle after {produced()} events; the next input is event {inputs[i].index}"
            return "ended"
    return f"stopped after {max_steps} steps"


def compare(recorded: list[EventRecord], actual: list[tuple[int, int, Event, str]], *,
            digests: bool = True) -> Divergence | None:
    """The first divergent event; `digests` False for a trace whose digests this engine computes otherwise
    (RunRecord.digests_comparable)."""
    for rec, (index, step, e, digest) in zip(recorded, actual, strict=False):
        payload = json.loads(e.payload_json())
        why = None
        if rec.kind != e.kind:
            why = "event kind differs"
        elif rec.payload != payload:
            why = "payload differs"
        elif rec.step != step:
            why = "step differs"
        elif digests and rec.digest != digest:
            why = "state digest differs"
        if why is not None:
            return Divergence(index, why, rec.kind, rec.step, rec.payload, rec.digest, e.kind, step, payload, digest)
    if len(recorded) > len(actual):
        rec = recorded[len(actual)]
        return Divergence(rec.index, "the replay ended before this event", rec.kind, rec.step, rec.payload,
                          rec.digest)
    if len(actual) > len(recorded):
        index, step, e, digest = actual[len(recorded)]
        return Divergence(index, "the replay produced events past the trace's end", None, None, None, None,
                          e.kind, step, json.loads(e.payload_json()), digest)
    return None


def verify(path_or_url: str | Path, run_id: int | None = None, *, progress: Progress | None = None,
           engine_kwargs: dict[str, Any] | None = None) -> VerifyReport:
    run, recorded = read_run(path_or_url, run_id)
    check_config(run, where(path_or_url))
    sink = RecordingSink()
    engine = engine_for_run(run, sink, **(engine_kwargs or {}))
    try:
        note = redrive(engine, recorded, progress)
    finally:
        engine.close()
    return VerifyReport(run, len(recorded), len(sink.rows),
                        compare(recorded, sink.rows, digests=run.digests_comparable), engine.model_fingerprint, note)


@attrs.frozen
class StateCheckReport:
    events: int
    problem: str | None  # None: every event applied, every invariant held, every digest matched
    index: int | None = None


def check_state_only(path_or_url: str | Path, run_id: int | None = None) -> StateCheckReport:
    """Apply the recorded events to the state machines alone; report the first refusal, violation or
    digest mismatch. Needs no model: it audits what the trace claims happened.

    The rows are read as stored (nothing decoded up front). A run of codec-1 step pairs over the batch the step
    columns hold (atlas.replay.runs) is applied at once from its blobs (atlas.state.column_runs: every check and
    every event's digest over [steps x batch] arrays); any other row, and every row of a run that does not pass
    whole, is built into its event and applied, invariants checked, digest compared, one at a time."""
    run, rows = read_stored(path_or_url, run_id)
    # the check builds objects that form no cycles: the collector's passes over them were ~6 M of a 253 M-instruction
    # check (benchmarks/replay_check.py's trace); it runs again as it was once the check returns
    collecting = gc.isenabled()
    gc.disable()
    try:
        report = check_rows(capacities_of(run, where(path_or_url)), rows, run.digests_comparable)[0]
    except Exception:
        # the rows are read unchecked (the fast path): an error out of the check may be a row that is not its
        # event; the first such row is named, as a reader names it (atlas.replay.reader), else the error stands
        bad = first_bad_row(rows)
        if bad is None:
            raise
        raise bad_row(where(path_or_url), run.run_id, *bad) from None
    finally:
        if collecting:
            gc.enable()
    if report.problem is not None:  # a refusal or a digest that differs may be a row that is not its event
        bad = first_bad_row(rows if report.index is None else rows[:report.index + 1])
        if bad is not None:
            raise bad_row(where(path_or_url), run.run_id, *bad)
    return report


def _digest_report(total: int, wrong: tuple[int, str, str]) -> StateCheckReport:
    index, ours, recorded = wrong
    return StateCheckReport(total, f"digest {ours} != recorded {recorded}", index)


def _first(lazy: LazyDigests | None, total: int, state: ControlState, report: StateCheckReport
           ) -> tuple[StateCheckReport, ControlState]:
    """`report`, unless an earlier event's digest differs (reported one at a time, it came first)."""
    wrong = lazy.first_mismatch() if lazy is not None else None
    return (report if wrong is None else _digest_report(total, wrong)), state


def _digest_wrong(lazy: LazyDigests | None, comparable: bool, total: int, state: ControlState, recorded: str,
                  index: int) -> StateCheckReport | None:
    """The report when the state's digest after event `index` is not the recorded one (through the lazy digests
    when on), else None."""
    if lazy is not None:
        wrong = lazy.add(state, recorded, index)
        return None if wrong is None else _digest_report(total, wrong)
    if comparable and state.digest() != recorded:
        return StateCheckReport(total, f"digest {state.digest()} != recorded {recorded}", index)
    return None


def check_rows(caps: Capacities, rows: list[tuple[int, int, str, int, str | bytes, str]], comparable: bool = True,
               *, fast: bool = True) -> tuple[StateCheckReport, ControlState]:
    """check_state_only over stored rows (TraceReader.stored_rows): the report and the state it leaves (every
    column flushed when the rows all pass). `fast` False: the scalar path alone, every event applied to the objects
    one at a time (no columns, runs or arrivals at once): the oracle the tests hold the fast paths to."""
    total = len(rows)
    state = ControlState.create(caps)
    state.columnar = fast  # this loop owns the state: steps of the common path in columns (atlas.state.columns)
    plain_until = 0 if fast else total  # a run that did not pass whole goes event by event up to here
    apply = state.apply
    types = EVENT_TYPES
    loads = json.loads
    load_event = codec.load_event
    finish_text = finish_text_in_columns
    # digests of the events applied one at a time, compared in batches (atlas.replay.digests)
    lazy = LazyDigests() if fast and comparable and state.prefix is None else None
    params: ParamsCache = {}  # codec-1 arrivals' params, validated once per text (atlas.replay.arrivals)
    try:
        i = 0
        while i < total:
            index, _step, kind, version, payload, recorded_digest = rows[i]
            cols = state.columns
            if (cols is not None and kind == "step_planned" and i >= plain_until and cols.fed is None
                    and not cols.gone):
                j = run_end(rows, i, cols.ids)
                if j - i >= 2 * MIN_RUN:
                    if apply_run(state, [r[4] for r in rows[i:j:2]], [r[4] for r in rows[i + 1:j:2]],
                                 [r[5] for r in rows[i:j]] if comparable else None):
                        i = j
                        continue
                    plain_until = j
            elif kind == "request_arrived" and i >= plain_until and version == ARRIVED_VERSION:
                form = type(payload)  # a run of JSON arrivals, or of codec-1 ones
                j = i + 1
                while (j < total and rows[j][2] == "request_arrived" and rows[j][3] == version
                       and type(rows[j][4]) is form):
                    j += 1
                if j - i >= MIN_ARRIVALS:
                    payloads = [r[4] for r in rows[i:j]]
                    recorded = [r[5] for r in rows[i:j]] if comparable else None
                    if (apply_parsed(state, parse_arrivals(payloads, params), recorded) if form is bytes
                            else apply_arrivals(state, payloads, recorded)):
                        i = j
                        continue
                    plain_until = j
            i += 1
            if (kind == "request_finished" and state.columns is not None and version == FINISHED_VERSION
                    and type(payload) is str):
                try:  # a finish of a row the columns hold, no event built (atlas.state.column_batch)
                    done = finish_text(state, payload)
                    if done is not None:
                        if state.pool.used + len(state.pool.free) != state.pool.total:
                            check_invariants(state, (done,), index)  # names it
                except InvariantViolation as exc:
                    return _first(lazy, total, state, StateCheckReport(total, str(exc), index))
                if done is not None:
                    report = _digest_wrong(lazy, comparable, total, state, recorded_digest, index)
                    if report is not None:
                        return report, state
                    continue
            if (kind == "step_executed" and version == EXECUTED_VERSION and state.columns is not None
                    and type(payload) is bytes):
                touched = execute_blob(state, payload)  # the plan in flight's execution, no event built
                if touched is not None:
                    try:
                        check_invariants(state, touched, index)
                    except InvariantViolation as exc:
                        return _first(lazy, total, state, StateCheckReport(total, str(exc), index))
                    report = _digest_wrong(lazy, comparable, total, state, recorded_digest, index)
                    if report is not None:
                        return report, state
                    continue
            cls = types.get(kind)
            if type(payload) is str and cls is not None and cls.version == version:
                e = cls(**loads(payload))
            else:
                e = load_event(kind, version, payload)
            if kind == "invariant_violated":  # the run itself recorded a violation: the trace fails there
                assert isinstance(e, InvariantViolated)
                return _first(lazy, total, state, StateCheckReport(
                    total, f"recorded invariant violation in {e.machine}: {e.message} {e.fields}", e.event_index))
            try:
                touched = None
                if state.columns is not None:  # the batch changed in place, no flush (atlas.state.column_batch)
                    if kind == "request_finished":
                        touched = finish_in_columns(state, e)
                    elif kind == "step_planned" and (e.admitted or state.columns.gone):
                        touched = plan_in_columns(state, e, payload if type(payload) is bytes else None)
                if touched is None:
                    if state.columns is not None and state.columns.gone:
                        state.flush_columns()  # rows whose sequence finished: only column_batch reads such columns
                    touched = apply(e)
                check_invariants(state, touched, index)
            except TransitionRefused as exc:
                return _first(lazy, total, state,
                              StateCheckReport(total, f"refused: {exc} {exc.fields}", index))
            except InvariantViolation as exc:
                return _first(lazy, total, state, StateCheckReport(total, str(exc), index))
            report = _digest_wrong(lazy, comparable, total, state, recorded_digest, index)
            if report is not None:
                return report, state
    except Exception:
        wrong = lazy.first_mismatch() if lazy is not None else None
        if wrong is None:
            raise  # an error at a row no earlier digest contradicts: as one at a time
        return _digest_report(total, wrong), state
    wrong = lazy.first_mismatch() if lazy is not None else None
    if wrong is not None:
        return _digest_report(total, wrong), state
    state.flush_columns()
    return StateCheckReport(total, None), state
