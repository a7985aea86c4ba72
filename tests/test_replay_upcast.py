"""A trace written by the first event schema (RequestArrived v1 without `stream`, StepPlanned v1 without
`drafts`, StepExecuted v1 without `accepted`/`verdicts`, a run row whose config predates speculation and
rollback) loads through the upcasters, passes the state-only audit, replays event for event on today's
engine, and exports back byte for byte (events stay as recorded)."""

from __future__ import annotations

import json
from pathlib import Path

from atlas.replay.against import PASSES, against
from atlas.replay.jsonl import export_jsonl, import_jsonl
from atlas.replay.reader import TraceReader
from atlas.replay.verify import check_state_only, verify
from atlas.state.events import EVENT_TYPES

FIXTURE = Path(__file__).parent / "fixtures" / "v1_trace.jsonl"


def test_the_fixture_is_old_schema() -> None:
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()[1:]]
    versions = {(r["kind"], r["version"]) for r in rows}
    for kind in ("request_arrived", "step_planned", "step_executed"):
        assert (kind, 1) in versions and EVENT_TYPES[kind].version > 1, kind
    assert "request_cancelled" in {r["kind"] for r in rows}
    assert not any("drafts" in r["payload"] or "stream" in r["payload"] for r in rows)


def test_a_v1_trace_loads_checks_and_replays(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    import_jsonl(FIXTURE, db)
    reader = TraceReader(db)
    events = list(reader.events(reader.run().run_id))
    reader.close()
    planned = next(e for e in events if e.kind == "step_planned")
    assert planned.version == 1 and planned.event().drafts == ()
    arrived = next(e for e in events if e.kind == "request_arrived")
    assert arrived.event().stream is False
    assert check_state_only(db).problem is None
    report = verify(db)
    assert report.identical, report.divergence and report.divergence.describe()
    assert against(db).outcome == PASSES
    export_jsonl(db, tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_bytes() == FIXTURE.read_bytes()
