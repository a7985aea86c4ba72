"""The trace store: SQLAlchemy Core, SQLite in WAL mode by default, any SQLAlchemy URL accepted.

One `runs` row per engine run (engine version, git revision, config, capacities, model fingerprint,
backend, seed), one `events` row per event (index, step, kind, version, payload JSON, digest of the
control-plane state after it), and one `run_status` row per run: written open when the run starts and
closed (the run-end marker) when the writer closes, so a run that did not end cleanly (kill -9, a full disk)
reads as truncated at its last event. Runs recorded before the marker existed have no status row.

Write-ahead: the server commits each step's events (`commit`, or `commit_async` on the writer's own
thread, in order) before it hands that step's outputs to any client, so every byte a client received is
backed by events on disk. WAL + synchronous=NORMAL: a commit survives a process crash (kill -9); an OS
crash or power loss may lose the last commits.

A writer appends to an existing file only when it is a whole Atlas trace (atlas.replay.run_rows.check_for_append);
a store it cannot open or write (a full disk, a foreign file) is a TraceFileError naming it. Reading is
atlas.replay.reader's (read-only, every row checked); the run rows' checks and RunRecord are
atlas.replay.run_rows'.
"""

from __future__ import annotations

import json
import queue
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import sqlalchemy as sa

from atlas.errors import TraceFileError
from atlas.replay import codec
from atlas.replay.run_rows import check_for_append
from atlas.replay.sqlite_file import space_note, sqlite_path, where
from atlas.state.events import EVENT_TYPES, Event

