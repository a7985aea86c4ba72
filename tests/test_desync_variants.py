"""Issue 13's table: every data-plane desync (one skipped or misplaced state update of the CPU reference) is
caught by an invariant at the step that made it, named by sequence, layer, state kind and both positions."""

from __future__ import annotations

import pytest
from fixtures import broken
from fixtures.broken import VARIANTS
from fixtures.library import SCENARIOS

from atlas.engine.records import RecordingSink
from atlas.errors import InvariantViolation
from atlas.registry import build_engine
from atlas.replay.minimize import run_program

DESYNCS = ["gdn_state_not_updated", "kv_row_not_written", "ple_context_not_advanced", "qsa_key_not_ingested",
           "commit_keeps_rejected_gdn", "commit_keeps_rejected_qsa_keys", "drafter_rows_not_rebuilt_from_target",
           "rollback_does_not_rewind_gdn", "rollback_does_not_rewind_ple"]


def _caught(name: str) -> tuple[InvariantViolation, int]:
    """Run the variant's scenario: the violation that killed the engine and the step the variant first acted."""
    variant, _ = VARIANTS[name]
    s = SCENARIOS[name]
    sink = RecordingSink()
    broken.FIRED.clear()
    first_fired: list[int] = []
    with variant():
        engine = build_engine(s.model, s.backend, s.config, sink=sink)
        step = engine.step

        def watched() -> list:  # the step in which the variant first acted
            at = engine.state.step
            try:
                return step()
            finally:
                if broken.FIRED and not first_fired:
                    first_fired.append(at)

        engine.step = watched  # type: ignore[method-assign]
        run_program(engine, s.program, max_steps=200)  # returns once the engine died
    v = engine.cause_of_death
    assert isinstance(v, InvariantViolation), f"{name} was not caught: {v!r}"
    assert first_fired, f"{name} never acted in its scenario"
    return v, first_fired[0]


@pytest.mark.parametrize("name", broken.STAMPS_SEE)
def test_the_position_stamps_alone_catch_a_desync_at_the_step_that_made_it(name: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the audit (the default when serving), the position stamps catch every desync that moves a
    position; the one that does not (drafter rows built from the wrong hidden) needs the audit."""
    monkeypatch.setenv("ATLAS_STATE_AUDIT", "0")
    v, step = _caught(name)
    assert v.machine == "BackendCursors", v
    assert v.fields["step"] == step, (v, step)
    if "layer" in v.fields:  # named: sequence, layer, state kind, both positions
        assert {"seq_id", "layer", "state", "data_plane", "control_plane"} <= set(v.fields)
        assert v.fields["data_plane"] != v.fields["control_plane"]


@pytest.mark.parametrize("name", DESYNCS)
def test_with_the_audit_on_every_desync_is_caught_at_the_step_that_made_it(name: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit (tests, replay) checks restored and committed bytes inside the data-plane call, so it names a
    restore that rewinds only some state (StateDigest) before the stamps would; never a later step."""
    monkeypatch.setenv("ATLAS_STATE_AUDIT", "1")
    v, step = _caught(name)
    assert v.machine == VARIANTS[name][1], v
    assert v.fields["step"] == step, (v, step)


# The negative control (each scenario runs clean on the unbroken code) is
# tests/test_traces_library.py::test_against_the_current_code_the_failure_is_gone_...: it replays every variant's
# library trace, recorded from these scenarios, against today's code and asserts the failure is gone; running the
# nine scenarios clean here as well cost ~60 s of a suite at its 15-minute line.
