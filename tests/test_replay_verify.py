"""The trace store and replay: a recorded run replays event for event; an edited payload is reported at
exactly that event."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas.config import EngineConfig
from atlas.errors import EngineDead
from atlas.registry import build_engine
from atlas.replay.codec import decode
from atlas.replay.reader import TraceReader
from atlas.replay.verify import check_state_only, verify
from atlas.sampling.params import SamplingParams

CONFIG = EngineConfig(max_seq_len=48, max_batch_size=3, prefill_chunk_tokens=8, block_size=4, num_kv_blocks=14)


def record(path: Path | str, *, fatal_at: int | None = None, config: EngineConfig = CONFIG,
           arrivals: list[tuple[int, int, int, float]] | None = None) -> None:
    """A run with staggered arrivals, a cancellation, an injected step error and a tight KV pool."""
    engine = build_engine("atlas-tiny", backend="null", config=config, trace=str(path))
    arrivals = arrivals or [(0, 20, 12, 0.0), (0, 9, 20, 0.9), (2, 30, 10, 0.0), (5, 4, 25, 0.7), (9, 15, 8, 0.0)]
    try:
        for it in range(400):
            for i, (at, prompt_len, max_tokens, temperature) in enumerate(arrivals):
                if at == it:
                    engine.add_request(f"r{i}", [(i * 7 + k) % 256 for k in range(prompt_len)],
                                       SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i))
            if it == 6:
                engine.cancel("r1")
            if it == 11:
                engine.inject_fault("step_error", "r2")
            if it == fatal_at:
                engine.inject_fault("fatal")
            engine.step()
            if it > 9 and not engine.has_unfinished():
                break
    except EngineDead:
        pass
    finally:
        engine.close()


def edit_event(path: Path, index: int, edit) -> None:
    con = sqlite3.connect(path)
    kind, version, payload = con.execute("select kind, version, payload from events where idx = ?",
                                         (index,)).fetchone()
    payload = decode(kind, version, payload)  # JSON text, or codec 1 for a step event; written back as JSON
    con.execute("update events set payload = ? where idx = ?", (json.dumps(edit(payload)), index))
    con.commit()
    con.close()


def indices_of(path: Path, kind: str) -> list[int]:
    con = sqlite3.connect(path)
    rows = [r[0] for r in con.execute("select idx from events where kind = ? order by idx", (kind,))]
    con.close()
    return rows


def test_a_recorded_run_replays_event_for_event(tmp_path: Path) -> None:
    path = tmp_path / "run.db"
    record(path)
    reader = TraceReader(path)
    run = reader.run()
    kinds = [e.kind for e in reader.events(run.run_id)]
    assert (run.backend, run.model, EngineConfig.from_json(run.config)) == ("null", "atlas-tiny", CONFIG)
    assert run.engine_version and run.capacities["num_kv_blocks"] == 14
    for kind in ("request_arrived", "request_cancelled", "fault_injected", "sequence_preempted", "step_planned",
                 "step_executed", "request_finished", "engine_faulted"):
        assert kind in kinds, kind
    report = verify(path)
    assert report.identical, report.divergence and report.divergence.describe()
    assert report.events_replayed == report.events_expected == len(kinds)
    assert report.fingerprint_matches
    assert check_state_only(path).problem is None


@pytest.mark.parametrize(
    ("kind", "nth", "edit", "why"),
    [
        ("step_executed", 7, lambda p: {**p, "tokens": [(t + 1) % 256 if t >= 0 else t for t in p["tokens"]]},
         "payload differs"),
        ("step_planned", 3, lambda p: {**p, "fed": [max(1, n - 1) for n in p["fed"]]}, "payload differs"),
        ("request_finished", 1, lambda p: {**p, "detail": "edited"}, "payload differs"),
        # an edited input is re-driven as edited: the state digest recorded after it no longer matches
        ("request_arrived", 2, lambda p: {**p, "prompt": [1, *p["prompt"][1:]]}, "state digest differs"),
    ],
)
def test_an_edited_payload_is_reported_at_exactly_that_event(tmp_path: Path, kind, nth, edit, why) -> None:
    path = tmp_path / "run.db"
    record(path)
    index = indices_of(path, kind)[nth]
    edit_event(path, index, edit)
    report = verify(path)
    assert not report.identical
    d = report.divergence
    assert (d.index, d.why, d.expected_kind) == (index, why, kind)
    assert d.expected_digest and d.actual_digest
    assert f"event {index}" in d.describe()
    state_check = check_state_only(path)
    assert state_check.index == index, state_check


def test_a_fatal_fault_replays_too(tmp_path: Path) -> None:
    path = tmp_path / "fatal.db"
    record(path, fatal_at=4)
    reader = TraceReader(path)
    events = list(reader.events(reader.run().run_id))
    faulted = [e for e in events if e.kind == "engine_faulted" and e.payload["fatal"]]
    assert len(faulted) == 1 and faulted[0].payload["injected"]
    assert events[-1].kind == "request_finished"  # flushed before EngineDead was raised
    report = verify(path)
    assert report.identical and report.note.startswith("engine dead")


def test_inputs_replay_at_their_place_in_the_event_stream(tmp_path: Path) -> None:
    # a step that only fires a fault emits events without advancing the step counter: an arrival after it,
    # stamped with the same step, must still replay after those events
    path = tmp_path / "order.db"
    engine = build_engine("atlas-tiny", backend="null", config=CONFIG, trace=str(path))
    engine.inject_fault("step_error", "nobody")
    engine.step()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    engine.inject_fault("step_error")
    engine.step()
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    reader = TraceReader(path)
    kinds = [(e.step, e.kind) for e in reader.events(reader.run().run_id)]
    assert kinds[:4] == [(0, "fault_injected"), (0, "engine_faulted"), (0, "request_arrived"), (0, "fault_injected")]
    report = verify(path)
    assert report.identical, report.divergence.describe()


def test_old_event_versions_are_upcast_when_a_trace_is_read(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "old.db"
    record(path, arrivals=[(0, 5, 3, 0.0)])
    # pretend this engine's request_finished is v2, with a field v1 traces lack
    from atlas.state import events as ev

    monkeypatch.setitem(ev.UPCASTERS, ("request_finished", 1), lambda p: {**p, "detail": f"v1: {p['detail']}"})
    monkeypatch.setattr(ev.RequestFinished, "version", 2)
    reader = TraceReader(path)
    finished = [e for e in reader.events(reader.run().run_id) if e.kind == "request_finished"]
    assert finished[0].version == 1 and finished[0].payload["detail"] == "v1: max_tokens 3"
    assert finished[0].event() == ev.RequestFinished(0, "length", "v1: max_tokens 3")


def test_any_sqlalchemy_url_and_several_runs_in_one_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    record(url)
    record(url, arrivals=[(0, 5, 5, 0.0)])
    reader = TraceReader(url)
    runs = reader.runs()
    assert [r.run_id for r in runs] == [1, 2]
    assert reader.count_events(1) > reader.count_events(2) > 0
    assert verify(url, run_id=1).identical and verify(url).identical


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 30), st.integers(1, 16),
                                st.sampled_from([0.0, 0.8])), min_size=1, max_size=5),
    chunk=st.integers(3, 12),
)
def test_generated_runs_replay_identically(arrivals, chunk) -> None:
    config = EngineConfig(max_seq_len=48, max_batch_size=3, prefill_chunk_tokens=chunk, block_size=4,
                          num_kv_blocks=12)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.db"
        record(path, config=config, arrivals=arrivals)
        report = verify(path)
        assert report.identical, report.divergence.describe()
