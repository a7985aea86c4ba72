"""Traces as JSON lines, for diffing and sharing: a header line with the run, then one line per event.

Events are written as recorded (their schema version and payload as stored, never upcast), so
export -> import -> export round-trips byte for byte and an old trace stays old until it is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from atlas.errors import TraceFileError
from atlas.replay.reader import TraceReader
from atlas.replay.rows import BadRow, check_payload
from atlas.replay.run_rows import run_record
from atlas.replay.sqlite_file import space_note, where
from atlas.replay.store import TraceWriteError, TraceWriter

FORMAT = "atlas-trace"
FORMAT_VERSION = 1
_RUN_FIELDS = ("engine_version", "git_revision", "model", "model_fingerprint", "backend", "seed", "config",
               "capacities")
_ROW_FIELDS = frozenset(("index", "step", "kind", "version", "payload", "digest"))


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def raw_events(reader: TraceReader, run_id: int) -> Iterator[dict[str, Any]]:
    """A run's events as stored: payload parsed (JSON text, or a codec-1 step payload), never upcast, each row
    checked (a row that is not its event is a TraceFileError naming it)."""
    for idx, step, kind, version, payload, digest in reader.recorded_rows(run_id):
        yield {"index": idx, "step": step, "kind": kind, "version": version, "payload": payload, "digest": digest}


def export_jsonl(trace: str | Path, out: str | Path, run_id: int | None = None) -> int:
    """Write one run of `trace` to `out` as JSON lines; returns the number of events. Nothing is left at `out`
    when the trace cannot be read whole."""
    reader = TraceReader(trace)
    done = False
    try:
        run = reader.run(run_id)
        n = 0
        with open(out, "w") as f:
            header: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION,
                                      "run": {name: getattr(run, name) for name in _RUN_FIELDS}}
            end = reader.end(run.run_id)
            if end.status != "unmarked":  # the run-end marker travels, so a truncated run stays truncated
                header["end"] = {"ended": end.status == "ended"}
            f.write(_compact(header) + "\n")
            for row in raw_events(reader, run.run_id):
                f.write(_compact(row) + "\n")
                n += 1
        done = True
    except OSError as exc:  # a full disk, a file-size limit: the output is named, not the trace
        raise TraceFileError(f"--out {str(out)!r} cannot be written ({exc.strerror or exc}){space_note(out)}"
                             ) from None
    finally:
        reader.close()
        if not done:
            Path(out).unlink(missing_ok=True)
    return n


def _fail(src: str | Path, line: int, why: str) -> TraceFileError:
    return TraceFileError(f"JSON lines {str(src)!r}, line {line}: {why}")


def _parse(src: str | Path, line_no: int, line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError as exc:
        cut = "" if line.endswith("\n") else " (the last line is cut short: the file is truncated)"
        raise _fail(src, line_no, f"not JSON ({exc}){cut}") from None


def _check_header(src: str | Path, header: Any) -> dict[str, Any]:
    if type(header) is not dict or header.get("format") != FORMAT:
        found = header.get("format") if type(header) is dict else type(header).__name__
        raise _fail(src, 1, f"not an Atlas trace in JSON lines (header format {found!r}, want {FORMAT!r})")
    version = header.get("format_version", 0)
    if type(version) is not int or version > FORMAT_VERSION:
        raise _fail(src, 1, f"format version {version!r} is not one this Atlas reads (1-{FORMAT_VERSION})")
    run = header.get("run")
    if type(run) is not dict or any(name not in run for name in _RUN_FIELDS):
        missing = [n for n in _RUN_FIELDS if type(run) is not dict or n not in run]
        raise _fail(src, 1, f"the header's run lacks {', '.join(missing)}")
    try:
        run_record((0, *(run[n] for n in _RUN_FIELDS[:6]), json.dumps(run["config"]), json.dumps(run["capacities"])),
                   f"JSON lines {str(src)!r}, line 1")
    except TraceFileError as exc:
        raise TraceFileError(str(exc).replace("run 0's", "the header run's")) from None
    end = header.get("end")
    if end is not None and (type(end) is not dict or type(end.get("ended")) is not bool):
        raise _fail(src, 1, f"the header's end is {end!r}, not {{\"ended\": true|false}}")
    return header


def _rows(src: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, event row) per event line, each checked: fields, gapless index, payload (atlas.replay.rows)."""
    with open(src) as f:
        f.readline()  # the header (_check_header)
        expected = 0
        for line_no, line in enumerate(f, start=2):
            if not line.strip():
                continue
            row = _parse(src, line_no, line)
            if type(row) is not dict or set(row) != _ROW_FIELDS:
                got = sorted(row) if type(row) is dict else type(row).__name__
                raise _fail(src, line_no, f"an event line has fields {', '.join(sorted(_ROW_FIELDS))}; this has {got}")
            if row["index"] != expected or type(row["index"]) is not int:
                raise _fail(src, line_no, f"event index {row['index']!r} where {expected} was due (gapless)")
            if type(row["step"]) is not int or type(row["digest"]) is not str:
                raise _fail(src, line_no, f"step {row['step']!r} and digest {row['digest']!r} are not an integer "
                            "and a string")
            try:
                check_payload(row["kind"], row["version"], row["payload"])
            except BadRow as exc:
                raise _fail(src, line_no, f"event {expected} ({row['kind']} v{row['version']}): {exc}") from None
            expected += 1
            yield line_no, row


def import_jsonl(src: str | Path, trace: str | Path) -> int:
    """Append the run in `src` (JSON lines) to the trace store `trace` as a new run; returns its run id. The whole
    file is checked before anything is written: a bad line leaves the store as it was."""
    try:
        with open(src) as f:
            first = f.readline()
    except UnicodeDecodeError:
        raise _fail(src, 1, "not text (not UTF-8): not JSON lines") from None
    if not first.strip():
        raise _fail(src, 1, "empty: no header line")
    header = _check_header(src, _parse(src, 1, first))
    try:
        for _ in _rows(src):
            pass
    except UnicodeDecodeError:
        raise TraceFileError(f"JSON lines {str(src)!r}: not text (not UTF-8)") from None
    end = header.get("end")
    writer = TraceWriter(trace, run=header["run"], mark_end=end is not None)
    ok = False
    try:
        try:
            for _, row in _rows(src):
                writer.append_row(row["index"], row["step"], row["kind"], row["version"], _compact(row["payload"]),
                                  row["digest"])
            ok = True
        finally:
            writer.close(ended=ok and bool(end and end.get("ended")))
    except TraceWriteError as exc:  # a full disk part way: the run stays marked truncated, the store is named
        raise TraceFileError(f"{where(trace)}: {exc}{space_note(trace)}") from None
    return writer.run_id