metadata = sa.MetaData()

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("run_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("engine_version", sa.String(32), nullable=False),
    sa.Column("git_revision", sa.String(64)),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("model_fingerprint", sa.String(128), nullable=False),
    sa.Column("backend", sa.String(32), nullable=False),
    sa.Column("seed", sa.Integer),
    sa.Column("config", sa.Text, nullable=False),
    sa.Column("capacities", sa.Text, nullable=False),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.run_id"), primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),  # gapless, never a timestamp
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("kind", sa.String(48), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("digest", sa.String(16), nullable=False),
)

# the run-end marker: ended 0 while the run is being written, 1 once its writer closed with every event on disk
run_status = sa.Table(
    "run_status",
    metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.run_id"), primary_key=True),
    sa.Column("ended", sa.Integer, nullable=False),
    sa.Column("events", sa.Integer),  # events on disk when it ended
)

SELECT_EVENTS = "SELECT idx, step, kind, version, payload, digest FROM events WHERE run_id = ? ORDER BY idx"
_INSERT_EVENT = ("INSERT INTO events (run_id, idx, step, kind, version, payload, digest) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?)")


def trace_url(path_or_url: str | Path) -> str:
    text = str(path_or_url)
    return text if "://" in text else f"sqlite:///{Path(text).expanduser()}"


def open_database(path_or_url: str | Path) -> sa.Engine:
    """The writer's engine, with the tables it needs (readers open a trace read-only: atlas.replay.reader)."""
    url = trace_url(path_or_url)
    is_sqlite = url.startswith("sqlite")
    # the writer commits from its own thread: one connection, used by one thread at a time (under a lock)
    db = sa.create_engine(url, connect_args={"check_same_thread": False} if is_sqlite else {})
    if db.dialect.name == "sqlite":

        @sa.event.listens_for(db, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process crash
            cur.close()

    metadata.create_all(db)
    return db


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


@attrs.frozen
class EventRecord:
    index: int
    step: int
    kind: str
    version: int
    payload: dict[str, Any]  # upcast to the current version of its kind
    digest: str

    def event(self) -> Event:
        return EVENT_TYPES[self.kind](**self.payload)  # the payload is upcast already


Done = Callable[[BaseException | None], None]


class TraceWriteError(RuntimeError):
    """A commit to the trace store failed (a full disk, an I/O error). Sticky: every later commit fails too,
    since events past a gap could never be replayed."""


class TraceWriter:
    """Appends one run's events. `append` buffers (the engine thread); `commit` writes the buffer in one
    transaction; `commit_async` hands it to the writer's own thread, which commits batches in order (whatever
    queued up meanwhile in one transaction) and then calls each batch's `done(None)`, or `done(error)` once a
    commit failed."""

    def __init__(self, path_or_url: str | Path, *, run: dict[str, Any], batch_rows: int = 1024,
                 mark_end: bool = True, binary: bool = True) -> None:
        self.batch_rows = batch_rows
        self._rows: list[dict[str, Any]] = []
        self.events_written = 0  # events committed to the store: what atlas:trace_events_written counts
        self.bytes_written = 0
        self.commits = 0  # transactions that wrote events, and the time they took (benchmarks/server_trace.py)
        self.commit_seconds = 0.0
        self.failed: TraceWriteError | None = None
        self._lock = threading.Lock()  # one transaction at a time on the one connection
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._mark = mark_end  # False: no run-end marker (an imported run recorded before markers existed)
        self._open(path_or_url, run)
        # codec-1 step payloads: SQLite only (a BLOB in the payload column; another store's Text column keeps JSON)
        self.binary = binary and self._raw is not None

    def _open(self, path_or_url: str | Path, run: dict[str, Any]) -> None:
        """The store, its tables and this run's row (and open run-end marker). An existing file must be a whole
        Atlas trace (run_rows.check_for_append); a store that cannot be written (a full disk, a directory that
        is not there, a file that is not a database) is a TraceFileError naming it."""
        path = sqlite_path(path_or_url)
        name = where(path if path is not None else path_or_url)
        if path is not None:
            check_for_append(path)
        created = path is not None and not path.exists()
        row = {**run, "config": json.dumps(run["config"]), "capacities": json.dumps(run["capacities"])}
        self.db = None
        try:
            self.db = open_database(path_or_url)
            self._conn = self.db.connect()
            self._raw = self._conn.connection.driver_connection if self.db.dialect.name == "sqlite" else None
            with self._conn.begin():
                self.run_id = int(self._conn.execute(sa.insert(runs).values(**row)).inserted_primary_key[0])
                if self._mark:
                    self._conn.execute(sa.insert(run_status).values(run_id=self.run_id, ended=0))
        except (sa.exc.DBAPIError, sa.exc.ArgumentError, sqlite3.Error, OSError, ImportError) as exc:
            if self.db is not None:
                self.db.dispose()
            if created:  # what the failed open made, so that the path reads as before (absent), not as empty
                for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-journal")):
                    leftover.unlink(missing_ok=True)
            problem = " ".join(str(getattr(exc, "orig", None) or exc).split())
            room = space_note(path) if path is not None else ""
            raise TraceFileError(f"{name} cannot be written ({problem}){room}") from None

    def append(self, index: int, step: int, e: Event, digest: str) -> None:
        # SQLite: step events in codec 1 (atlas.replay.codec: a BLOB of int64s), everything else JSON text
        payload = codec.encode(e) if self.binary else None
        self.append_row(index, step, e.kind, e.version, e.payload_json() if payload is None else payload, digest)

    def append_row(self, index: int, step: int, kind: str, version: int, payload: str | bytes, digest: str) -> None:
        self._rows.append({"run_id": self.run_id, "idx": index, "step": step, "kind": kind,
                           "version": version, "payload": payload, "digest": digest})
        self.bytes_written += len(payload) + len(kind) + len(digest) + 12  # ~ a row's size
        if len(self._rows) >= self.batch_rows and self._thread is None:  # offline runs: bounded memory
            self.commit()

    # -- commits ---------------------------------------------------------------------------------------

    def _write(self, rows: list[dict[str, Any]]) -> None:
        """One transaction; the caller holds the lock."""
        if self.failed is not None:
            raise self.failed
        if not rows:
            return
        started = time.perf_counter()
        try:
            if self._raw is not None:  # raw sqlite3: 68 against Core's 177 us per 2-row commit (measured)
                self._raw.executemany(_INSERT_EVENT, [(r["run_id"], r["idx"], r["step"], r["kind"], r["version"],
                                                       r["payload"], r["digest"]) for r in rows])
                self._raw.commit()
            else:
                with self._conn.begin():
                    self._conn.execute(events.insert(), rows)
        except Exception as exc:
            self.failed = TraceWriteError(f"the trace store refused a commit of {len(rows)} events after "
                                          f"{self.events_written} on disk: {type(exc).__name__}: {exc}")
            if self._raw is not None:
                try:
                    self._raw.rollback()
                except Exception:  # the connection is broken too: nothing left to undo
                    pass
            raise self.failed from exc
        self.events_written += len(rows)
        self.commits += 1
        self.commit_seconds += time.perf_counter() - started

    def commit(self) -> None:
        """Write every buffered event now, after every batch still queued for the writer thread."""
        if threading.current_thread() is not self._thread:
            self._queue.join()
        rows, self._rows = self._rows, []
        with self._lock:
            self._write(rows)

    flush = commit

    def commit_async(self, done: Done) -> None:
        """Queue the buffered events for the writer thread; `done` is called there once they are on disk."""
        rows, self._rows = self._rows, []
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="atlas-trace-writer", daemon=True)
            self._thread.start()
        self._queue.put((rows, done))

    def _writer(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while batch[-1] is not None:  # group commit: what queued up during the last one goes in one
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is None:
                stop = True
            items = [item for item in batch if item is not None]
            error: BaseException | None = None
            with self._lock:
                try:
                    self._write([r for rows, _ in items for r in rows])
                except TraceWriteError as exc:
                    error = exc
            for _, done in items:
                try:
                    done(error)
                except Exception:  # a callback's failure must not stop the commits of the batches behind it
                    pass
            for _ in batch:
                self._queue.task_done()

    def inject_full_disk(self, spare_pages: int = 0) -> None:
        """Tests: SQLite's own 'database or disk is full' once the store needs more than `spare_pages` pages
        beyond those in use now (PRAGMA max_page_count)."""
        with self._lock:
            if self._raw is None:
                raise ValueError("inject_full_disk needs a SQLite trace")
            pages = int(self._raw.execute("PRAGMA page_count").fetchone()[0])
            self._raw.execute(f"PRAGMA max_page_count = {pages + int(spare_pages)}")

    def close(self, *, ended: bool = True) -> None:
        """Commit what is buffered, then write the run-end marker (`ended` False keeps the run marked
        truncated, as for an imported truncated run). Raises TraceWriteError when the store failed; the
        store is closed either way."""
        try:
            self.commit()
            if self._mark:
                with self._lock, self._conn.begin():
                    self._conn.execute(sa.update(run_status).where(run_status.c.run_id == self.run_id)
                                       .values(ended=int(ended), events=self.events_written))
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join(10)
                self._thread = None
            self._conn.close()
            self.db.dispose()
