"""The CLI over the engine and the trace store: generate -> trace show -> replay verify (and a tampered trace)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from typer.testing import CliRunner

from atlas.cli import app
from atlas.replay.codec import decode
from atlas.replay.summary import summarize

runner = CliRunner()


def test_generate_show_and_verify_a_trace(tmp_path: Path) -> None:
    trace = tmp_path / "gen.db"
    result = runner.invoke(app, ["generate", "--prompt", "hello there", "--prompt", "abc", "--backend", "null",
                                 "--max-tokens", "6", "--max-seq-len", "64", "--max-batch-size", "2",
                                 "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert result.output.count("finish_reason=") == 2

    summary = summarize(trace)
    assert [(r.request_id, r.prompt_tokens) for r in summary.requests] == [("gen-0", 11), ("gen-1", 3)]
    for r in summary.requests:
        assert r.finish_reason in ("length", "stop") and 1 <= r.completion_tokens <= 6
    assert summary.event_counts["request_arrived"] == 2 and summary.run.backend == "null"

    shown = runner.invoke(app, ["trace", "show", str(trace)])
    assert shown.exit_code == 0, shown.output
    assert "gen-0" in shown.output and "step_executed" in shown.output and "backend null" in shown.output

    verified = runner.invoke(app, ["replay", "verify", str(trace), "--audit"])
    assert verified.exit_code == 0, verified.output
    assert "identical" in verified.output
    checked = runner.invoke(app, ["replay", "check", str(trace)])
    assert checked.exit_code == 0 and "consistent" in checked.output

    con = sqlite3.connect(trace)
    idx, version, payload = con.execute("select idx, version, payload from events where kind = 'step_executed' "
                                        "order by idx limit 1 offset 2").fetchone()
    p = decode("step_executed", version, payload)  # codec 1 (bytes) as recorded; written back as JSON
    p["tokens"] = [(t + 1) % 256 if t >= 0 else t for t in p["tokens"]]
    con.execute("update events set payload = ? where idx = ?", (json.dumps(p), idx))
    con.commit()
    con.close()
    tampered = runner.invoke(app, ["replay", "verify", str(trace)])
    assert tampered.exit_code == 1
    assert f"first divergence at event {idx}: payload differs" in tampered.output
    checked = runner.invoke(app, ["replay", "check", str(trace)])
    assert checked.exit_code == 1 and checked.output.startswith(f"event {idx}: digest")
