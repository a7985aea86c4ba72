"""Replay against the current code: outcomes (passes, failure gone, still there, new failure), the field-level
divergence report, recorded scripted-drafter choices, and the CLI (replay against, trace export/import)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from fixtures.broken import VARIANTS, chunk_planner_off_by_one, rollback_keeps_qsa_cursor
from fixtures.library import SCENARIOS, TRACES, record
from typer.testing import CliRunner

from atlas.cli import app
from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.replay.against import FAILURE_GONE, NEW_FAILURE, PASSES, STILL_THERE, against, field_diff
from atlas.replay.codec import decode
from atlas.replay.jsonl import export_jsonl, import_jsonl
from atlas.replay.minimize import run_program
from atlas.replay.reader import TraceReader
from atlas.replay.verify import verify

runner = CliRunner()


def clean_trace(path: Path) -> None:
    """The chunk planner's scenario on today's code: two requests, no failure."""
    s = SCENARIOS["chunk_planner_off_by_one"]
    engine = build_engine(s.model, s.backend, s.config, trace=str(path))
    try:
        run_program(engine, s.program)
    finally:
        engine.close()


def test_field_diff_names_dotted_leaves() -> None:
    expected = {"step": 3, "cursors": {"kv": 4, "qsa": 9}, "fed": [1, 8]}
    actual = {"step": 3, "cursors": {"kv": 4, "qsa": 4}, "fed": [1, 7], "new": True}
    assert field_diff(expected, actual) == [("cursors.qsa", 9, 4), ("fed", [1, 8], [1, 7]), ("new", None, True)]
    assert field_diff(expected, expected) == []


def test_a_clean_run_passes_with_no_divergence(tmp_path: Path) -> None:
    clean_trace(tmp_path / "clean.db")
    report = against(tmp_path / "clean.db")
    assert report.outcome == PASSES and report.divergence is None
    assert report.events_replayed == report.events_expected
    assert "identical: " in report.describe()


def test_an_edited_token_is_the_first_divergence_with_its_field(tmp_path: Path) -> None:
    path = tmp_path / "run.db"
    clean_trace(path)
    con = sqlite3.connect(path)
    idx, version, payload = con.execute("select idx, version, payload from events where kind = 'step_executed' "
                                        "order by idx limit 1 offset 3").fetchone()
    p = decode("step_executed", version, payload)  # codec 1 (bytes) as recorded; written back as JSON
    p["tokens"] = [(t + 1) % 256 if t >= 0 else t for t in p["tokens"]]
    con.execute("update events set payload = ? where idx = ?", (json.dumps(p), idx))
    con.commit()
    con.close()
    report = against(path)
    assert report.divergence.index == idx and report.outcome == PASSES
    assert f"first divergence at event {idx}" in report.describe() and "  tokens: expected" in report.describe()


def test_a_different_failure_today_is_a_new_failure(tmp_path: Path) -> None:
    # recorded under one broken variant, replayed under another that fails first
    path = tmp_path / "qsa.db"
    with rollback_keeps_qsa_cursor():
        record("rollback_keeps_qsa_cursor", path)
    with chunk_planner_off_by_one():
        report = against(path)
    assert report.outcome == NEW_FAILURE
    assert report.recorded.machine == "BackendCursors" and report.actual.machine == "Scheduler"
    assert "outcome: new failure" in report.describe()


def test_cli_replay_against_exit_codes(tmp_path: Path) -> None:
    gone = runner.invoke(app, ["replay", "against", str(TRACES / "chunk_planner_off_by_one.db")])
    assert gone.exit_code == 0, gone.output
    assert "first divergence at event 6" in gone.output and "outcome: failure gone" in gone.output
    with VARIANTS["chunk_planner_off_by_one"][0]():
        still = runner.invoke(app, ["replay", "against", str(TRACES / "chunk_planner_off_by_one.db")])
    assert still.exit_code == 1 and f"outcome: {STILL_THERE}" in still.output


def test_export_import_round_trips_exactly(tmp_path: Path) -> None:
    src = TRACES / "rollback_keeps_qsa_cursor.db"
    out = tmp_path / "a.jsonl"
    result = runner.invoke(app, ["trace", "export", str(src), "-o", str(out)])
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "atlas-trace" and header["run"]["backend"] == "null-looping"
    assert [json.loads(line)["index"] for line in lines[1:]] == list(range(len(lines) - 1))
    result = runner.invoke(app, ["trace", "import", str(out), "-o", str(tmp_path / "b.db")])
    assert result.exit_code == 0 and "imported as run 1" in result.output
    export_jsonl(tmp_path / "b.db", tmp_path / "b.jsonl")
    assert (tmp_path / "b.jsonl").read_bytes() == out.read_bytes()
    a, b = TraceReader(src), TraceReader(tmp_path / "b.db")
    assert list(a.events(1)) == list(b.events(1))
    a.close()
    b.close()
    # a second import appends a run; the imported trace replays like the original
    assert import_jsonl(out, tmp_path / "b.db") == 2
    assert against(tmp_path / "b.db").outcome == FAILURE_GONE


def test_scripted_drafter_choices_are_re_driven_from_the_trace(tmp_path: Path) -> None:
    from atlas.engine.drafters import ScriptedDrafter

    config = EngineConfig(max_seq_len=48, max_batch_size=2, prefill_chunk_tokens=16, num_drafts=2,
                          drafter="scripted")
    path = tmp_path / "scripted.db"
    s = SCENARIOS["drafter_rows_off_by_one"]
    script = ScriptedDrafter(lambda r: [r.tokens[-1], (r.tokens[-1] * 7) % 256])
    engine = build_engine(s.model, "cpu", config, trace=str(path), drafter=script)
    try:
        run_program(engine, s.program)
    finally:
        engine.close()
    assert script.requests  # it drafted
    report = against(path)  # no script given: the recorded choices are proposed again
    assert report.outcome == PASSES and report.divergence is None, report.describe()
    assert verify(path, engine_kwargs={"drafter": script}).identical


def test_an_uninjected_fault_is_the_failure_when_no_invariant_broke(tmp_path: Path, monkeypatch) -> None:
    # the lane's bound bug alone: the row-blind backend refuses the crossing verify, the request ends with
    # `error` (correctly), so the run's failure is that fault: still there under the bug, gone without it
    import atlas.engine.drafters.lane as lane_module

    bound = lane_module.inert_bound
    path = tmp_path / "fault.db"
    with monkeypatch.context() as m:
        m.setattr(lane_module, "inert_bound", lambda caps: bound(caps) + caps.verify_width - 1)
        s = SCENARIOS["verify_crosses_qsa_bound_error_as_stop"]
        engine = build_engine(s.model, s.backend, s.config, trace=str(path))
        try:
            run_program(engine, s.program)
        finally:
            engine.close()
        still = against(path)
    assert still.outcome == STILL_THERE and still.divergence is None
    assert (still.recorded.kind, still.recorded.machine, still.recorded.message) == ("fault", "step_error",
                                                                                      "ValueError")
    gone = against(path)
    assert gone.outcome == FAILURE_GONE and gone.divergence.actual_kind == "speculation_latched_off"
