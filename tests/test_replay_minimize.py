"""Minimising a failing trace: the run shrinks (fewer requests, shorter prompts and budgets, fewer steps)
while it still fails the same way; the minimised trace replays like any other."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.broken import VARIANTS
from fixtures.library import TRACES, arrive
from typer.testing import CliRunner

from atlas.cli import app
from atlas.replay.against import STILL_THERE, against
from atlas.replay.minimize import Input, candidates, minimize
from atlas.replay.reader import TraceReader
from atlas.replay.verify import verify

runner = CliRunner()
NULL_VARIANTS = ["chunk_planner_off_by_one", "qsa_capacity_below_max_seq_len", "rollback_keeps_qsa_cursor",
                 "rollback_restores_some_layers_then_fails"]


def test_candidates_only_shrink() -> None:
    program = (arrive(2, "a", 6, 5, stream=True), Input(3, "cancel", "a"), Input(1, "fault", None, fault="fatal"))
    for cand in candidates(program):
        assert len(cand) <= len(program)
        assert sum(i.size() for i in cand) < sum(i.size() for i in program) or cand != program


@pytest.mark.parametrize("name", NULL_VARIANTS)
def test_a_library_trace_minimises_to_at_most_20_events_failing_the_same_way(name: str, tmp_path: Path) -> None:
    variant, machine = VARIANTS[name]
    out = tmp_path / "min.db"
    with variant():
        m = minimize(TRACES / f"{name}.db", out)
        assert verify(out).identical  # the minimised trace is a faithful recording of its run
        assert against(out).outcome == STILL_THERE
    assert m.failure.machine == machine and len(m.rows) <= 20 and len(m.rows) <= m.events_before
    assert m.requests == 1 < m.requests_before
    reader = TraceReader(out)
    kinds = [e.kind for e in reader.events(reader.run().run_id)]
    reader.close()
    assert kinds[-1] == "invariant_violated" and kinds.count("request_arrived") == 1


def test_cli_minimize_reports_sizes_and_refuses_a_trace_that_passes(tmp_path: Path) -> None:
    name = "chunk_planner_off_by_one"
    with VARIANTS[name][0]():
        result = runner.invoke(app, ["trace", "minimize", str(TRACES / f"{name}.db"), "-o", str(tmp_path / "m.db")])
    assert result.exit_code == 0, result.output
    assert "8 -> " in result.output and "2 -> 1 requests" in result.output and "Scheduler" in result.output
    passing = runner.invoke(app, ["trace", "minimize", str(TRACES / f"{name}.db"), "-o", str(tmp_path / "n.db")])
    assert passing.exit_code == 1 and "cannot minimise" in passing.output
