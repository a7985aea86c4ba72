"""Reading a trace: the runs, each run's events (checked, upcast), and how its recording ended.

A SQLite trace is opened without writing a byte (atlas.replay.sqlite_file: `immutable`, or the -wal read through a
read-only -shm) after its file and tables are checked; any other SQLAlchemy URL is read through SQLAlchemy. What the
file holds is trusted only once checked: a run row's config and capacities are JSON objects of a trace schema this
Atlas reads, an event row's index is the next one (gapless), its payload is its event (atlas.replay.rows). Every
problem is a TraceFileError naming the file, and the run and event where there is one.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import sqlalchemy as sa

from atlas.config import Capacities, EngineConfig
from atlas.errors import TraceFileError
from atlas.replay import codec
from atlas.replay.rows import BadRow, check_event, check_row
from atlas.replay.run_rows import RUN_COLUMNS, RunRecord, check_runs, run_record
from atlas.replay.sqlite_file import check_tables, connect_readonly, problem_of, sqlite_path, where
from atlas.replay.store import SELECT_EVENTS, EventRecord, events, run_status
from atlas.state.events import EVENT_TYPES, Event

StoredRow = tuple[int, int, str, int, "str | bytes", str]



@attrs.frozen
class RunEnd:
    """How a run's recording ended: `ended` (the run-end marker is there and counts the events on disk),
    `truncated` (the writer never closed: the run stops at its last event on disk), `lost` (the marker counts more
    events than are on disk: the last ones went after the run ended), `corrupt` (more events than the marker counts,
    or a gap in their indices), or `unmarked` (recorded before run-end markers)."""

    status: str
    events: int  # events on disk
    last_index: int | None = None
    last_step: int | None = None
    marked: int | None = None  # the events the run-end marker counts

    @property
    def truncated(self) -> bool:
        """The run is not whole: no replay of it can be called clean."""
        return self.status in ("truncated", "lost", "corrupt")

    def describe(self) -> str:
        at = "no event" if self.last_index is None else f"event {self.last_index} (step {self.last_step})"
        if self.status == "lost":
            return (f"TRUNCATED: the run-end marker counts {self.marked} events, {self.events} are on disk (the last "
                    f"{self.marked - self.events} lost after the run ended); the trace stops at {at}")
        if self.status == "corrupt":
            return (f"CORRUPT: {self.events} events on disk, the last {at}; the run-end marker counts "
                    f"{self.marked if self.marked is not None else 'none'}: events are missing or extra")
        return (f"TRUNCATED: the run did not end cleanly (no run-end marker); the trace stops at {at}, "
                f"{self.events} events on disk")


def capacities_of(run: RunRecord, name: str) -> Capacities:
    """The run's recorded capacities (replay check's), or a TraceFileError naming the run."""
    try:
        return Capacities.from_table(run.capacities)
    except (TypeError, ValueError) as exc:
        raise TraceFileError(f"{name}: run {run.run_id}'s capacities are not this Atlas's ({exc})") from None


def check_config(run: RunRecord, name: str) -> None:
    """The run's recorded config builds this Atlas's EngineConfig (what a replay builds), else a TraceFileError."""
    try:
        EngineConfig.from_json(run.config)
    except (TypeError, ValueError, KeyError) as exc:
        raise TraceFileError(f"{name}: run {run.run_id}'s config is not an engine config this Atlas builds "
                             f"({type(exc).__name__}: {exc})") from None


def pick_run(found: list[RunRecord], run_id: int | None, name: str = "the trace") -> RunRecord:
    if not found:
        raise LookupError(f"{name} holds no run")
    if run_id is None:
        return found[-1]
    for r in found:
        if r.run_id == run_id:
            return r
    raise LookupError(f"no run {run_id} in the {name} (runs: {[r.run_id for r in found]})")


def bad_row(name: str, run_id: int, row: Any, why: str) -> TraceFileError:
    return TraceFileError(f"{name}: run {run_id}, event {row[0]!r} ({row[2]} v{row[3]}): {why}")


def first_bad_row(rows: list[StoredRow]) -> tuple[Any, str] | None:
    """The first stored row that is not its event, and why; None when every row is."""
    for expected, row in enumerate(rows):
        why = _row_problem(row, expected)
        if why is not None:
            return row, why
    return None


def _row_problem(row: Any, expected: int) -> str | None:
    idx, step, kind, version, payload, digest = row
    if idx != expected or type(idx) is not int:
        return f"index {idx!r} where {expected} was due (an event is missing or out of place)"
    if type(step) is not int or type(digest) is not str:
        return f"step {step!r} and digest {digest!r} are not an integer and a string"
    try:
        check_event(kind, version, payload)
    except BadRow as exc:
        return str(exc)
    return None


class TraceReader:
    def __init__(self, path_or_url: str | Path) -> None:
        self.path = sqlite_path(path_or_url)
        self.name = where(self.path if self.path is not None else path_or_url)
        self._close: Callable[[], None] | None = None
        if self.path is not None:
            conn, self._close = connect_readonly(self.path)
            try:
                self._has_status = check_tables(conn, self.path)
            except BaseException:
                self._close()
                raise
            self.db = sa.create_engine("sqlite://", creator=lambda: conn, poolclass=sa.pool.StaticPool)
            return
        try:
            self.db = sa.create_engine(str(path_or_url))
        except (ImportError, sa.exc.ArgumentError) as exc:  # no driver for that database here, a bad URL
            raise TraceFileError(f"{self.name} cannot be opened ({type(exc).__name__}: {exc})") from None
        try:
            inspect = sa.inspect(self.db)
            if not (inspect.has_table("runs") and inspect.has_table("events")):
                raise TraceFileError(f"{self.name} holds no Atlas trace (no runs and events tables)")
            self._has_status = inspect.has_table("run_status")
        except sa.exc.DBAPIError as exc:
            raise TraceFileError(f"{self.name} {problem_of(exc)}") from None

    def _failed(self, exc: BaseException) -> TraceFileError:
        return TraceFileError(f"{self.name} {problem_of(exc)}")

    def runs(self) -> list[RunRecord]:
        try:
            with self.db.connect() as conn:
                rows = conn.execute(sa.text(f"SELECT {RUN_COLUMNS} FROM runs ORDER BY run_id")).all()
        except (sa.exc.DBAPIError, sqlite3.Error) as exc:
            raise self._failed(exc) from None
        return [run_record(r, self.name) for r in rows]

    def run(self, run_id: int | None = None) -> RunRecord:
        return pick_run(self.runs(), run_id, self.name)

    def events(self, run_id: int) -> Iterator[EventRecord]:
        for row in self.rows(run_id):
            yield EventRecord(*row)

    def _cursor(self, conn: Any, run_id: int) -> Any:
        if self.db.dialect.name == "sqlite":
            return conn.connection.driver_connection.execute(SELECT_EVENTS, (run_id,))
        return conn.execute(sa.select(events.c.idx, events.c.step, events.c.kind, events.c.version,
                                      events.c.payload, events.c.digest)
                            .where(events.c.run_id == run_id).order_by(events.c.idx))

    def _stored(self, run_id: int) -> Iterator[StoredRow]:
        """The rows as stored, any read error a TraceFileError."""
        try:
            with self.db.connect() as conn:
                yield from self._cursor(conn, run_id)
        except (sa.exc.DBAPIError, sqlite3.Error) as exc:
            raise self._failed(exc) from None

    def rows(self, run_id: int) -> Iterator[tuple[int, int, str, int, dict[str, Any], str]]:
        """(index, step, kind, version, payload upcast to the current version, digest) per event, in order, each
        checked (atlas.replay.rows): a row that is not its event is a TraceFileError naming it."""
        for expected, row in enumerate(self._stored(run_id)):
            idx, step, kind, version, payload, digest = row
            if idx != expected or type(step) is not int or type(digest) is not str:
                raise bad_row(self.name, run_id, row, _row_problem(row, expected) or "")
            try:
                payload = check_row(kind, version, payload)
            except BadRow as exc:
                raise bad_row(self.name, run_id, row, str(exc)) from None
            yield idx, step, kind, version, payload, digest

    def recorded_rows(self, run_id: int) -> Iterator[tuple[int, int, str, int, dict[str, Any], str]]:
        """As `rows`, but each payload as recorded (its own version, never upcast), checked all the same."""
        for expected, row in enumerate(self._stored(run_id)):
            idx, step, kind, version, raw, digest = row
            why = _row_problem(row, expected)
            if why is not None:
                raise bad_row(self.name, run_id, row, why)
            yield idx, step, kind, version, codec.decode(kind, version, raw), digest

    def event_rows(self, run_id: int) -> Iterator[tuple[int, int, str, Event, str]]:
        """(index, step, kind, event upcast to the current version, digest) per event, in order: a codec-1
        payload becomes its event directly (no dict, no converters)."""
        load_event = codec.load_event
        types = EVENT_TYPES
        for row in self._stored(run_id):
            idx, step, kind, version, payload, digest = row
            try:
                cls = types.get(kind)
                if type(payload) is str and cls is not None and cls.version == version:
                    e = cls(**json.loads(payload))
                else:
                    e = load_event(kind, version, payload)
            except Exception:
                why = _row_problem(row, idx) or "its payload does not build its event"
                raise bad_row(self.name, run_id, row, why) from None
            yield idx, step, kind, e, digest

    def stored_rows(self, run_id: int) -> list[StoredRow]:
        """(index, step, kind, version, payload as stored: JSON text or codec-1 bytes, digest) per event, in order,
        nothing decoded or checked (replay check decodes what it applies; first_bad_row names a row it cannot)."""
        return [tuple(r) for r in self._stored(run_id)]  # type: ignore[misc]

    def end(self, run_id: int) -> RunEnd:
        """Whether the run ended cleanly (its run-end marker, counting the events on disk), and where they stop."""
        try:
            with self.db.connect() as conn:
                marker = None
                if self._has_status:  # a trace written before run-end markers has no such table
                    marker = conn.execute(sa.select(run_status).where(run_status.c.run_id == run_id)
                                          ).mappings().first()
                last = conn.execute(sa.select(events.c.idx, events.c.step).where(events.c.run_id == run_id)
                                    .order_by(events.c.idx.desc()).limit(1)).first()
                n = int(conn.execute(sa.select(sa.func.count()).where(events.c.run_id == run_id)).scalar_one())
        except (sa.exc.DBAPIError, sqlite3.Error) as exc:
            raise self._failed(exc) from None
        last_index = None if last is None else last[0]
        last_step = None if last is None else last[1]
        marked = None if marker is None else marker["events"]
        gap = last_index is not None and last_index != n - 1
        if marker is None:
            status = "corrupt" if gap else "unmarked"
        elif not marker["ended"]:
            status = "corrupt" if gap else "truncated"
        elif type(marked) is not int:  # an ended marker always counts its events
            status = "corrupt"
        else:
            status = "lost" if n < marked and not gap else "ended" if n == marked and not gap else "corrupt"
        return RunEnd(status, n, last_index, last_step, marked)

    def count_events(self, run_id: int) -> int:
        return self.end(run_id).events

    def close(self) -> None:
        self.db.dispose()
        if self._close is not None:
            self._close()
            self._close = None


def read_stored(path_or_url: str | Path, run_id: int | None = None) -> tuple[RunRecord, list[StoredRow]]:
    """One run (the last one unless `run_id` says) and its rows as stored (TraceReader.stored_rows), for replay
    check. A SQLite file is read with the sqlite3 module alone: SQLAlchemy's engine, its dialect set-up, the table
    inspection and the runs query around the fetch were 26 M of a 304 M-instruction check
    (benchmarks/replay_check.py's trace). A URL goes through TraceReader."""
    path = sqlite_path(path_or_url)
    if path is None:
        reader = TraceReader(path_or_url)
        try:
            run = reader.run(run_id)
            return run, reader.stored_rows(run.run_id)
        finally:
            reader.close()
    conn, close = connect_readonly(path)
    name = where(path)
    try:
        check_tables(conn, path)
        run = pick_run(check_runs(conn, name), run_id, name)
        try:
            return run, conn.execute(SELECT_EVENTS, (run.run_id,)).fetchall()
        except sqlite3.Error as exc:
            raise TraceFileError(f"{name} {problem_of(exc)}") from None
    finally:
        close()


def read_run(path_or_url: str | Path, run_id: int | None = None) -> tuple[RunRecord, list[EventRecord]]:
    """One run of a trace (the last one unless `run_id` says) and all of its events, checked, upcast, in order."""
    reader = TraceReader(path_or_url)
    try:
        run = reader.run(run_id)
        return run, list(reader.events(run.run_id))
    finally:
        reader.close()
