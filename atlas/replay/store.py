"""The trace store: SQLAlchemy Core, SQLite in WAL mode by default, any SQLAlchemy URL accepted.

One `runs` row per engine run (engine version, git revision, config, capacities, model fingerprint,
backend, seed) and one `events` row per event (index, step, kind, version, payload JSON, digest of the
control-plane state after it). Writes are buffered and go out with one executemany per batch, so logging
stays off the step's critical path; `flush` is called on close and before a fatal fault raises.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import sqlalchemy as sa

from atlas.state.events import EVENT_TYPES, Event, upcast

# The trace schema: 2 since prefix keys, the in-flight plan's digest share and every persisted hash are specified
# functions of bytes (atlas.hashing) and rollbacks restore as an order of the next plan. The run row's config
# carries it as "trace_schema" (absent: 1). Schema-1 digests used Python's tuple hash for the in-flight plan, so
# a replay compares a schema-1 trace's events and payloads (upcast) but not its digests.
TRACE_SCHEMA = 2

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


def trace_url(path_or_url: str | Path) -> str:
    text = str(path_or_url)
    return text if "://" in text else f"sqlite:///{Path(text).expanduser()}"


def open_database(path_or_url: str | Path) -> sa.Engine:
    url = trace_url(path_or_url)
    db = sa.create_engine(url)
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
class RunRecord:
    run_id: int
    engine_version: str
    git_revision: str | None
    model: str
    model_fingerprint: str
    backend: str
    seed: int | None
    config: dict[str, Any]
    capacities: dict[str, Any]

    @property
    def schema(self) -> int:
        return int(self.config.get("trace_schema", 1))

    @property
    def digests_comparable(self) -> bool:
        """Whether this engine computes the trace's digests the same way (schema 2 on)."""
        return self.schema >= 2


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


class TraceWriter:
    """Appends one run's events. Not thread-safe: the engine loop is its only caller."""

    def __init__(self, path_or_url: str | Path, *, run: dict[str, Any], batch_rows: int = 1024) -> None:
        self.db = open_database(path_or_url)
        self.batch_rows = batch_rows
        self._rows: list[dict[str, Any]] = []
        self.events_written = 0
        self.bytes_written = 0
        row = {**run, "config": json.dumps(run["config"]), "capacities": json.dumps(run["capacities"])}
        with self.db.begin() as conn:
            self.run_id = int(conn.execute(sa.insert(runs).values(**row)).inserted_primary_key[0])

    def append(self, index: int, step: int, e: Event, digest: str) -> None:
        payload = e.payload_json()
        self._rows.append({"run_id": self.run_id, "idx": index, "step": step, "kind": e.kind,
                           "version": e.version, "payload": payload, "digest": digest})
        self.bytes_written += len(payload) + len(e.kind) + len(digest) + 12  # ~ a row's size
        if len(self._rows) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        with self.db.begin() as conn:
            conn.execute(events.insert(), rows)
        self.events_written += len(rows)

    def close(self) -> None:
        self.flush()
        self.db.dispose()


class TraceReader:
    def __init__(self, path_or_url: str | Path) -> None:
        if "://" not in str(path_or_url) and not Path(path_or_url).exists():
            raise FileNotFoundError(f"no trace at {path_or_url}")
        self.db = open_database(path_or_url)

    def runs(self) -> list[RunRecord]:
        with self.db.connect() as conn:
            rows = conn.execute(sa.select(runs).order_by(runs.c.run_id)).mappings().all()
        return [
            RunRecord(
                run_id=r["run_id"], engine_version=r["engine_version"], git_revision=r["git_revision"],
                model=r["model"], model_fingerprint=r["model_fingerprint"], backend=r["backend"], seed=r["seed"],
                config=json.loads(r["config"]), capacities=json.loads(r["capacities"]),
            )
            for r in rows
        ]

    def run(self, run_id: int | None = None) -> RunRecord:
        all_runs = self.runs()
        if not all_runs:
            raise LookupError("the trace holds no run")
        if run_id is None:
            return all_runs[-1]
        for r in all_runs:
            if r.run_id == run_id:
                return r
        raise LookupError(f"no run {run_id} in the trace (runs: {[r.run_id for r in all_runs]})")

    def events(self, run_id: int) -> Iterator[EventRecord]:
        query = sa.select(events).where(events.c.run_id == run_id).order_by(events.c.idx)
        with self.db.connect() as conn:
            for r in conn.execute(query).mappings():
                payload = upcast(r["kind"], r["version"], json.loads(r["payload"]))
                yield EventRecord(r["idx"], r["step"], r["kind"], r["version"], payload, r["digest"])

    def count_events(self, run_id: int) -> int:
        with self.db.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(events.c.run_id == run_id)).scalar_one())

    def close(self) -> None:
        self.db.dispose()


def read_run(path_or_url: str | Path, run_id: int | None = None) -> tuple[RunRecord, list[EventRecord]]:
    """One run of a trace (the last one unless `run_id` says) and all of its events, upcast, in order."""
    reader = TraceReader(path_or_url)
    try:
        run = reader.run(run_id)
        return run, list(reader.events(run.run_id))
    finally:
        reader.close()
