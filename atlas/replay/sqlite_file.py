"""A trace's SQLite file: what a reader checks before it trusts one, and how it reads one without writing a byte.

Checked before any query: the path is a regular, non-empty file that starts with SQLite's header, whose page size
is one SQLite writes and whose length holds the pages the header counts (a file cut short says so here, not as a
"malformed" error half way through a read); then the tables: `runs` and `events` with every column this Atlas reads
(`run_status` too when there). Each problem is a TraceFileError naming the file and what is wrong.

A reader never writes. SQLite's own read-only mode (`mode=ro`) still rewrites the -shm (the WAL index) and, on a
WAL database whose -wal is gone, creates one; the last connection of a normal open checkpoints the -wal into the
database and deletes the -wal and -shm. So a reader opens:
- no -wal (a run that ended, or a store not in WAL mode): `immutable=1`, no lock, no side file, nothing written;
- a -wal beside its -shm (a live writer, or one killed): `mode=ro&readonly_shm=1`: the -shm is mapped read-only
  (a live writer keeps it current; with none, SQLite reads the -wal into its own memory), nothing written;
- a -wal without its -shm (files copied without it): the database and the -wal copied into a temporary directory,
  opened there, and removed at close.
A writer that starts on the file while an `immutable` reader reads it may show that reader a torn page (reported
as corrupt, never read as data): read a live trace while its -wal exists, as it does from the writer's first commit.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import sqlalchemy as sa

from atlas.errors import TraceFileError, TraceMissing

MAGIC = b"SQLite format 3\x00"
RUNS_COLUMNS = ("run_id", "engine_version", "git_revision", "model", "model_fingerprint", "backend", "seed",
                "config", "capacities")
EVENTS_COLUMNS = ("run_id", "idx", "step", "kind", "version", "payload", "digest")
STATUS_COLUMNS = ("run_id", "ended", "events")


def where(path: Path | str) -> str:
    """How a message names the file (a URL without its password)."""
    text = str(path)
    if "://" in text:
        try:
            text = sa.engine.make_url(text).render_as_string(hide_password=True)
        except sa.exc.ArgumentError:
            pass
    return f"trace {text!r}"


def sqlite_path(path_or_url: str | Path) -> Path | None:
    """The file a trace path or `sqlite:///` URL names; None for another database's URL (read through SQLAlchemy)."""
    text = str(path_or_url)
    if "://" not in text:
        return Path(text).expanduser()
    try:
        url = sa.engine.make_url(text)
    except sa.exc.ArgumentError as exc:
        raise TraceFileError(f"trace URL {text!r} is not a SQLAlchemy URL ({exc})") from None
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:" and not url.query:
        return Path(url.database).expanduser()
    return None


