"""The run rows of a trace, checked, and the check a writer makes before it appends to a file: below the store
(atlas.replay.store writes, atlas.replay.reader reads; both check run rows here).

`run_record` turns a runs row into a RunRecord (JSON objects for config and capacities, a trace schema this Atlas
reads); `check_runs` checks every run row of a SQLite trace; `check_for_append` says whether a writer may append to
a file (absent, empty, or a whole Atlas trace), remembering a file it found whole as long as the file is unchanged.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import attrs

from atlas.errors import TraceFileError
from atlas.replay.sqlite_file import check_tables, connect_readonly, problem_of, where

# The trace schema: 2 since prefix keys, the in-flight plan's digest share and every persisted hash are specified
# functions of bytes (atlas.hashing) and rollbacks restore as an order of the next plan. The run row's config
# carries it as "trace_schema" (absent: 1). Schema-1 digests used Python's tuple hash for the in-flight plan, so
# a replay compares a schema-1 trace's events and payloads (upcast) but not its digests.
TRACE_SCHEMA = 2


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


RUN_COLUMNS = ("run_id, engine_version, git_revision, model, model_fingerprint, backend, seed, config, "
                "capacities")


def run_record(row: Any, name: str) -> RunRecord:
    """A runs row as a RunRecord, checked: JSON objects for config and capacities, a schema this Atlas reads."""
    run_id = row[0]
    if type(run_id) is not int:
        raise TraceFileError(f"{name}: a run row's id is {run_id!r}, not an integer")
    parsed = []
    for field, text in (("config", row[7]), ("capacities", row[8])):
        try:
            value = json.loads(text)
        except (TypeError, ValueError):
            value = None
        if type(value) is not dict:
            raise TraceFileError(f"{name}: run {run_id}'s {field} is not a JSON object")
        parsed.append(value)
    for field, value in zip(("engine_version", "model", "model_fingerprint", "backend"), (row[1], *row[3:6]),
                            strict=True):
        if type(value) is not str:
            raise TraceFileError(f"{name}: run {run_id}'s {field} is {value!r}, not a string")
    schema = parsed[0].get("trace_schema", 1)
    if type(schema) is not int or not 1 <= schema <= TRACE_SCHEMA:
        raise TraceFileError(f"{name}: run {run_id} was recorded with trace schema {schema!r}; this Atlas reads "
                             f"schemas 1-{TRACE_SCHEMA} (a newer Atlas wrote it: read it with that one)")
    return RunRecord(run_id=run_id, engine_version=row[1], git_revision=row[2], model=row[3],
                     model_fingerprint=row[4], backend=row[5], seed=row[6], config=parsed[0], capacities=parsed[1])


def check_runs(conn: sqlite3.Connection, name: str) -> list[RunRecord]:
    """Every run row of a SQLite trace, checked (run_record)."""
    try:
        found = conn.execute(f"SELECT {RUN_COLUMNS} FROM runs ORDER BY run_id").fetchall()
    except sqlite3.Error as exc:
        raise TraceFileError(f"{name} {problem_of(exc)}") from None
    return [run_record(r, name) for r in found]


def check_for_append(path: Path) -> None:
    """A store a writer may append to: absent, empty, a SQLite database without tables, or a whole Atlas trace
    (tables as check_tables wants, PRAGMA quick_check clean: a read of the whole file, once for a file as it is).
    Read without writing; else TraceFileError."""
    try:
        if not path.exists() and not path.is_symlink() or path.is_file() and path.stat().st_size == 0:
            return
    except OSError as exc:
        raise TraceFileError(f"{where(path)} cannot be read ({exc.strerror})") from None
    stamp = _stamp(path)
    if stamp is not None and stamp == _CHECKED.get(str(path.resolve())):
        return  # checked whole as it is now (the CLI checks before it loads a model; the writer checks again)
    conn, close = connect_readonly(path)
    try:
        if check_tables(conn, path, empty_ok=True) is not None:
            check_runs(conn, where(path))
        try:
            verdict = [r[0] for r in conn.execute("PRAGMA quick_check(3)")]
        except sqlite3.Error as exc:
            raise TraceFileError(f"{where(path)} {problem_of(exc)}") from None
        if verdict != ["ok"]:
            raise TraceFileError(f"{where(path)} is corrupt (quick_check: {'; '.join(verdict)}); record to another "
                                 "path")
    finally:
        close()
    if stamp is not None:
        _CHECKED[str(path.resolve())] = stamp


# path -> (size, mtime, -wal size, mtime) of the file when check_for_append last found it whole
_CHECKED: dict[str, tuple[int, ...]] = {}


def _stamp(path: Path) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
        wal = os.stat(f"{path}-wal") if os.path.exists(f"{path}-wal") else None
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, *((wal.st_size, wal.st_mtime_ns) if wal else (-1, -1)))
