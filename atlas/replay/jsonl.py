"""Traces as JSON lines, for diffing and sharing: a header line with the run, then one line per event.

Events are written as recorded (their schema version and payload as stored, never upcast), so
export -> import -> export round-trips byte for byte and an old trace stays old until it is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from atlas.replay.codec import decode
from atlas.replay.store import TraceReader, TraceWriter, events

FORMAT = "atlas-trace"
FORMAT_VERSION = 1
_RUN_FIELDS = ("engine_version", "git_revision", "model", "model_fingerprint", "backend", "seed", "config",
               "capacities")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def raw_events(reader: TraceReader, run_id: int) -> Iterator[dict[str, Any]]:
    """A run's events as stored: payload parsed (JSON text, or a codec-1 step payload), never upcast."""
    query = sa.select(events).where(events.c.run_id == run_id).order_by(events.c.idx)
    with reader.db.connect() as conn:
        for r in conn.execute(query).mappings():
            yield {"index": r["idx"], "step": r["step"], "kind": r["kind"], "version": r["version"],
                   "payload": decode(r["kind"], r["version"], r["payload"]), "digest": r["digest"]}


def export_jsonl(trace: str | Path, out: str | Path, run_id: int | None = None) -> int:
    """Write one run of `trace` to `out` as JSON lines; returns the number of events."""
    reader = TraceReader(trace)
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
    finally:
        reader.close()
    return n


def import_jsonl(src: str | Path, trace: str | Path) -> int:
    """Append the run in `src` (JSON lines) to the trace store `trace` as a new run; returns its run id."""
    with open(src) as f:
        header = json.loads(f.readline())
        if header.get("format") != FORMAT:
            raise ValueError(f"{src}: not an Atlas trace in JSON lines (header format {header.get('format')!r})")
        if header.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"{src}: format version {header['format_version']} is newer than {FORMAT_VERSION}")
        end = header.get("end")
        writer = TraceWriter(trace, run=header["run"], mark_end=end is not None)
        ok = False
        try:
            expected = 0
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                if row["index"] != expected:
                    raise ValueError(f"{src}: event index {row['index']} where {expected} was due (gapless)")
                expected += 1
                writer.append_row(row["index"], row["step"], row["kind"], row["version"], _compact(row["payload"]),
                                  row["digest"])
            ok = True
        finally:
            writer.close(ended=ok and bool(end and end.get("ended")))
    return writer.run_id