def _header_problem(head: bytes, size: int, has_wal: bool) -> str | None:
    if len(head) < 100 or not head.startswith(MAGIC):
        hint = " (it looks like JSON lines: `atlas trace import` reads those)" if head[:1] in (b"{", b"[") else ""
        return f"is not a SQLite database ({size} bytes that do not start with SQLite's header){hint}"
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page
    if page < 512 or page > 65536 or page & (page - 1):
        return f"is corrupt: its header gives a page size of {page} bytes (SQLite writes powers of 2, 512-65536)"
    if has_wal:  # the -wal may hold pages a checkpoint had not yet written back: the file alone is no measure
        return None
    pages = int.from_bytes(head[28:32], "big")
    counted = head[24:28] == head[92:96] and pages > 0  # the header's page count is valid (SQLite's own test)
    if size % page or counted and size < pages * page:
        whole = pages * page if counted else (size // page + 1) * page
        return (f"is truncated: {size} bytes where its header says {whole} ({pages if counted else '?'} pages of "
                f"{page} bytes)")
    return None


def check_file(path: Path, *, has_wal: bool | None = None) -> None:
    """A regular, non-empty SQLite file, whole by its header; else TraceFileError naming it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TraceMissing(f"{where(path)} does not exist; pass the path a run was recorded to "
                             "(--trace PATH)") from None
    except OSError as exc:
        raise TraceFileError(f"{where(path)} cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise TraceFileError(f"{where(path)} is a directory; pass the trace file (a SQLite path)")
    if not stat.S_ISREG(st.st_mode):
        raise TraceFileError(f"{where(path)} is not a regular file")
    if st.st_size == 0:
        raise TraceFileError(f"{where(path)} is empty (0 bytes): no run was recorded to it")
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError as exc:
        raise TraceFileError(f"{where(path)} cannot be read ({exc.strerror})") from None
    if has_wal is None:
        has_wal = _wal_size(path) > 0
    problem = _header_problem(head, st.st_size, has_wal)
    if problem is not None:
        raise TraceFileError(f"{where(path)} {problem}")


def _wal_size(path: Path) -> int:
    try:
        return os.stat(f"{path}-wal").st_size
    except OSError:
        return -1


def _uri(path: Path, query: str) -> str:
    return f"file:{quote(str(path.resolve()))}?{query}"


def connect_readonly(path: Path) -> tuple[sqlite3.Connection, Callable[[], None]]:
    """A sqlite3 connection that reads `path` without writing to it, its -wal or its -shm (the module's doc), and
    the function that closes it (and removes a temporary copy). Checks the file first (check_file)."""
    wal = _wal_size(path)
    shm = os.path.exists(f"{path}-shm")
    check_file(path, has_wal=wal > 0)
    copy: str | None = None
    if wal > 0 and not shm:
        copy = tempfile.mkdtemp(prefix="atlas-trace-")
        target = Path(copy) / "trace.db"
        shutil.copyfile(path, target)
        shutil.copyfile(f"{path}-wal", f"{target}-wal")
        uri = _uri(target, "mode=ro")
    elif wal >= 0 and shm:
        uri = _uri(path, "mode=ro&readonly_shm=1")
    else:
        uri = _uri(path, "immutable=1")
    try:
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
    except sqlite3.Error as exc:
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)
        raise TraceFileError(f"{where(path)} cannot be opened ({exc})") from None

    def close() -> None:
        conn.close()
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)

    return conn, close


def problem_of(exc: BaseException) -> str:
    """What a SQLite (or SQLAlchemy) error says about the file, in a few words."""
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(str(orig).split())
    if text == "file is not a database":
        return "is not a SQLite database, or is encrypted or corrupt (file is not a database)"
    if "malformed" in text:
        return f"is corrupt ({text})"
    if "no such table" in text or "no such column" in text:
        return f"is not a trace this Atlas reads ({text})"
    return f"cannot be read ({type(orig).__name__}: {text})"


def check_tables(conn: sqlite3.Connection, path: Path | str, *, empty_ok: bool = False) -> bool | None:
    """The trace's tables hold every column this Atlas reads; returns whether it has run-end markers (run_status).
    `empty_ok`: a database without tables passes, as None (a writer creates them). Else TraceFileError naming the
    file."""
    try:
        names = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        columns = {t: [r[1] for r in conn.execute(f"PRAGMA table_info({t})")] for t in ("runs", "events",
                                                                                         "run_status")}
    except sqlite3.Error as exc:
        raise TraceFileError(f"{where(path)} {problem_of(exc)}") from None
    if not names and empty_ok:
        return None
    if not columns["runs"] and not columns["events"]:
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise TraceFileError(f"{where(path)} is a SQLite database but not an Atlas trace "
                             f"({'no tables' if not names else 'its tables: ' + shown})")
    for table, need in (("runs", RUNS_COLUMNS), ("events", EVENTS_COLUMNS), ("run_status", STATUS_COLUMNS)):
        have = columns[table]
        if not have and table != "run_status":
            raise TraceFileError(f"{where(path)} has no {table} table: not a whole Atlas trace")
        missing = [c for c in need if have and c not in have]
        if missing:
            raise TraceFileError(f"{where(path)}: its {table} table lacks {', '.join(missing)}: a schema this Atlas "
                                 f"does not read (it reads {table}({', '.join(need)}))")
    return bool(columns["run_status"])


def space_note(path: Path | str) -> str:
    """Room left for `path`: the file-size limit when one is set, else the free bytes on its device."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            return f"; the file-size limit (ulimit -f) is {soft} bytes"
    except (ImportError, OSError, ValueError):
        pass
    try:
        free = shutil.disk_usage(Path(path).expanduser().resolve().parent).free
    except OSError:
        return ""
    return f"; {free / 2**20:.1f} MiB free on its device"
